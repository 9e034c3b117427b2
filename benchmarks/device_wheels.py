"""Build the folder the GPU check carries to a lent device (``benchmarks/device_check.py`` uses it there).

Two things travel in it, both made here because the device cannot make them:

- ``wheels/``: the device's image has Python 3.12 and most of the stack (torch, transformers, pandas...) but no Ray,
  Flyte or MLflow, and nothing can be fetched there. MLflow's client (``mlflow-skinny``, at the version
  ``pyproject.toml`` pins ``mlflow`` to) travels as wheels with its dependencies (~17 MiB), downloaded for the
  device's interpreter and platform (``pip download --only-binary=:all:``), with ``requirements.txt`` (what the
  check installs).
  ``--with flytekit`` adds flytekit at its pin: 0.7 MB itself, ~32 MiB more with its dependencies (botocore alone
  is 15 MiB), which leaves no room for the shards below. Ray's wheel (~79 MB) does not fit the 64 MiB a call
  carries at all: the check runs without it.
- ``loader-shards/``: JPEG images (photo-like noise, 256 px, prepared at 224 px) as the product's Parquet shards,
  what the loader part feeds ResNet-50 with. Their prep runs in Ray tasks, which the device lacks.

    .venv/bin/python benchmarks/device_wheels.py            # writes .device-carry/ (ignored by git)

``tests/integration/test_device_check.py`` checks that the folder plus the repository's tracked files stay under 60 MiB.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.device_check import DEFAULT_CARRY, LOADER_SHARDS_DIR, REQUIREMENTS_FILE, WHEELS_DIR  # noqa: E402

DEVICE_PYTHON = "3.12"
DEVICE_PLATFORM = "manylinux2014_x86_64"
CARRIED = {"mlflow": "mlflow-skinny", "flytekit": "flytekit"}
"""Pinned project dependency -> the distribution carried for it (MLflow's client without its server's stack)."""
DEFAULT_CARRIED = ("mlflow",)
LOADER_IMAGES = 1536
"""Enough for 11 batches of 128 in the training split (the loader part times 10 after an untimed first): ~34 MiB."""


def project_pins(pyproject: Path = REPO_ROOT / "pyproject.toml") -> dict[str, str]:
    """``name -> version`` of the ``name==version`` entries of ``project.dependencies``."""
    import tomllib

    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = {}
    for entry in dependencies:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^\s;,]+)\s*", entry)
        if match:
            pins[match.group(1).lower()] = match.group(3)
    return pins


def carried_requirements(pins: dict[str, str], names: tuple[str, ...] = DEFAULT_CARRIED) -> list[str]:
    """The distributions carried for the project dependencies ``names`` at their pinned versions, ``name==version``
    each."""
    missing = sorted(set(names) - set(pins))
    if missing:
        raise ValueError(f"pyproject.toml pins no exact version of {', '.join(missing)}: pin them with '=='")
    return [f"{CARRIED[name]}=={pins[name]}" for name in names]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build_wheels(folder: Path, requirements: list[str]) -> int:
    """Download ``requirements`` and their dependencies as wheels for the device into a fresh ``folder``; returns
    its size in bytes."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
        "--python-version", DEVICE_PYTHON, "--platform", DEVICE_PLATFORM, "--dest", str(folder), *requirements,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    (folder / REQUIREMENTS_FILE).write_text("\n".join(requirements) + "\n")
    # What the device will run (pip install --no-index), resolved here against the folder alone as into an empty
    # environment: a dependency missing from the folder fails now, not there.
    verify = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-index",
        "--find-links", str(folder), "-r", str(folder / REQUIREMENTS_FILE), "--only-binary=:all:", "--implementation",
        "cp", "--python-version", DEVICE_PYTHON, "--platform", DEVICE_PLATFORM, "--target", str(folder / "unused"),
    ]  # fmt: skip
    subprocess.run(verify, check=True)
    return folder_bytes(folder)


def build_loader_shards(folder: Path, *, images: int, num_shards: int = 16) -> int:
    """``images`` photo-like JPEGs prepared at 224 px as Parquet shards in a fresh ``folder`` (the product's image
    prep: Ray tasks, on the connected cluster or a local one); returns the shards' size in bytes. 2% each go to
    validation and test (at least one image each)."""
    import tempfile

    from benchmarks.data_loading import make_tree
    from training_core.config import DataConfig
    from training_core.workloads.image import ImageClassification

    shutil.rmtree(folder, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="loader-jpegs-") as scratch:
        tree = make_tree(Path(scratch), images=images, side=256, seed=3)
        fraction = max(0.02, 1.5 / images)
        data = DataConfig(
            dataset="image_folder", path=str(tree), image_size=224, num_shards=num_shards,
            val_fraction=fraction, test_fraction=fraction,
        )  # fmt: skip
        ImageClassification().prepare_data(data, str(folder))
    return folder_bytes(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=DEFAULT_CARRY, help="the carried folder (its parts replaced)")
    parser.add_argument(
        "--with", dest="carried", nargs="+", choices=sorted(CARRIED), default=list(DEFAULT_CARRIED),
        help="project dependencies whose wheels travel (default: mlflow)",
    )  # fmt: skip
    parser.add_argument("--loader-images", type=int, default=LOADER_IMAGES, help="JPEGs for the loader part; 0: none")
    args = parser.parse_args()
    requirements = carried_requirements(project_pins(), tuple(dict.fromkeys(args.carried)))
    size = build_wheels(args.dest / WHEELS_DIR, requirements)
    wheels = len(list((args.dest / WHEELS_DIR).glob("*.whl")))
    print(f"{args.dest / WHEELS_DIR}: {wheels} wheels, {size / 2**20:.1f} MiB for {', '.join(requirements)}")
    if args.loader_images:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        size = build_loader_shards(args.dest / LOADER_SHARDS_DIR, images=args.loader_images)
        print(f"{args.dest / LOADER_SHARDS_DIR}: {args.loader_images} images, {size / 2**20:.1f} MiB")
        import ray

        ray.shutdown()
    print(f"{args.dest}: {folder_bytes(args.dest) / 2**20:.1f} MiB in all")


if __name__ == "__main__":
    main()
