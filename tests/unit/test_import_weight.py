import subprocess
import sys

HEAVY = ("torch", "ray", "flytekit", "mlflow", "numpy", "pandas", "torchvision")


def _imported_modules(statement: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True, check=True
    )
    modules = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return modules


def test_importing_training_core_loads_no_torch_ray_or_flytekit():
    loaded = _imported_modules("import training_core")
    assert loaded, "importtime produced no output"
    assert not loaded & set(HEAVY), f"heavy modules at import: {sorted(loaded & set(HEAVY))}"


def test_importing_the_config_stays_light_too():
    loaded = _imported_modules("import training_core.config")
    assert not loaded & set(HEAVY), f"heavy modules at import: {sorted(loaded & set(HEAVY))}"


def test_training_core_never_imports_flytekit():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "training_core"
    pattern = re.compile(r"^\s*(import|from)\s+flytekit", re.MULTILINE)
    offenders = [p.name for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
