"""The documentation holds together: every relative Markdown link in README.md, docs/, benchmarks/README.md and
deployment/docs/ points at a file that exists, every ``#anchor`` into a Markdown file matches one of its headings
(GitHub's slug rule), the README stays an entry point whose module map names every module of ``training_core``, and
docs/configuration.md gives every section of ``TrainingConfig`` a line."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from training_core.config import TrainingConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
README_MAX_LINES = 200

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def checked_files() -> list[Path]:
    """The Markdown files whose links must resolve."""
    files = [README, REPO / "benchmarks" / "README.md"]
    files += sorted((REPO / "docs").glob("*.md"))
    files += sorted((REPO / "deployment" / "docs").glob("*.md"))
    return [path for path in files if path.is_file()]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The numbered lines outside fenced code blocks, with inline code spans blanked out (links there are not
    links)."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, CODE_SPAN.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, every character but word characters, hyphens and
    spaces dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of one Markdown file that point at nothing, each as 'file:line: target (why)'."""
    problems = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.name}:{number}: {target}"
            if not destination.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                problems.append(f"{where} (no heading with that anchor)")
    return problems


def test_headings_get_githubs_anchors():
    assert slug("Language models (`causal_lm`)") == "language-models-causal_lm"
    assert slug("What Ray costs, and the settings the product ships") == (
        "what-ray-costs-and-the-settings-the-product-ships"
    )
    assert slug("Data at scale: image prep on Ray, Parquet shards") == "data-at-scale-image-prep-on-ray-parquet-shards"


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md#a-section) [second](other.md#a-section-1) [self](#page) [web](https://example.com/x.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) `[in code](missing.md)`\n\n"
        "```\n[in a fence](missing.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "missing.md (no such file)" in problems[0]
    assert "other.md#nowhere (no heading with that anchor)" in problems[1]


@pytest.mark.parametrize("path", checked_files(), ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_in_the_docs_points_at_a_file_and_heading_that_exist(path):
    assert broken_links(path) == []


def test_the_readme_is_an_entry_point_that_links_every_docs_page_and_the_benchmarks():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {target for _, line in prose_lines(text) for target in LINK.findall(line)}
    pages = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "docs").glob("*.md"))
    assert pages, "docs/ holds the topics the README links to"
    missing = [page for page in pages + ["benchmarks/README.md"] if page not in linked]
    assert missing == []


def test_the_readme_module_map_names_every_module_and_subpackage_of_training_core():
    text = README.read_text(encoding="utf-8")
    package = REPO / "training_core"
    names = [path.name for path in package.glob("*.py")]
    for sub in sorted(path for path in package.iterdir() if (path / "__init__.py").is_file()):
        names.append(f"{sub.name}/")
        names += [f"{sub.name}/{path.name}" for path in sub.glob("*.py")]
    missing = sorted(name for name in names if f"| `{name}` |" not in text)
    assert missing == []


def test_the_configuration_page_gives_every_section_of_the_config_a_line():
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    sections = [field.name for field in dataclasses.fields(TrainingConfig)]
    missing = [name for name in sections if not re.search(rf"^\| `{name}` \|", text, re.MULTILINE)]
    assert missing == []
