"""Hostile data input (issue 16, "Data validated at prep" and "Files we read are data, never paths out"): every
source checks what it reads, and a prepared manifest is validated whole, and against its shards, before use. Each
defect fails as a ``ValueError`` naming the file (or archive member) and the field, what was found, and the fix."""

import copy
import json
import os
import pickle
import shutil
import struct
import tarfile
import traceback

import hypothesis
import numpy as np
import pytest

from training_core.config import DataConfig
from training_core.data import ArraySpec, Manifest, ShardInfo, prepare, read_shard, write_prepared
from training_core.data.sources import CIFAR10_BATCHES, CIFAR10_MAX_MEMBER_BYTES, RawDataset, load_raw

MAX_MESSAGE_CHARS = 4096
BATCH_1 = CIFAR10_BATCHES[0]


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as excinfo:
        call(*args, **kwargs)
    message = str(excinfo.value)
    assert len(message) < MAX_MESSAGE_CHARS, message[:500]
    return message


def _record(rows: int = 2, seed: int = 0, **fields) -> dict:
    """A batch record as the CIFAR-10 python format pickles it; ``fields`` (``data=``, ``labels=``) replace its
    values."""
    rng = np.random.default_rng(seed)
    record = {
        b"batch_label": b"training batch 1 of 5",
        b"data": rng.integers(0, 256, size=(rows, 3072), dtype=np.uint8),
        b"labels": rng.integers(0, 10, rows).tolist(),
        b"filenames": [b"img_%d.png" % i for i in range(rows)],
    }
    record.update({key.encode(): value for key, value in fields.items()})
    return record


def _cifar_archive(path, batch_1=None, *, extra=(), mode="w"):
    """A CIFAR-10 python tarball at ``path``: six valid batches of two rows, ``data_batch_1`` replaced by
    ``batch_1`` (raw bytes, or an object to pickle), then the ``extra`` (name, bytes) members."""
    members = [(name, pickle.dumps(_record(seed=i), protocol=2)) for i, name in enumerate(CIFAR10_BATCHES)]
    if batch_1 is not None:
        members[0] = (BATCH_1, batch_1 if isinstance(batch_1, bytes) else pickle.dumps(batch_1, protocol=2))
    with tarfile.open(path, mode) as archive:
        for name, payload in [*members, *extra]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            archive.addfile(info, __import__("io").BytesIO(payload))
    return str(path)


def _cifar_error(path) -> str:
    return _error(load_raw, DataConfig(dataset="cifar10", path=str(path)))


def test_a_valid_small_cifar_archive_reads_every_batch_with_its_labels(tmp_path):
    raw = load_raw(DataConfig(dataset="cifar10", path=_cifar_archive(tmp_path / "c.tar")))
    images, labels = raw.splits["train"]
    assert images.shape == (10, 3, 32, 32) and images.dtype == np.uint8 and labels.dtype == np.int64
    assert labels[:2].tolist() == _record(seed=0)[b"labels"]
    assert raw.splits["test"][0].shape == (2, 3, 32, 32)


def test_a_batch_with_fewer_labels_than_images_names_the_member_and_both_counts(tmp_path):
    path = _cifar_archive(tmp_path / "c.tar", _record(rows=3, labels=[1, 2]))
    message = _cifar_error(path)
    assert f"member {BATCH_1!r} has 3 rows in b'data' but 2 entries in b'labels'" in message
    assert message.startswith("data.path=") and message.endswith("download cifar-10-python.tar.gz again")


def test_float_pixels_are_refused_not_truncated_to_zero(tmp_path):
    path = _cifar_archive(tmp_path / "c.tar", _record(data=np.full((2, 3072), 0.7)))
    assert "has b'data' of dtype float64 and shape (2, 3072); the format's is a uint8 array" in _cifar_error(path)


def test_integer_pixels_outside_the_byte_range_are_refused_not_wrapped(tmp_path):
    path = _cifar_archive(tmp_path / "c.tar", _record(data=np.full((2, 3072), 300, dtype=np.int64)))
    assert f"member {BATCH_1!r} has b'data' pixels 300..300; the format's pixels are 0..255" in _cifar_error(path)


def test_integer_pixels_within_the_byte_range_are_read_whatever_their_dtype(tmp_path):
    pixels = np.arange(2 * 3072, dtype=np.int32).reshape(2, 3072) % 256
    raw = load_raw(DataConfig(dataset="cifar10", path=_cifar_archive(tmp_path / "c.tar", _record(data=pixels))))
    assert np.array_equal(raw.splits["train"][0][:2].reshape(2, 3072), pixels)


@pytest.mark.parametrize(
    ("labels", "found"),
    [
        ([1, 2.9], "b'labels'[1]=2.9 (float); labels are integers 0..9"),
        ([True, 1], "b'labels'[0]=True (bool); labels are integers 0..9"),
        ([1, 11], "b'labels'[1]=11; labels are 0..9"),
        ([-100, 1], "b'labels'[0]=-100; labels are 0..9"),
        (np.array([3, 10], dtype=np.uint8), "b'labels'[1]=10; labels are 0..9"),
        (np.array([3.0, 1.0]), "b'labels' of dtype float64 and shape (2,); the format's is a list of integers 0..9"),
        ({0: 1}, "b'labels' of type dict; the format's is a list of integers 0..9"),
    ],
    ids=["float", "bool", "eleven", "minus-100", "array-out-of-range", "float-array", "dict"],
)
def test_a_label_that_is_not_an_integer_0_to_9_is_refused_naming_the_member_and_index(tmp_path, labels, found):
    message = _cifar_error(_cifar_archive(tmp_path / "c.tar", _record(labels=labels)))
    assert f"member {BATCH_1!r} has {found}" in message, message


def test_a_second_data_batch_1_elsewhere_in_the_archive_is_an_error_naming_both(tmp_path):
    decoy = pickle.dumps(_record(seed=99), protocol=2)
    message = _cifar_error(_cifar_archive(tmp_path / "c.tar", extra=[("elsewhere/data_batch_1", decoy)]))
    assert (
        "the tarball has 2 member(s) named data_batch_1: 'cifar-10-batches-py/data_batch_1', "
        "'elsewhere/data_batch_1'; the format has exactly one, 'cifar-10-batches-py/data_batch_1'"
    ) in message


def test_the_same_member_twice_is_an_error_not_a_silent_replacement(tmp_path):
    again = pickle.dumps(_record(seed=99), protocol=2)
    message = _cifar_error(_cifar_archive(tmp_path / "c.tar", extra=[(CIFAR10_BATCHES[5], again)]))
    assert "has 2 member(s) named test_batch: 'cifar-10-batches-py/test_batch', 'cifar-10-batches-py/test_batch'" in (
        message
    )


def test_a_batch_only_at_another_path_is_named_with_where_the_format_puts_it(tmp_path):
    path = tmp_path / "c.tar"
    _cifar_archive(path)
    moved = tmp_path / "moved.tar"
    with tarfile.open(path) as source, tarfile.open(moved, "w") as target:
        for member in source.getmembers():
            payload = source.extractfile(member)
            member.name = member.name.replace("cifar-10-batches-py/", "./cifar-10-batches-py/")
            target.addfile(member, payload)
    assert "has 1 member(s) named data_batch_1: './cifar-10-batches-py/data_batch_1'; the format has exactly one" in (
        _cifar_error(moved)
    )


@pytest.mark.parametrize(
    ("batch", "found"),
    [
        ([1, 2, 3], "holds a list; the format's batch is a dict with keys b'data' and b'labels'"),
        ({b"data": np.zeros((2, 3072), np.uint8)}, "has the keys b'data'; the format's batch is a dict with b'data'"),
        ({"data": np.zeros((2, 3072), np.uint8), "labels": [1, 2]}, "has the keys 'data', 'labels'; the format's"),
        (_record(extra=1), "has the keys b'batch_label', b'data', b'labels', b'filenames', b'extra'; the format's"),
        (_record(data=np.zeros((2, 1024), np.uint8)), "has b'data' of dtype uint8 and shape (2, 1024)"),
        (_record(data=[[0] * 3072] * 2), "has b'data' of type list; the format's is a uint8 array"),
        (_record(data=np.zeros((2, 3072), bool)), "has b'data' of dtype bool and shape (2, 3072)"),
        (_record(rows=0), "has no rows in b'data'"),
    ],
    ids=["list", "no-labels", "str-keys", "unknown-key", "3072-columns", "list-data", "bool-data", "empty"],
)
def test_a_record_that_is_not_the_formats_dict_names_the_member_and_what_it_holds(tmp_path, batch, found):
    message = _cifar_error(_cifar_archive(tmp_path / "c.tar", batch))
    assert f"member {BATCH_1!r} {found}" in message, message


def test_a_numpy_object_array_is_refused_before_it_is_built(tmp_path):
    pixels = np.empty((2, 3072), dtype=object)
    pixels[:] = 1
    message = _cifar_error(_cifar_archive(tmp_path / "c.tar", _record(data=pixels)))
    assert f"member {BATCH_1!r} is not a readable batch pickle (UnpicklingError: refusing a numpy object array" in (
        message
    )


class _ArrayOfShape:
    """Pickles as numpy's own array rebuild, with the shape (and, given ``state``, the stored state) chosen."""

    def __init__(self, shape, state=None) -> None:
        self.shape, self.state = shape, state

    def __reduce__(self):
        reconstruct, args, _ = np.zeros(0).__reduce__()
        return (reconstruct, (args[0], self.shape, args[2])) + ((self.state,) if self.state else ())


HUGE = 2**40


@pytest.mark.parametrize(
    ("payload", "found"),
    [
        (b"\x80\x04\x8e" + struct.pack("<Q", HUGE) + b"abc.", "expected 1099511627776 bytes in a bytes8"),
        (b"\x80\x04\x8d" + struct.pack("<Q", HUGE) + b"abc.", "expected 1099511627776 bytes in a unicodestring8"),
        (b"\x80\x04\x95" + struct.pack("<Q", HUGE) + b"}.", "a frame of 1099511627776 bytes at offset 2"),
        (b"\x80\x02}r" + struct.pack("<I", 2**31) + b".", "memo index 2147483648 at offset 3"),
        (pickle.dumps(_ArrayOfShape((HUGE,)), protocol=2), "refusing an array of shape (1099511627776,)"),
        (
            pickle.dumps(_ArrayOfShape((0,), (1, (HUGE,), np.dtype(np.uint8), False, b"abc")), protocol=2),
            "ValueError",
        ),
        (b"\x80\x02]q\x00(K\x01K\x02", "pickle exhausted before seeing STOP"),
        (b"\x80\x02cos\nsystem\nq\x00.", "refusing to load os.system from a dataset file"),
        (b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.", "refusing _codecs.encode"),
    ],
    ids=["bytes8", "unicode8", "frame", "memo", "array-shape", "array-state", "truncated", "global", "codec"],
)
def test_a_pickle_that_declares_a_huge_object_or_builds_other_things_is_a_value_error(tmp_path, payload, found):
    message = _cifar_error(_cifar_archive(tmp_path / "c.tar", payload))
    assert f"member {BATCH_1!r} is not a readable batch pickle (" in message and found in message, message


def test_a_member_larger_than_a_batch_is_refused_unread(tmp_path):
    large = b"\0" * (CIFAR10_MAX_MEMBER_BYTES + 1)
    message = _cifar_error(_cifar_archive(tmp_path / "c.tar", large))
    assert f"member {BATCH_1!r} declares {len(large)} bytes, more than a batch's {CIFAR10_MAX_MEMBER_BYTES}" in message


def test_every_source_is_checked_after_reading_labels_within_the_classes_and_one_image_shape():
    images = np.zeros((2, 3, 4, 4), np.uint8)
    for labels, found in (([0, 2], "labels 0..2; expected 0..1"), ([-100, 1], "labels -100..1; expected 0..1")):
        raw = RawDataset(splits={"train": (images, np.array(labels, np.int64))}, classes=["a", "b"])
        assert _error(raw.check, "data.dataset='synthetic'").startswith(
            f"data.dataset='synthetic' gave split 'train' {found}"
        )
    bad = {
        "float labels": {"train": (images, np.array([0.0, 1.0]))},
        "int32 images": {"train": (images.astype(np.int32), np.array([0, 1]))},
        "count": {"train": (images, np.array([0], np.int64))},
        "shapes": {"train": (images, np.array([0, 1])), "test": (np.zeros((1, 3, 8, 8), np.uint8), np.array([0]))},
    }
    for name, splits in bad.items():
        assert _error(RawDataset(splits=splits, classes=["a", "b"]).check, "src").startswith("src gave "), name
    assert "class names must be unique" in _error(RawDataset(splits={}, classes=["a", "a"]).check, "src")


def test_credentials_in_data_path_never_appear_in_an_error(tmp_path):
    import fsspec

    missing = "memory://KEY:SECRET@bucket/nothing.tar.gz"
    assert "SECRET" not in _cifar_error(missing)
    present = "memory://KEY:SECRET@bucket/cifar.tar"
    with fsspec.open(present, "wb") as f:
        f.write(open(_cifar_archive(tmp_path / "c.tar", [1, 2]), "rb").read())
    message = _cifar_error(present)
    assert "SECRET" not in message and "data.path='memory://***@bucket/cifar.tar' is invalid: member" in message
    directory = "memory://KEY:SECRET@bucket/prepared"
    manifest = prepare(DataConfig(dataset="synthetic", synthetic_num_samples=40, synthetic_image_size=4), directory)
    shard = manifest.splits["train"].shards[0]
    with fsspec.open(f"{directory}/{shard.file}", "wb") as f:
        f.write(b"tampered")
    for message in (
        _error(read_shard, manifest, shard),
        _error(Manifest.load, "memory://KEY:SECRET@bucket/elsewhere"),
        _error(Manifest.from_json, "{}", directory=directory),
    ):
        assert "SECRET" not in message and "memory://***@bucket/" in message, message


@pytest.mark.parametrize("source", ["text", "tokenizer", "image_folder", "cifar10"])
def test_credentials_a_library_quotes_without_the_urls_scheme_never_appear_in_an_error(source):
    """fsspec strips ``s3://``: botocore names the bucket ``KEY:SECRET@bucket``, which no URL pattern can tell from
    text. A secret of each case's own, so no earlier redaction in this process helps."""
    from training_core.data.image_shards import check_source
    from training_core.data.text import check_text_source, load_tokenizer

    secret = f"SECRET{source.upper()}XYZ"
    url = f"s3://AKIA{source.upper()}:{secret}@bucket/data"
    checks = {
        "text": lambda: check_text_source(DataConfig(dataset="text", path=url)),
        "tokenizer": lambda: load_tokenizer(url + "/tokenizer.json"),
        "image_folder": lambda: check_source(DataConfig(dataset="image_folder", image_size=32, path=url)),
        "cifar10": lambda: check_source(DataConfig(dataset="cifar10", path=url + ".tar.gz")),
    }
    with pytest.raises(ValueError) as caught:
        checks[source]()
    message = "".join(traceback.format_exception(caught.value))
    assert secret not in message and "s3://***@bucket/data" in message, message


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A small prepared synthetic dataset: its directory and its manifest as parsed JSON."""
    out = tmp_path_factory.mktemp("prepared")
    cfg = DataConfig(
        dataset="synthetic", synthetic_num_samples=120, synthetic_image_size=4, synthetic_num_classes=5, num_shards=4
    )
    prepare(cfg, str(out))
    return out, json.loads((out / "manifest.json").read_text())


def _copy(prepared, tmp_path):
    directory = tmp_path / "data"
    shutil.copytree(prepared[0], directory)
    return directory


def test_prep_records_each_shards_label_range_and_reading_checks_it(prepared):
    directory, raw = prepared
    shards = raw["splits"]["train"]["shards"]
    assert raw["version"] == 4 and raw["workload"] == "image_classification"
    assert raw["arrays"] == {
        "images": {"dtype": "uint8", "shape": [3, 4, 4], "max_value": None},
        "labels": {"dtype": "int64", "shape": [], "max_value": 4},
    }
    assert all(
        set(s["bounds"]) == {"labels"} and 0 <= s["bounds"]["labels"][0] <= s["bounds"]["labels"][1] < 5 for s in shards
    )
    manifest = Manifest.load(str(directory))
    labels = read_shard(manifest, manifest.splits["train"].shards[0])["labels"]
    assert [int(labels.min()), int(labels.max())] == shards[0]["bounds"]["labels"]


def _as_version(raw: dict, version: int) -> dict:
    """A version-4 image manifest written as version 1 (no label ranges) or 2 (``label_min``/``label_max``)."""
    old = copy.deepcopy(raw)
    old["version"] = version
    for key in ("workload", "arrays", "spec", "format", "bad_samples"):
        del old[key]
    for split in old["splits"].values():
        for shard in split["shards"]:
            low, high = shard.pop("bounds")["labels"]
            if version == 2:
                shard["label_min"], shard["label_max"] = low, high
    return old


def test_a_version_2_manifest_still_loads_and_its_shards_label_ranges_are_checked(prepared, tmp_path):
    directory = _copy(prepared, tmp_path)
    raw = _as_version(prepared[1], 2)
    (directory / "manifest.json").write_text(json.dumps(raw))
    manifest = Manifest.load(str(directory))
    assert manifest.version == 2 and json.loads(manifest.to_json()) == raw
    assert manifest.workload == "image_classification" and set(manifest.arrays) == {"images", "labels"}
    shard = manifest.splits["train"].shards[0]
    assert shard.bounds["labels"] == [raw["splits"]["train"]["shards"][0][k] for k in ("label_min", "label_max")]
    read_shard(manifest, shard)
    raw["splits"]["train"]["shards"][0]["label_min"] = shard.bounds["labels"][1]
    (directory / "manifest.json").write_text(json.dumps(raw))
    manifest = Manifest.load(str(directory))
    assert "the manifest says" in _error(read_shard, manifest, manifest.splits["train"].shards[0])


@pytest.mark.parametrize(
    "name", ["../outside.npz", "../../etc/hostname", "/etc/hostname", "s3://bucket/x.npz", "sub/x.npz", "a\\b.npz"]
)
def test_a_shard_file_outside_the_directory_is_refused_before_anything_is_read(prepared, tmp_path, name):
    # The file outside is a valid shard with the recorded sha256: had it been read, the load would have succeeded.
    directory = _copy(prepared, tmp_path)
    raw = copy.deepcopy(prepared[1])
    shard = raw["splits"]["train"]["shards"][3]
    (tmp_path / "outside.npz").write_bytes((directory / shard["file"]).read_bytes())
    shard["file"] = name
    (directory / "manifest.json").write_text(json.dumps(raw))
    message = _error(Manifest.load, str(directory))
    assert message.startswith(f"{directory}/manifest.json: splits.train.shards[3].file={name!r} is invalid: ")
    assert "a shard file is a plain name inside the data directory" in message
    assert message.endswith("re-run data prep (prepare_data) to rewrite the directory")
    manifest = Manifest.load(str(prepared[0]))
    outside = ShardInfo(file="../outside.npz", num_samples=shard["num_samples"], sha256=shard["sha256"])
    assert "a shard file is a plain name" in _error(read_shard, manifest, outside)


def _set(raw, path, value):
    *parents, last = path
    for key in parents:
        raw = raw[key]
    if value is _DROP:
        del raw[last]
    else:
        raw[last] = value


_DROP = object()
BOUNDS = ("splits", "test", "shards", 0, "bounds", "labels")
IMAGES = ("arrays", "images")
LABELS = ("arrays", "labels")
ARRAY = {"dtype": "int64", "shape": [], "max_value": 4}


@pytest.mark.parametrize(
    ("path", "value", "found"),
    [
        (("splits", "train", "shards", 3, "file"), "", "splits.train.shards[3].file='' is invalid"),
        (("splits", "train", "shards", 3, "file"), "..", "splits.train.shards[3].file='..' is invalid"),
        (("splits", "train", "shards", 1, "file"), "train-00000-of-00004.npz", "another shard names the same file"),
        (("splits", "train", "shards", 0, "sha256"), "ab" * 31, "splits.train.shards[0].sha256='abab"),
        (("splits", "val", "shards", 0, "num_samples"), -1, "splits.val.shards[0].num_samples=-1 is invalid"),
        (("splits", "val", "num_samples"), 10**6, "splits.val.num_samples=1000000 is invalid: its shards hold"),
        (BOUNDS + (1,), 5, "splits.test.shards[0].bounds.labels[1]=5 is invalid: expected an integer 0..4"),
        (BOUNDS + (0,), -100, "splits.test.shards[0].bounds.labels[0]=-100 is invalid: expected an integer 0..4"),
        (BOUNDS + (0,), 2.0, "splits.test.shards[0].bounds.labels[0]=2.0 is invalid"),
        (BOUNDS + (0,), 5, "splits.test.shards[0].bounds.labels[0]=5 is invalid: expected an integer 0..4"),
        (BOUNDS, [4, 1], "splits.test.shards[0].bounds.labels[1]=1 is invalid: expected an integer 4..4"),
        (BOUNDS, [0], "splits.test.shards[0].bounds.labels=[0] is invalid: expected a list of 2"),
        (BOUNDS, _DROP, "splits.test.shards[0].bounds lacks labels; its keys are labels"),
        (BOUNDS[:-1] + ("images",), [0, 1], "splits.test.shards[0].bounds has unknown key(s) 'images'; its keys"),
        (BOUNDS[:-1], _DROP, "splits.test.shards[0] lacks bounds; its keys are file, num_samples, sha256, bounds"),
        (BOUNDS[:-1], [0, 4], "splits.test.shards[0].bounds=[0, 4] is invalid: expected an object with the keys"),
        (("splits", "test", "shards", 0, "owner"), "x", "splits.test.shards[0] has unknown key(s) 'owner'; its keys"),
        (("splits", "holdout"), {"num_samples": 0, "shards": []}, "splits='holdout' is invalid: a split is named"),
        (("splits", "train"), _DROP, "splits={'test': {"),
        (("input_shape",), [3, 4], "input_shape=[3, 4] is invalid: expected a list of 3"),
        (("input_shape",), [3, 0, 4], "input_shape[1]=0 is invalid: expected an integer >= 1"),
        (("mean",), [0.5, 0.5], "mean=[0.5, 0.5] is invalid: expected a list of 3"),
        (("mean",), [0.5, float("nan"), 0.5], "mean[1]=nan is invalid: expected a finite number"),
        (("std",), [0.5, 0.0, 0.5], "std[1]=0.0 is invalid: expected a number > 0"),
        (("std",), [0.5, 10**400, 0.5], "std[1]=<int of about 401 digits> is invalid: expected a finite number"),
        (("classes",), [], "classes=[] is invalid: expected at least one class name"),
        (("std",), [0.5, 0.5], "std=[0.5, 0.5] is invalid: expected a list of 3"),
        (("classes",), ["a", "a", "b", "c", "d"], "class names must be unique"),
        (("classes",), ["a", 1, "b", "c", "d"], "classes[1]=1 is invalid: expected a non-empty string"),
        (("dataset",), None, "dataset=None is invalid"),
        (("version",), 5, "version=5 is invalid: this code reads versions 1 to 4"),
        (("version",), True, "version=True is invalid"),
        (("extra",), 1, "manifest has unknown key(s) 'extra'; its keys are version, workload, dataset"),
        (("workload",), _DROP, "manifest lacks workload; its keys are version, workload, dataset"),
        (("workload",), "", "workload='' is invalid: expected a non-empty string"),
        (("spec",), [1], "spec=[1] is invalid: expected a JSON object"),
        (("arrays",), {}, "arrays={} is invalid: expected an object of array name -> {dtype, shape, max_value}"),
        (("arrays",), [], "arrays=[] is invalid: expected an object of array name"),
        (("arrays", "bad name"), ARRAY, "arrays='bad name' is invalid: an array is named like a Python identifier"),
        (IMAGES + ("dtype",), "float64", "arrays.images.dtype='float64' is invalid: expected one of uint8, uint16"),
        (IMAGES + ("dtype",), "object", "arrays.images.dtype='object' is invalid: expected one of"),
        (IMAGES + ("dtype",), None, "arrays.images.dtype=None is invalid: expected one of"),
        (IMAGES + ("shape",), [3, 0, 4], "arrays.images.shape[1]=0 is invalid: expected an integer >= 1"),
        (IMAGES + ("shape",), [3, "4", 4], "arrays.images.shape[1]='4' is invalid: expected an integer >= 1"),
        (IMAGES + ("shape",), 3, "arrays.images.shape=3 is invalid: expected a list"),
        (IMAGES + ("shape",), _DROP, "arrays.images lacks shape; its keys are dtype, shape, max_value"),
        (IMAGES + ("owner",), "x", "arrays.images has unknown key(s) 'owner'; its keys are dtype, shape, max_value"),
        (LABELS, ARRAY | {"dtype": "float32"}, "arrays.labels.max_value=4 is invalid: only integer arrays are bounded"),
        (LABELS + ("max_value",), -1, "arrays.labels.max_value=-1 is invalid: expected an integer 0.."),
        (LABELS + ("max_value",), 2**63, "arrays.labels.max_value=9223372036854775808 is invalid: expected an integer"),
        (LABELS + ("max_value",), 4.0, "arrays.labels.max_value=4.0 is invalid: expected an integer"),
        # Valid arrays, but not what image classification reads.
        (IMAGES + ("dtype",), "uint16", "arrays={'images': {'dtype': 'uint16'"),
        (IMAGES + ("shape",), [3, 4, 5], "image_classification data stores images uint8 [3, 4, 4] and labels int64"),
        (LABELS + ("max_value",), 9, "labels int64 [] with max_value 4 (one per class)"),
        (LABELS + ("max_value",), None, "labels int64 [] with max_value 4 (one per class)"),
        (("arrays", "extra"), ARRAY, "image_classification data stores images uint8 [3, 4, 4] and labels int64"),
        (IMAGES, _DROP, "image_classification data stores images uint8 [3, 4, 4] and labels int64"),
    ],
)
def test_a_bad_manifest_names_the_manifest_file_and_the_field(prepared, path, value, found):
    raw = copy.deepcopy(prepared[1])
    _set(raw, path, value)
    message = _error(Manifest.from_json, json.dumps(raw), directory="/data/prepared")
    assert message.startswith("/data/prepared/manifest.json: ") and found in message, message


def test_an_image_manifest_without_its_per_channel_statistics_is_refused(prepared):
    raw = copy.deepcopy(prepared[1])
    raw["mean"], raw["std"] = [], []
    assert "manifest.json: mean=[] is invalid: expected a list of 3" in _error(Manifest.from_json, json.dumps(raw))


def _table_template(**fields) -> Manifest:
    """A version-3 manifest of a workload that is not a built-in one: float features and a bounded int32 target,
    no classes and no per-channel statistics."""
    return Manifest(
        dataset="table",
        classes=[],
        input_shape=[4],
        mean=[],
        std=[],
        splits={},
        workload="my_pkg.tabular:Tabular",
        arrays={"features": ArraySpec("float32", [4]), "target": ArraySpec("int32", [], max_value=2)},
        spec={"columns": ["a", "b", "c", "d"]},
        **fields,
    )


def _table(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "features": rng.normal(size=(rows, 4)).astype(np.float32),
        "target": rng.integers(0, 3, rows).astype(np.int32),
    }


def test_write_prepared_writes_any_declared_arrays_and_the_manifest_reads_them_back(tmp_path):
    splits = {"train": _table(30), "val": _table(6, seed=1)}
    written = write_prepared(str(tmp_path / "out"), splits, template=_table_template(), num_shards=3)
    raw = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert raw["version"] == 4 and raw["workload"] == "my_pkg.tabular:Tabular" and raw["classes"] == []
    assert raw["arrays"] == {
        "features": {"dtype": "float32", "shape": [4], "max_value": None},
        "target": {"dtype": "int32", "shape": [], "max_value": 2},
    }
    loaded = Manifest.load(str(tmp_path / "out"))
    assert loaded == written and loaded.spec == {"columns": ["a", "b", "c", "d"]}
    assert Manifest.from_description(loaded.description()).arrays == loaded.arrays
    seen = []
    for shard in loaded.splits["train"].shards:
        arrays = read_shard(loaded, shard)
        assert set(arrays) == {"features", "target"} and set(shard.bounds) == {"target"}
        assert [int(arrays["target"].min()), int(arrays["target"].max())] == shard.bounds["target"]
        seen.append(arrays["features"])
    assert np.array_equal(np.concatenate(seen), splits["train"]["features"])
    # The bounds are checked against the data as for labels, naming the array.
    tampered = copy.deepcopy(loaded.splits["train"].shards[0])
    tampered.bounds = {"target": [tampered.bounds["target"][0], 9]}
    bad = Manifest.from_json(loaded.to_json(), directory=loaded.directory)
    bad.arrays["target"].max_value = 9
    message = _error(read_shard, bad, tampered)
    assert f"holds target {_shard_range(loaded, 0)}; the manifest says" in message, message


def _shard_range(manifest: Manifest, index: int) -> str:
    low, high = manifest.splits["train"].shards[index].bounds["target"]
    return f"{low}..{high}"


@pytest.mark.parametrize(
    ("splits", "found"),
    [
        ({"holdout": _table(4)}, "data prep made a split named 'holdout'; splits are named train, val, test"),
        (
            {"train": {"features": _table(4)["features"]}},
            "data prep made split 'train' with arrays ['features']; the manifest declares ['features', 'target']",
        ),
        (
            {"train": _table(4) | {"extra": np.zeros(4, np.int32)}},
            "with arrays ['extra', 'features', 'target']; the manifest declares ['features', 'target']",
        ),
        (
            {"train": _table(4) | {"features": np.zeros((4, 4), np.float64)}},
            "data prep made array 'features' of split 'train' float64 (4,) per sample; the manifest declares "
            "float32 (4,)",
        ),
        (
            {"train": _table(4) | {"features": np.zeros((4, 5), np.float32)}},
            "array 'features' of split 'train' float32 (5,) per sample; the manifest declares float32 (4,)",
        ),
        (
            {"train": _table(4) | {"target": np.zeros((4, 1), np.int32)}},
            "array 'target' of split 'train' int32 (1,) per sample; the manifest declares int32 ()",
        ),
        (
            {"train": _table(4) | {"target": np.array([0, 1, 3, 2], np.int32)}},
            "array 'target' of split 'train' with values 0..3; expected 0..2",
        ),
        (
            {"train": _table(4) | {"target": np.array([0, -1, 2, 2], np.int32)}},
            "array 'target' of split 'train' with values -1..2; expected 0..2",
        ),
        (
            {"train": _table(4), "val": _table(4) | {"target": np.zeros(3, np.int32)}},
            "data prep made split 'val' with no samples or arrays of different lengths",
        ),
        ({"train": _table(0)}, "data prep made split 'train' with no samples"),
    ],
    ids=[
        "split-name",
        "missing",
        "extra",
        "dtype",
        "shape",
        "scalar-shape",
        "above-bound",
        "negative",
        "lengths",
        "empty",
    ],
)
def test_write_prepared_refuses_arrays_that_do_not_match_the_declared_ones_before_writing(tmp_path, splits, found):
    out = tmp_path / "out"
    message = _error(write_prepared, str(out), splits, template=_table_template(), num_shards=2)
    assert found in message, message
    assert not out.exists()


@pytest.mark.parametrize(
    ("text", "found"),
    [("[1, 2]", "manifest=[1, 2] is invalid: expected an object"), ("{", "is not valid JSON"), ("[" * 100_000, "JSON")],
)
def test_a_manifest_that_is_not_an_object_names_the_file(text, found):
    assert found in _error(Manifest.from_json, text, directory="d")


def test_a_missing_or_binary_manifest_says_to_run_data_prep(tmp_path):
    assert _error(Manifest.load, str(tmp_path)).endswith(
        "manifest.json is missing: the directory holds no prepared "
        "data; re-run data prep (prepare_data) to rewrite the directory"
    )
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe{}")
    assert "manifest.json is not UTF-8 text" in _error(Manifest.load, str(tmp_path))


def test_a_manifest_that_is_a_fifo_or_a_device_is_refused_without_blocking(tmp_path):
    # Read with a plain open(), a FIFO named manifest.json waited for a writer forever and /dev/zero never ended.
    fifo_dir, device_dir = tmp_path / "fifo", tmp_path / "device"
    fifo_dir.mkdir()
    device_dir.mkdir()
    os.mkfifo(fifo_dir / "manifest.json")
    (device_dir / "manifest.json").symlink_to("/dev/zero")
    assert "manifest.json cannot be read: " in _error(Manifest.load, str(fifo_dir))
    assert "is a FIFO, not a regular file" in _error(Manifest.load, str(fifo_dir))
    assert "is a character device, not a regular file" in _error(Manifest.load, str(device_dir))
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "manifest.json").symlink_to(tmp_path / "nowhere")
    assert "manifest.json is missing" in _error(Manifest.load, str(tmp_path / "dangling"))


def _rewrite_shard(directory, raw, index, **arrays):
    """Rewrite train shard ``index`` with ``arrays`` replacing its own, and record its new sha256, so only the
    arrays differ from what the manifest says."""
    import hashlib
    import io

    shard = raw["splits"]["train"]["shards"][index]
    with np.load(directory / shard["file"]) as stored:
        content = {"images": stored["images"], "labels": stored["labels"]} | arrays
    buffer = io.BytesIO()
    np.savez(buffer, **content)
    (directory / shard["file"]).write_bytes(buffer.getvalue())
    shard["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (directory / "manifest.json").write_text(json.dumps(raw))
    manifest = Manifest.load(str(directory))
    return manifest, manifest.splits["train"].shards[index]


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda x, y: {"labels": np.full_like(y, 4)}, "holds labels 4..4; the manifest says"),
        (lambda x, y: {"labels": y.astype(np.int32)}, "holds labels int32"),
        (lambda x, y: {"labels": y[:-1], "images": x[:-1]}, "holds images uint8 ("),
        (lambda x, y: {"images": x[:, :, :2]}, "holds images uint8 ("),
        (lambda x, y: {"images": x.astype(np.float32)}, "holds images float32"),
        (lambda x, y: {"labels": np.array(["a"] * len(y))}, "holds labels <U1"),
    ],
    ids=["label-range", "label-dtype", "count", "image-shape", "image-dtype", "string-labels"],
)
def test_a_shard_that_differs_from_its_manifest_is_refused_when_read(prepared, tmp_path, change, found):
    directory = _copy(prepared, tmp_path)
    raw = copy.deepcopy(prepared[1])
    with np.load(directory / raw["splits"]["train"]["shards"][0]["file"]) as stored:
        arrays = change(stored["images"], stored["labels"])
    manifest, shard = _rewrite_shard(directory, raw, 0, **arrays)
    message = _error(read_shard, manifest, shard)
    assert message.startswith(f"shard {shard.file!r} in {directory} ") and found in message, message
    assert message.endswith("re-run data prep (prepare_data) to rewrite the directory")


def test_a_version_1_manifest_still_loads_and_its_shards_labels_are_checked_against_the_classes(prepared, tmp_path):
    directory = _copy(prepared, tmp_path)
    raw = _as_version(prepared[1], 1)
    (directory / "manifest.json").write_text(json.dumps(raw))
    manifest = Manifest.load(str(directory))
    assert manifest.version == 1 and json.loads(manifest.to_json()) == raw
    assert all(shard.bounds == {} for split in manifest.splits.values() for shard in split.shards)
    read_shard(manifest, manifest.splits["train"].shards[0])
    with np.load(directory / raw["splits"]["train"]["shards"][0]["file"]) as stored:
        labels = stored["labels"].copy()
    labels[0] = 5
    manifest, shard = _rewrite_shard(directory, raw, 0, labels=labels)
    assert "the manifest has 5 classes" in _error(read_shard, manifest, shard)


def _mutated_manifests(st, valid: dict):
    """The valid manifest with one to three edits at a random place in its tree: a key dropped or added, a value
    replaced by a random JSON value, or a shard file replaced by a path-like name."""
    names = st.sampled_from(
        ["../outside.npz", "../../etc/hostname", "/etc/passwd", "s3://b/x.npz", "a/b", "a\\b", "", ".", "..", "C:x"]
    )
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-3, max_value=200),
        st.integers(min_value=-(10**500), max_value=10**500),
        st.floats(),
        st.text(max_size=20),
        names,
    )
    values = st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    )

    def places(node, path=()):
        yield path
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            yield from places(child, (*path, key))

    @st.composite
    def mutated(draw):
        raw = copy.deepcopy(valid)
        for _ in range(draw(st.integers(min_value=1, max_value=3))):
            path = draw(st.sampled_from(list(places(raw))))
            edit = draw(st.sampled_from(["replace"] * 3 + ["file name", "drop", "add"]))
            if edit == "add" or not path:
                target = raw
                for key in path:
                    target = target[key]
                if isinstance(target, dict):
                    target[draw(st.text(max_size=8))] = draw(values)
                elif isinstance(target, list):
                    target.append(draw(values))
            elif edit == "drop" and isinstance(path[-1], str):
                _set(raw, path, _DROP)
            elif edit == "file name":
                _set(raw, path, draw(names))
            else:
                _set(raw, path, draw(values))
        return raw

    return mutated()


def test_a_mutated_manifest_loads_or_raises_a_short_value_error(prepared):
    cases = []

    @hypothesis.settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @hypothesis.given(_mutated_manifests(hypothesis.strategies, prepared[1]))
    def check(raw):
        try:
            manifest = Manifest.from_json(json.dumps(raw), directory=str(prepared[0]))
        except ValueError as exc:
            assert len(str(exc)) < MAX_MESSAGE_CHARS, str(exc)[:500]
            cases.append("refused")
            return
        cases.append("loaded")
        assert all(
            "/" not in s.file and not s.file.startswith(".") for split in manifest.splits.values() for s in split.shards
        )

    check()
    print(f"hypothesis: {len(cases)} mutated data manifests, {cases.count('loaded')} loaded, the rest refused")


def test_a_mutated_cifar_batch_reads_or_raises_a_short_value_error(tmp_path_factory):
    st = hypothesis.strategies
    directory = tmp_path_factory.mktemp("mutated-cifar")
    valid = pickle.dumps(_record(), protocol=2)
    values = st.one_of(
        st.none(),
        st.integers(min_value=-300, max_value=300),
        st.floats(),
        st.text(max_size=5),
        st.binary(max_size=8),
        st.lists(st.one_of(st.integers(min_value=-2, max_value=12), st.floats(), st.booleans()), max_size=3),
        st.sampled_from(
            [
                np.zeros((2, 3072), np.uint16),
                np.full((2, 3072), 256, np.int16),
                np.zeros((2, 3072), np.float32),
                np.zeros((1, 3072), np.uint8),
                np.zeros((2, 3, 32, 32), np.uint8),
                np.zeros(2, np.int8),
                np.array([1, 2], dtype=np.uint64),
                np.array(["a", "b"]),
                np.zeros(3, dtype=[("a", np.int8)]),
            ]
        ),
    )

    @st.composite
    def batches(draw):
        edit = draw(st.sampled_from(["bytes", "truncate", "flip", "flip", "record", "record"]))
        if edit == "bytes":
            return draw(st.binary(max_size=200))
        if edit == "truncate":
            return valid[: draw(st.integers(min_value=0, max_value=len(valid) - 1))]
        if edit == "flip":
            data = bytearray(valid)
            for _ in range(draw(st.integers(min_value=1, max_value=4))):
                # Most of the pickle is pixels; flips in its first and last few hundred bytes hit structure.
                index = draw(st.one_of(st.integers(0, 300), st.integers(len(data) - 300, len(data) - 1)))
                data[index] = draw(st.integers(0, 255))
            return bytes(data)
        record = _record()
        key = draw(st.sampled_from([b"data", b"labels", b"batch_label", b"filenames", b"other", 1]))
        record[key] = draw(values)
        return pickle.dumps(record, protocol=2)

    cases = []

    @hypothesis.settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @hypothesis.given(batches())
    def check(batch):
        path = _cifar_archive(directory / "c.tar", batch)
        try:
            load_raw(DataConfig(dataset="cifar10", path=path))
        except ValueError as exc:
            assert len(str(exc)) < MAX_MESSAGE_CHARS, str(exc)[:500]
            cases.append("refused")
            return
        cases.append("read")

    check()
    print(f"hypothesis: {len(cases)} mutated CIFAR-10 batches, {cases.count('read')} read, the rest refused")
