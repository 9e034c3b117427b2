"""Pretrained weights a user brings (``model.pretrained``): found, read without executing a pickle, identified by
a content hash and matched against the model they go into.

``model.pretrained`` is a local path or an ``s3://`` URI of a ``.safetensors`` state dict, a ``.pt``/``.pth`` state
dict (read with ``torch.load(weights_only=True)`` only) or a Hugging Face model directory (``config.json`` plus
``model.safetensors``, or sharded safetensors with ``model.safetensors.index.json``). Pickles (``pytorch_model.bin``)
are refused by name, never opened. Every problem is a ``ValueError`` naming ``model.pretrained``, the value and the
fix. Files are read through :mod:`training_core.files` (regular files only, bytes capped).

Under FSDP a model is not loaded whole (:func:`plan_sharded_load`, :func:`load_shards`): each rank reads the rows of
each safetensors tensor it holds as one byte range (:class:`SafetensorsRows`; ranged GETs on ``s3://``).
``model.new_head`` (``true`` or a name pattern) names tensors that are re-initialised instead, from the seed
(:func:`fresh_values`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, NoReturn

from training_core.files import UnreadableFile, is_local, join_path, open_regular, read_regular
from training_core.messages import clip, invalid, is_plain_file_name, quote

if TYPE_CHECKING:
    import torch
    from torch import nn

FIELD = "model.pretrained"

MAX_WEIGHT_FILE_BYTES = 64 * 2**30
"""Most bytes read from one weight file. A file is read whole into memory (then into tensors): this only stops a
file that never ends (``/dev/zero`` behind a symlink is refused anyway) from exhausting memory."""

MAX_JSON_BYTES = 64 * 2**20
"""Most bytes read from a model directory's ``config.json`` or ``model.safetensors.index.json``."""

MAX_LISTED = 5
"""How many mismatched names an error lists: the first few are enough to see what differs."""

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pkl", ".pickle", ".ckpt")
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
SUPPORTED = (
    "a .safetensors or .pt/.pth state dict, or a Hugging Face model directory (config.json plus model.safetensors "
    "or sharded safetensors with model.safetensors.index.json)"
)
CONVERT = (
    "pickles are never loaded, since loading one runs code; convert it to safetensors once where you trust it: "
    "safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors'), or for a Hugging Face "
    "model model.save_pretrained(directory, safe_serialization=True)"
)

PRETRAINED_FIELDS = ("pretrained", "pretrained_sha256", "new_head")
"""The ``model`` fields that say which weights a run started from."""
REPIN = "name the weights the run was pinned to, or clear model.pretrained_sha256 to take these"

log = logging.getLogger("training_core")


def without_pretrained(model_section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``model`` config section (as a dict) that builds the same architecture without reading pretrained weights:
    for a model whose weights come from a checkpoint instead (the pretrained ones may be gone by then)."""
    return {key: value for key, value in model_section.items() if key not in PRETRAINED_FIELDS}


@dataclass
class WeightFiles:
    """Where weights lie: their ``kind`` (``safetensors``, ``torch`` or ``huggingface``) and their files on ``fs``
    (for a directory: ``config.json``, the index if sharded, then the weight files)."""

    source: str
    kind: str
    fs: Any
    files: list[str] = field(default_factory=list)
    weight_files: list[str] = field(default_factory=list)


@dataclass
class PretrainedWeights:
    """A state dict read from ``source`` and the sha256 that identifies its files (:func:`weights_sha256`)."""

    source: str
    kind: str
    sha256: str
    state_dict: dict[str, torch.Tensor]


@dataclass
class HeadPlan:
    """How pretrained weights go into a model: the names they load and the head names left at the model's
    fresh initialisation (``model.new_head``), with the class counts for the log."""

    loaded: list[str]
    reinitialised: list[str]
    head: str = ""
    classes: tuple[int, int] = (0, 0)
    fresh: list[str] = field(default_factory=list)
    """Of ``reinitialised``, those the weights lack (a :class:`NameMapping`'s fresh ones), not ``model.new_head``'s."""


FRESH = ""
"""A :class:`NameMapping` source for a tensor the weights lack: it takes a seeded fresh value (:func:`fresh_values`)."""


@dataclass
class NameMapping:
    """How a workload's model names the tensors of pretrained weights: ``sources`` maps each model tensor to the
    stored tensor it loads from (:data:`FRESH`: none, a seeded fresh value); ``dropped`` are stored tensors left
    out (another head's), ``note`` says what was adapted. The whole load and the row-by-row load both read by it."""

    sources: dict[str, str]
    dropped: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def fresh(self) -> list[str]:
        return [name for name, source in self.sources.items() if source == FRESH]

    def renamed(self, stored: Mapping[str, Any]) -> dict[str, Any]:
        """``stored`` under the model's names; stored tensors no model tensor loads from and not dropped keep their
        names (:func:`plan_loading` then lists them as tensors the model lacks)."""
        found = {name: stored[source] for name, source in self.sources.items() if source in stored}
        used = set(self.sources.values()) | set(self.dropped)
        return found | {name: value for name, value in stored.items() if name not in used}

    def under(self, prefix: str) -> NameMapping:
        """The mapping for a model that holds this one's at ``prefix`` (e.g. ``encoder.``)."""
        return NameMapping({prefix + name: source for name, source in self.sources.items()}, self.dropped, self.note)


def fail(source: str, fix: str) -> NoReturn:
    """The one error of this module: ``model.pretrained``, its value and the fix."""
    invalid(FIELD, source, fix)


def locate(source: str) -> WeightFiles:
    """The kind and files of the weights at ``source``; refuses a path that does not exist, a pickle, a file of
    another kind and a directory that is not a model."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(source)
    name = path.rstrip("/").rsplit("/", 1)[-1]
    try:
        exists, is_dir = fs.exists(path), fs.isdir(path)
    except Exception as exc:  # noqa: BLE001 - whatever a remote filesystem raises
        fail(source, f"it cannot be reached ({type(exc).__name__}: {clip(str(exc))}); check the path and credentials")
    if not exists:
        fail(source, f"nothing exists there; name {SUPPORTED}")
    if is_dir:
        return _locate_directory(source, fs, path)
    if name.endswith(PICKLE_SUFFIXES):
        fail(source, f"{quote(name)} is a pickle; {CONVERT}")
    if name.endswith(".safetensors"):
        return WeightFiles(source, "safetensors", fs, [path], [path])
    if name.endswith((".pt", ".pth")):
        return WeightFiles(source, "torch", fs, [path], [path])
    return fail(source, f"{quote(name)} is not a weight file this platform reads; name {SUPPORTED}")


def _locate_directory(source: str, fs: Any, path: str) -> WeightFiles:
    names = {entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)}
    config = join_path(path, "config.json")
    if SAFETENSORS_INDEX in names and "config.json" in names:
        index = join_path(path, SAFETENSORS_INDEX)
        shards = [join_path(path, shard) for shard in _index_shards(source, fs, index)]
        return WeightFiles(source, "huggingface", fs, [config, index, *shards], shards)
    if SAFETENSORS_FILE in names and "config.json" in names:
        weights = join_path(path, SAFETENSORS_FILE)
        return WeightFiles(source, "huggingface", fs, [config, weights], [weights])
    pickles = sorted(names & set(PICKLE_NAMES))
    if pickles:
        fail(source, f"the directory holds {quote(pickles[0])}, a pickle, and no model.safetensors; {CONVERT}")
    found = ", ".join(sorted(names)[:MAX_LISTED]) or "nothing"
    return fail(source, f"it is a directory but not a model (it holds {clip(found)}); name {SUPPORTED}")


def _read(source: str, fs: Any, path: str, max_bytes: int) -> bytes:
    try:
        return read_regular(fs, path, max_bytes=max_bytes)
    except UnreadableFile as exc:
        return fail(source, f"{exc}; name {SUPPORTED}")


def _parse_json(source: str, name: str, data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return fail(source, f"its {name} is not JSON ({clip(str(exc))}); save the model again with save_pretrained")


def _index_shards(source: str, fs: Any, index_path: str) -> list[str]:
    weight_map = _parse_json(source, SAFETENSORS_INDEX, _read(source, fs, index_path, MAX_JSON_BYTES))
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        fail(source, f"its {SAFETENSORS_INDEX} has no weight_map; save the model again with save_pretrained")
    shards = sorted(set(map(str, weight_map.values())))
    bad = [shard for shard in shards if not is_plain_file_name(shard) or not shard.endswith(".safetensors")]
    if bad:
        fail(source, f"its {SAFETENSORS_INDEX} names {quote(bad[0])}: shards are .safetensors files beside it")
    return shards


def weights_sha256(files: WeightFiles) -> str:
    """The sha256 that identifies the weights, streamed: of the single file's bytes (what ``sha256sum`` prints), or
    for a directory of the lines ``<sha256>  <name>`` of its files in the order :func:`locate` lists them."""
    return combined_sha256(files, [_file_sha256(files.source, files.fs, path) for path in files.files])


def pinned_sha256(pretrained: str, pinned: str = "") -> str:
    """The sha256 that identifies the weights at ``pretrained`` (streamed, :func:`weights_sha256`); empty without
    weights. With ``pinned`` (``model.pretrained_sha256``), weights of another hash are refused."""
    if not pretrained:
        return ""
    found = weights_sha256(locate(pretrained))
    _check_pinned(pretrained, found, pinned)
    return found


def _check_pinned(source: str, sha256: str, pinned: str) -> None:
    if pinned and sha256 != pinned:
        fail(source, f"its sha256 is {sha256}, not model.pretrained_sha256={pinned}: the weights changed; {REPIN}")


def combined_sha256(files: WeightFiles, digests: list[str]) -> str:
    """The one sha256 of ``files`` from the sha256 of each of them (in the same order)."""
    if files.kind != "huggingface":
        return digests[0]
    lines = "".join(f"{digest}  {path.rsplit('/', 1)[-1]}\n" for digest, path in zip(digests, files.files))
    return hashlib.sha256(lines.encode()).hexdigest()


def _file_sha256(source: str, fs: Any, path: str) -> str:
    try:
        with open_regular(fs, path) as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except UnreadableFile as exc:
        return fail(source, f"{exc}; name {SUPPORTED}")


def read_pretrained(source: str, *, expected_sha256: str = "") -> PretrainedWeights:
    """The state dict at ``source`` (see the module docstring) and its :func:`weights_sha256`. With
    ``expected_sha256``, weights whose hash differs are refused (they changed since the run was checked)."""
    files = locate(source)
    contents = {
        path: _read(source, files.fs, path, MAX_WEIGHT_FILE_BYTES if path in files.weight_files else MAX_JSON_BYTES)
        for path in files.files
    }
    sha256 = combined_sha256(files, [hashlib.sha256(contents[path]).hexdigest() for path in files.files])
    config_json = _parse_json(source, "config.json", contents[files.files[0]]) if files.kind == "huggingface" else {}
    if not isinstance(config_json, dict):
        fail(source, "its config.json is not a JSON object; save the model again with save_pretrained")
    _check_pinned(source, sha256, expected_sha256)
    state_dict = _merged(source, [_state_dict_of(source, files.kind, p, contents[p]) for p in files.weight_files])
    if files.kind == "huggingface" and len(files.weight_files) > 1:
        differ = sorted(set(json.loads(contents[files.files[1]])["weight_map"]) ^ set(state_dict))
        if differ:
            fail(source, f"its {SAFETENSORS_INDEX} and its shards disagree on {quote(differ[:MAX_LISTED])}; save again")
    return PretrainedWeights(source=source, kind=files.kind, sha256=sha256, state_dict=state_dict)


def _merged(source: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The tensors of a model's shards as one dict; a name in two shards fails."""
    merged: dict[str, Any] = {}
    for part in parts:
        repeated = sorted(part.keys() & merged.keys())
        if repeated:
            fail(source, f"tensor {quote(repeated[0])} is in more than one shard; save the model again")
        merged.update(part)
    return merged


def _state_dict_of(source: str, kind: str, path: str, data: bytes) -> dict[str, torch.Tensor]:
    name = path.rsplit("/", 1)[-1]
    if kind == "torch":
        return _torch_state_dict(source, name, data)
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as exc:  # noqa: BLE001 - SafetensorError and what a corrupt header makes the parser raise
        return fail(
            source,
            f"{quote(name)} is not a valid safetensors file ({type(exc).__name__}: {clip(str(exc))}): a corrupt or "
            "truncated copy? Copy it again, or save it with safetensors.torch.save_file",
        )


def _torch_state_dict(source: str, name: str, data: bytes) -> dict[str, torch.Tensor]:
    import io

    import torch

    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - an unpickling refusal or a corrupt file: both are the user's file
        return fail(
            source,
            f"{quote(name)} cannot be read with torch.load(weights_only=True) ({type(exc).__name__}: "
            f"{clip(str(exc))}); save model.state_dict() with torch.save, or better with safetensors",
        )
    if not isinstance(loaded, dict):
        fail(source, f"{quote(name)} holds a {type(loaded).__name__}, not a state dict; save model.state_dict()")
    others = [key for key, value in loaded.items() if not isinstance(key, str) or not isinstance(value, torch.Tensor)]
    if others:
        fail(
            source,
            f"{quote(name)} holds entries that are not tensors ({quote(others[:MAX_LISTED])}): a training checkpoint? "
            "Save model.state_dict() alone",
        )
    return loaded


def head_name(model: nn.Module) -> str:
    """The classifier head of ``model``: its last ``nn.Linear`` (ResNet ``fc``, ViT ``heads.head``, ``head``)."""
    from torch import nn

    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return linears[-1] if linears else ""


def plan_loading(
    source: str,
    model: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    new_head: bool | str,
    model_name: str,
    fix: str = "",
    fresh: Iterable[str] = (),
) -> HeadPlan:
    """Which of ``state_dict`` (tensors, or anything with a ``shape``) loads into ``model`` (which may be on the meta
    device): every name and shape must match, except the tensors ``model.new_head`` re-initialises: with ``true``,
    the classifier head's (:func:`head_name`) of another shape; with a name pattern, the model's tensors it names
    (none: ``ValueError`` naming ``model.new_head``). Anything else that differs fails, listing the first few names,
    with ``fix`` (default: an image model's). ``fresh`` (a :class:`NameMapping`'s) are re-initialised too."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    head = head_name(model)
    head_keys = {key for key in expected if head and key.rpartition(".")[0] == head}
    shapes = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
    fresh = set(fresh)
    named = (named_by_pattern(new_head, expected) if isinstance(new_head, str) else set()) | fresh
    missing = sorted(expected.keys() - shapes.keys() - named)
    unexpected = sorted(shapes.keys() - expected.keys())
    wrong = sorted(key for key in expected.keys() & shapes.keys() if expected[key] != shapes[key])
    reinitialised = [
        key for key in expected if key in named or (new_head is True and key in head_keys and key in wrong)
    ]
    wrong = [key for key in wrong if key not in reinitialised]
    if missing or unexpected or wrong:
        _mismatch(source, model_name, missing, unexpected, [(key, shapes[key], expected[key]) for key in wrong],
                  head_keys=head_keys, new_head=bool(new_head), fix=fix)  # fmt: skip
    _require_resettable(model, [key for key in reinitialised if key not in fresh], new_head)
    loaded = [key for key in expected if key not in reinitialised]
    counted = not (named - fresh) and f"{head}.weight" in reinitialised and f"{head}.weight" in shapes
    classes = (shapes[f"{head}.weight"][0], expected[f"{head}.weight"][0]) if counted else (0, 0)
    head = head if counted else ""
    return HeadPlan(loaded, reinitialised, head, classes, fresh=[key for key in reinitialised if key in fresh])


def named_by_pattern(pattern: str, names: Iterable[str]) -> set[str]:
    """The names ``model.new_head``'s pattern (``fnmatch``; several separated by commas) matches; none fails,
    naming a few of the model's tensors."""
    import fnmatch

    patterns = [part.strip() for part in pattern.split(",") if part.strip()]
    names = list(names)
    matched = {name for name in names if any(fnmatch.fnmatchcase(name, part) for part in patterns)}
    if not matched:
        some = ", ".join(names[-MAX_LISTED:])
        invalid("model.new_head", pattern, f"it names none of the model's tensors (the last are {clip(some)}); name "
                "the head's, e.g. 'fc.*' or 'classifier.*', or set true for the last linear layer")  # fmt: skip
    return matched


def _require_resettable(model: nn.Module, names: list[str], new_head: bool | str) -> None:
    owners = sorted({name.rpartition(".")[0] for name in names})
    bare = [owner for owner in owners if not callable(getattr(model.get_submodule(owner), "reset_parameters", None))]
    if bare:
        layer = quote(bare[0] or type(model).__name__)
        invalid("model.new_head", new_head, f"{layer} has no reset_parameters() to re-initialise its tensors with; "
                "name the tensors of its layers (e.g. 'classifier.out_proj.*')")  # fmt: skip


def fresh_values(model: nn.Module, names: Iterable[str], *, seed: int) -> dict[str, torch.Tensor]:
    """The values of the re-initialised tensors ``names`` (``model.new_head``): a CPU copy of each owning layer
    (an empty one on the meta device), reset with ``reset_parameters()`` after seeding torch's RNG with ``seed``,
    layers in name order; a layer without one (only a :class:`NameMapping`'s fresh tensors reach here so, such as
    BERT's masked-LM output bias) has its own tensors zeroed, as ``transformers`` initialises such a bias. The same
    on every rank and with every strategy; torch's own RNG is left as it was."""
    import copy

    import torch

    names = set(names)
    values: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for owner in sorted({name.rpartition(".")[0] for name in names}):
            layer = copy.deepcopy(model.get_submodule(owner)).to_empty(device="cpu")
            if callable(getattr(layer, "reset_parameters", None)):
                layer.reset_parameters()
            else:
                for tensor in layer.parameters(recurse=False):
                    tensor.data.zero_()
            prefix = f"{owner}." if owner else ""
            state = layer.state_dict(prefix=prefix)
            values.update({key: tensor.detach() for key, tensor in state.items() if key in names})
    return values


def _mismatch(
    source: str,
    model_name: str,
    missing: list[str],
    unexpected: list[str],
    wrong: list[tuple[str, tuple, tuple]],
    *,
    head_keys: set[str],
    new_head: bool,
    fix: str = "",
) -> None:
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's tensors missing ({', '.join(missing[:MAX_LISTED])})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensors the model lacks ({', '.join(unexpected[:MAX_LISTED])})")
    if wrong:
        listed = ", ".join(
            f"{key} {list(found)} vs the model's {list(want)}" for key, found, want in wrong[:MAX_LISTED]
        )
        parts.append(f"{len(wrong)} of another shape ({listed})")
    fix = fix or (
        f"save the weights of the model model.name={model_name!r} builds for this data (its channels, image size and "
        "classes; a ResNet takes a 3x3 stem for images of 64 px or less)"
    )
    if not new_head and any(key in head_keys for key, _, _ in wrong) and "new_head" not in fix:
        fix += ", or set model.new_head: true to re-initialise a classifier head of another class count"
    fail(source, f"the weights do not fit the model: {'; '.join(parts)}. Fix: {fix}")


def load_pretrained(
    model: nn.Module,
    model_cfg: Any,
    *,
    seed: int,
    mapping_of: Callable[[nn.Module, Iterable[str]], NameMapping] | None = None,
) -> None:
    """Copy ``model_cfg.pretrained``'s weights (checked against ``model.pretrained_sha256``), named as
    ``mapping_of(model, stored names)`` says (None: as the model names them), into ``model`` as :func:`plan_loading`
    says, the re-initialised tensors taking their :func:`fresh_values` from ``seed`` (a tied tensor its first name's:
    :func:`tied_aliases`), and log what was loaded and re-initialised. Without weights, or into a model on the meta
    device (which holds no values: under FSDP each rank reads its shards' rows after sharding), nothing is loaded."""
    if not model_cfg.pretrained or any(p.is_meta for p in model.parameters()):
        return
    weights = read_pretrained(model_cfg.pretrained, expected_sha256=model_cfg.pretrained_sha256)
    mapping = _name_mapping(model, weights.state_dict, mapping_of)
    state = mapping.renamed(weights.state_dict)
    plan = plan_loading(weights.source, model, state, new_head=model_cfg.new_head, model_name=model_cfg.name,
                        fresh=mapping.fresh)  # fmt: skip
    skip, aliases = set(plan.reinitialised), tied_aliases(model)
    model.load_state_dict({key: value for key, value in state.items() if key not in skip}, strict=False)
    reset = fresh_values(model, plan.reinitialised, seed=seed)
    # A tied tensor takes its first name's value, as load_shards gives it.
    model.load_state_dict({key: value for key, value in reset.items() if key not in aliases}, strict=False)
    log_plan(plan, weights.sha256)


def _name_mapping(
    model: nn.Module, stored: Iterable[str], mapping_of: Callable[..., NameMapping] | None
) -> NameMapping:
    """``mapping_of(model, stored names)``, its note logged, or the stored names as they are."""
    names = list(stored)
    mapping = mapping_of(model, names) if mapping_of else NameMapping({name: name for name in names})
    if mapping.note:
        log.warning("model.pretrained: %s", mapping.note)
    return mapping


def tied_names(model: nn.Module) -> list[list[str]]:
    """The groups of names of one shared parameter (tied weights: a masked LM's decoder and its word embeddings), in
    the model's order."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def tied_aliases(model: nn.Module) -> set[str]:
    """The names of ``model``'s tied parameters but the first of each group (:func:`tied_names`): filling the first
    name fills them all, so a load reads a tied tensor's rows once and gives it one value."""
    return {name for names in tied_names(model) for name in names[1:]}


def log_plan(plan: HeadPlan, sha256: str) -> None:
    """Say how many tensors were loaded, and which were re-initialised (``model.new_head``)."""
    log.info("model.pretrained: loaded %d tensors (sha256 %s)", len(plan.loaded), sha256[:12])
    if plan.head:
        log.warning(
            "model.new_head: re-initialised the classifier head %r (%d classes in the pretrained weights, %d here)",
            plan.head,
            *plan.classes,
        )
    chosen = [key for key in plan.reinitialised if key not in plan.fresh]
    if chosen:
        log.warning("model.new_head: re-initialised %d tensors: %s", len(chosen), clip(", ".join(chosen), 1000))
    if plan.fresh:
        log.warning("model.pretrained: %d tensors the weights lack take seeded fresh values: %s", len(plan.fresh),
                    clip(", ".join(plan.fresh), 1000))  # fmt: skip


# ------------------------------------------------------------------------------------- sharded loading (FSDP)

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
"""safetensors' dtype names, as torch names them."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a safetensors file: its bytes ``[begin, end)`` from the file's start."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsRows:
    """Rows (dim-0 slices) of the tensors of safetensors files, each read as one byte range (a ranged GET on
    ``s3://``, nothing downloaded whole); ``bytes_read`` counts what was read, headers included."""

    def __init__(self, files: WeightFiles) -> None:
        self.files, self.bytes_read = files, 0
        self.tensors: dict[str, StoredTensor] = _merged(files.source, [self._header(p) for p in files.weight_files])

    def _range(self, path: str, begin: int, end: int, into: Any = None) -> Any:
        """Bytes ``[begin, end)`` of ``path``, read into ``into`` (a writable buffer of that size; a local file's
        straight, with no copy) or a new ``bytearray``; returns the buffer."""
        buffer = bytearray(end - begin) if into is None else into
        try:
            if is_local(self.files.fs):
                with open_regular(self.files.fs, path) as f:
                    f.seek(begin)
                    done = f.readinto(buffer)
            else:
                data = self.files.fs.cat_file(path, start=begin, end=end)
                done = len(data)
                buffer[:done] = data
        except (UnreadableFile, OSError) as exc:
            fail(self.files.source, f"{clip(str(exc))}; name {SUPPORTED}")
        if done != end - begin:
            fail(self.files.source, f"{quote(path)} ends before byte {end}: a truncated copy? Copy it again")
        self.bytes_read += done
        return buffer

    def _header(self, path: str) -> dict[str, StoredTensor]:
        import math

        size = int.from_bytes(self._range(path, 0, 8), "little")
        if size > MAX_JSON_BYTES:
            fail(self.files.source, f"{quote(path)} has a header of {size} bytes: not a safetensors file; save again")
        try:
            header = json.loads(self._range(path, 8, 8 + size))
            found = {
                name: StoredTensor(path, SAFETENSORS_DTYPES[entry["dtype"]], tuple(map(int, entry["shape"])),
                                   8 + size + int(entry["data_offsets"][0]), 8 + size + int(entry["data_offsets"][1]))
                for name, entry in header.items() if name != "__metadata__"
            }  # fmt: skip
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            fail(self.files.source, f"{quote(path)} has a header this reader does not take ({clip(repr(exc))}); save "
                 "it with safetensors.torch.save_file")  # fmt: skip
        import torch

        for name, stored in found.items():
            itemsize = torch.empty((), dtype=getattr(torch, stored.dtype)).element_size()
            if stored.end - stored.begin != math.prod(stored.shape) * itemsize:
                fail(self.files.source, f"tensor {quote(name)} of {quote(path)} has a size that is not its shape's")
        return found

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows ``[start, stop)`` of tensor ``name`` (the whole of a 0-d one) into ``out``, read from its file as one
        byte range: straight into ``out``'s memory when it is contiguous, in host memory and of the stored dtype."""
        import torch

        stored = self.tensors[name]
        dtype = getattr(torch, stored.dtype)
        begin, end = stored.begin, stored.end
        if stored.shape:  # rows of a C-contiguous tensor are one byte range
            row_bytes = (stored.end - stored.begin) // stored.shape[0] if stored.shape[0] else 0
            begin, end = stored.begin + start * row_bytes, stored.begin + stop * row_bytes
        if end <= begin:
            return
        direct = out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
        target = out if direct else torch.empty(out.shape, dtype=dtype)  # a GPU shard: read on the host, then copy
        self._range(stored.path, begin, end, into=memoryview(target.reshape(-1).view(torch.uint8).numpy()))
        if target is not out:
            out.copy_(target)


class WholeRows:
    """Rows of a state dict read whole (a ``.pt`` file, which cannot be read by parts)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.tensors = state_dict
        self.bytes_read = sum(t.numel() * t.element_size() for t in state_dict.values())

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        tensor = self.tensors[name]
        out.copy_(tensor[start:stop] if tensor.dim() else tensor)


@dataclass
class ShardedLoad:
    """What :func:`load_shards` copies into a sharded model: the pretrained tensors to read (``reader``) and the
    re-initialised ones' values (whole: a head is small)."""

    plan: HeadPlan
    sha256: str
    reader: Any
    fresh: dict[str, torch.Tensor]
    sources: dict[str, str] = field(default_factory=dict)
    """A model tensor's stored name where it is another (:class:`NameMapping`)."""

    def wrapped(self, planned: Mapping[str, str], added: Mapping[str, torch.Tensor]) -> ShardedLoad:
        """This load for the model it was planned for, with layers wrapped since (LoRA's adapters, which rename the
        layer's own tensors): each tensor of ``planned`` (the wrapped model's name -> its name when planned) reads
        what that one read or takes its re-initialised value; the tensors the wrapping ``added`` take the values
        given (whole, as :attr:`fresh`)."""
        fresh, sources = dict(added), {}
        for name, before in planned.items():
            if before in self.fresh:
                fresh[name] = self.fresh[before]
            else:
                sources[name] = self.sources.get(before, before)
        return ShardedLoad(self.plan, self.sha256, self.reader, fresh, sources)


def plan_sharded_load(
    model: nn.Module,
    model_cfg: Any,
    *,
    seed: int,
    mapping_of: Callable[[nn.Module, Iterable[str]], NameMapping] | None = None,
) -> ShardedLoad:
    """Before sharding: match ``model_cfg.pretrained`` (``model.*``) against ``model`` (its parameters on the meta
    device) by the safetensors headers alone, named as ``mapping_of(model, stored names)`` says (None: as the model
    names them), and compute the re-initialised tensors. A ``.pt`` state dict is read whole (it cannot be sliced),
    on each rank, then dropped as its rows are copied."""
    files = locate(model_cfg.pretrained)
    if files.kind == "torch":
        weights = read_pretrained(model_cfg.pretrained, expected_sha256=model_cfg.pretrained_sha256)
        reader: Any = WholeRows(weights.state_dict)
    else:
        reader = SafetensorsRows(files)
    shapes = reader.tensors
    mapping = _name_mapping(model, shapes, mapping_of)
    plan = plan_loading(model_cfg.pretrained, model, mapping.renamed(shapes), new_head=model_cfg.new_head,
                        model_name=model_cfg.name, fresh=mapping.fresh)  # fmt: skip
    fresh = fresh_values(model, plan.reinitialised, seed=seed)
    return ShardedLoad(plan, model_cfg.pretrained_sha256, reader, fresh, sources=mapping.sources)


def check_weights(
    config: Any,
    model: nn.Module,
    *,
    mapping_of: Callable[[nn.Module, Iterable[str]], NameMapping] | None = None,
    fix: str = "",
) -> None:
    """Match ``model.pretrained``'s tensors, named as ``mapping_of(model, stored names)`` says (None: as the model
    names them), against ``model`` (on the meta device when it can be) as :func:`plan_loading` does, with ``fix``,
    before any worker starts: read whole, or under FSDP (a model that may not fit this process) by their safetensors
    headers alone, the hash streamed (a ``.pt`` state dict, which cannot be read by parts, is read whole). Records
    their sha256 in ``model.pretrained_sha256`` (in place), so the workers verify they read the same weights."""
    model_cfg = config.model
    if config.scaling.strategy == "fsdp" and (files := locate(model_cfg.pretrained)).kind != "torch":
        tensors = SafetensorsRows(files).tensors
        sha256 = pinned_sha256(model_cfg.pretrained, model_cfg.pretrained_sha256)
    else:
        weights = read_pretrained(model_cfg.pretrained, expected_sha256=model_cfg.pretrained_sha256)
        tensors, sha256 = weights.state_dict, weights.sha256
    mapping = _name_mapping(model, tensors, mapping_of)
    plan_loading(model_cfg.pretrained, model, mapping.renamed(tensors), new_head=model_cfg.new_head,
                 model_name=model_cfg.name, fix=fix, fresh=mapping.fresh)  # fmt: skip
    model_cfg.pretrained_sha256 = sha256


def rank_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dim 0 this rank holds of ``tensor``: an FSDP2 ``DTensor`` with the placement
    ``Shard(0)`` holds ``torch.chunk``'s piece (chunks of ``ceil(rows / ranks)`` rows, the last ones shorter or
    empty; FSDP's padding is not in ``to_local()``); any other tensor all of them."""
    rows = tensor.shape[0] if tensor.dim() else 0
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return 0, rows
    from torch.distributed.tensor import Shard

    assert tuple(tensor.placements) == (Shard(0),), f"FSDP2 shards dim 0 alone, not {tensor.placements}"
    chunk = -(-rows // mesh.size())
    start = min(rows, mesh.get_local_rank() * chunk)
    return start, min(rows, start + chunk)


def load_shards(model: nn.Module, load: ShardedLoad) -> int:
    """Copy into each of ``model``'s tensors (its ``DTensor`` shards' local rows, or a whole buffer) the rows this
    rank holds, read by name and row range, or taken from the re-initialised values; a tied tensor once, under its
    first name (:func:`tied_aliases`). Returns the bytes read."""
    import torch

    from training_core.parallel.sharding import local_tensor

    aliases = tied_aliases(model)  # FSDP2 shards a tied parameter once, under each of its names
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in aliases:
                continue
            start, stop = rank_rows(tensor)
            local = local_tensor(tensor)
            assert local.shape[:1] == (stop - start,) or not local.dim(), (name, local.shape, start, stop)
            if name in load.fresh:
                local.copy_(load.fresh[name][start:stop] if local.dim() else load.fresh[name])
            else:
                load.reader.read_rows(load.sources.get(name, name), start, stop, local)
    log_plan(load.plan, load.sha256)
    return load.reader.bytes_read
