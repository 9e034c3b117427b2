"""Pretrained weights a user brings (``model.pretrained``): found, read without executing a pickle, identified by
a content hash and matched against the model they go into.

``model.pretrained`` is a local path or an ``s3://`` URI of a ``.safetensors`` state dict, a ``.pt``/``.pth`` state
dict (read with ``torch.load(weights_only=True)`` only) or a Hugging Face model directory (``config.json`` plus
``model.safetensors``, or sharded safetensors with ``model.safetensors.index.json``). Pickles (``pytorch_model.bin``)
are refused by name, never opened. Every problem is a ``ValueError`` naming ``model.pretrained``, the value and the
fix. Files are read through :mod:`training_core.files` (regular files only, bytes capped).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, NoReturn

from training_core.files import UnreadableFile, join_path, open_regular, read_regular
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


def _read_json(source: str, fs: Any, path: str) -> Any:
    name = path.rsplit("/", 1)[-1]
    try:
        return json.loads(_read(source, fs, path, MAX_JSON_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return fail(source, f"its {name} is not JSON ({clip(str(exc))}); save the model again with save_pretrained")


def _index_shards(source: str, fs: Any, index_path: str) -> list[str]:
    weight_map = _read_json(source, fs, index_path)
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
    if pinned and found != pinned:
        fail(pretrained, f"its sha256 is {found}, not model.pretrained_sha256={pinned}: the weights changed; {REPIN}")
    return found


def combined_sha256(files: WeightFiles, digests: list[str]) -> str:
    """The one sha256 of ``files`` from the sha256 of each of them (in the same order)."""
    if files.kind != "huggingface":
        return digests[0]
    lines = "".join(f"{digest}  {path.rsplit('/', 1)[-1]}\n" for digest, path in zip(digests, files.files))
    return hashlib.sha256(lines.encode()).hexdigest()


def _file_sha256(source: str, fs: Any, path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open_regular(fs, path) as f:
            while piece := f.read(2**20):
                digest.update(piece)
    except UnreadableFile as exc:
        fail(source, f"{exc}; name {SUPPORTED}")
    return digest.hexdigest()


def read_pretrained(source: str, *, expected_sha256: str = "") -> PretrainedWeights:
    """The state dict at ``source`` (see the module docstring) and its :func:`weights_sha256`. With
    ``expected_sha256``, weights whose hash differs are refused (they changed since the run was checked)."""
    files = locate(source)
    contents = {
        path: _read(source, files.fs, path, MAX_WEIGHT_FILE_BYTES if path in files.weight_files else MAX_JSON_BYTES)
        for path in files.files
    }
    sha256 = combined_sha256(files, [hashlib.sha256(contents[path]).hexdigest() for path in files.files])
    if files.kind == "huggingface":
        _check_config_json(source, contents[files.files[0]])
    if expected_sha256 and sha256 != expected_sha256:
        fail(
            source,
            f"its sha256 is {sha256}, not model.pretrained_sha256={expected_sha256}: the weights changed; {REPIN}",
        )
    state_dict: dict[str, torch.Tensor] = {}
    for path in files.weight_files:
        part = _state_dict_of(source, files.kind, path, contents[path])
        repeated = sorted(part.keys() & state_dict.keys())
        if repeated:
            fail(source, f"tensor {quote(repeated[0])} is in more than one shard; save the model again")
        state_dict.update(part)
    if files.kind == "huggingface" and len(files.weight_files) > 1:
        _check_index(source, json.loads(contents[files.files[1]])["weight_map"], state_dict)
    return PretrainedWeights(source=source, kind=files.kind, sha256=sha256, state_dict=state_dict)


def _check_config_json(source: str, data: bytes) -> None:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(source, f"its config.json is not JSON ({clip(str(exc))}); save the model again with save_pretrained")
    if not isinstance(config, dict):
        fail(source, "its config.json is not a JSON object; save the model again with save_pretrained")


def _check_index(source: str, weight_map: Mapping[str, str], state_dict: Mapping[str, Any]) -> None:
    differ = sorted(set(weight_map) ^ set(state_dict))
    if differ:
        fail(source, f"its {SAFETENSORS_INDEX} and its shards disagree on {quote(differ[:MAX_LISTED])}; save again")


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
    state_dict: Mapping[str, torch.Tensor],
    *,
    new_head: bool,
    model_name: str,
    fix: str = "",
) -> HeadPlan:
    """Which of ``state_dict`` loads into ``model`` (which may be on the meta device): every name and shape must
    match, except, with ``new_head``, the classifier head's (:func:`head_name`), left as the model initialised it.
    Anything else that differs fails, listing the first few names, with ``fix`` (default: an image model's)."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    head = head_name(model)
    head_keys = {key for key in expected if head and key.rpartition(".")[0] == head}
    shapes = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
    missing = sorted(expected.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - expected.keys())
    wrong = sorted(key for key in expected.keys() & shapes.keys() if expected[key] != shapes[key])
    reinitialised = [key for key in wrong if new_head and key in head_keys]
    wrong = [key for key in wrong if key not in reinitialised]
    if missing or unexpected or wrong:
        _mismatch(source, model_name, missing, unexpected, [(key, shapes[key], expected[key]) for key in wrong],
                  head_keys=head_keys, new_head=new_head, fix=fix)  # fmt: skip
    loaded = [key for key in expected if key not in reinitialised]
    classes = (shapes[f"{head}.weight"][0], expected[f"{head}.weight"][0]) if reinitialised else (0, 0)
    return HeadPlan(loaded=loaded, reinitialised=reinitialised, head=head if reinitialised else "", classes=classes)


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


def load_into(model: nn.Module, weights: PretrainedWeights, *, new_head: bool, model_name: str) -> HeadPlan:
    """Copy ``weights`` into ``model`` as :func:`plan_loading` says, and log what was loaded and re-initialised."""
    plan = plan_loading(weights.source, model, weights.state_dict, new_head=new_head, model_name=model_name)
    skip = set(plan.reinitialised)
    model.load_state_dict({key: value for key, value in weights.state_dict.items() if key not in skip}, strict=False)
    log.info("model.pretrained: loaded %d tensors (sha256 %s)", len(plan.loaded), weights.sha256[:12])
    if plan.reinitialised:
        log.warning(
            "model.new_head: re-initialised the classifier head %r (%d classes in the pretrained weights, %d here)",
            plan.head,
            *plan.classes,
        )
    return plan
