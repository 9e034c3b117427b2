"""The suite's layout (docs/testing.md): shared helpers live in ``tests/helpers`` (or a conftest), never in a test
module another one imports; every test file name is unique across the tiers; every test carries exactly one tier
marker, so ``pytest -m <tier>`` selects each tier whole."""

from __future__ import annotations

import ast
import re
import tomllib
from collections import Counter

from tests.conftest import REPO_ROOT, TESTS_DIR, TIERS

# An import of a test module written inside a string: the source of a script a test runs in a subprocess.
_IMPORT_IN_TEXT = re.compile(r"(?:from|import)\s+(tests(?:\.\w+)*\.test_\w+)")


def _test_modules() -> list:
    return sorted(TESTS_DIR.rglob("test_*.py"))


def _module_name(path) -> str:
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


def _imported_test_modules(source: str) -> set[str]:
    """The test modules (``tests.*.test_*``) that ``source`` imports, at any level or in the text of a script."""
    names = set(_IMPORT_IN_TEXT.findall(source))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if re.fullmatch(r"tests(\.\w+)*\.test_\w+", name)}


def test_no_test_module_imports_another_test_module():
    found = {}
    for path in _test_modules():
        names = _imported_test_modules(path.read_text(encoding="utf-8")) - {_module_name(path)}
        if names:
            found[_module_name(path)] = sorted(names)
    assert not found, f"move what they share into tests/helpers/ or a conftest fixture: {found}"


def test_the_check_finds_a_test_module_imported_at_any_level_or_in_a_scripts_text():
    source = (
        "import " + "tests.unit.test_nonfinite\n"
        "from tests.helpers.runtime import InProcessRuntime\n"
        "def test_x():\n"
        "    from tests.unit import " + "test_run_worker\n"
        "SCRIPT = 'from " + "tests.flyte.test_training_pipeline import pyflyte_run'\n"
    )
    assert _imported_test_modules(source) == {
        "tests.unit.test_nonfinite",
        "tests.unit.test_run_worker",
        "tests.flyte.test_training_pipeline",
    }


def test_every_test_file_name_is_unique_across_the_tiers():
    counts = Counter(path.name for path in _test_modules())
    twice = {
        name: [str(p.relative_to(TESTS_DIR)) for p in _test_modules() if p.name == name]
        for name, n in counts.items()
        if n > 1
    }
    assert not twice, f"rename the copy outside tests/unit after what it tests there: {twice}"


def test_every_folder_of_tests_is_a_tier_registered_as_a_marker():
    folders = {path.relative_to(TESTS_DIR).parts[0] for path in _test_modules()}
    assert folders == set(TIERS), f"test modules sit in {sorted(folders)}; the tiers are {TIERS}"
    pytest_options = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {marker.split(":")[0] for marker in pytest_options["markers"]}
    assert set(TIERS) <= registered and "--strict-markers" in pytest_options["addopts"]


def test_no_test_module_sets_a_tier_marker_itself():
    """The tier comes from the folder alone: a hand-set one could contradict it."""
    by_hand = re.compile(r"pytest\.mark\.(" + "|".join(TIERS) + r")\b")
    found = [str(path.relative_to(TESTS_DIR)) for path in _test_modules() if by_hand.search(path.read_text())]
    assert not found, found


def test_every_collected_test_carries_exactly_one_tier_marker(request):
    """Over what this session collected: the whole suite in a full run."""
    wrong = {
        item.nodeid: tiers
        for item in request.session.items
        if len(tiers := [mark.name for mark in item.iter_markers() if mark.name in TIERS]) != 1
    }
    assert not wrong, wrong
    assert request.node.get_closest_marker("unit") is not None
