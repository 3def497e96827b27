"""The map a newcomer reads: README.md stays a short user's page, every relative link in README.md,
ARCHITECTURE.md and docs/ points at a file (and heading) that exists, and where the code cites one of ARCHITECTURE.md's rules
by its anchor, that section exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITATION = re.compile(r"ARCHITECTURE\.md#([\w-]+)")
RULE_NAMES = re.compile(r"\[(R-[\w-]+(?:(?:, | to |\] to \[)R-[\w-]+)*)\]")  # code cites [R-pool] or several in one bracket
SOURCE_SUFFIXES = {".py", ".c", ".h", ".sh", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg"}
SKIP_DIRS = {".git", ".venv", "build", "node_modules", ".hypothesis", "__pycache__"}


def markdown_pages() -> list[Path]:
    return [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link inside ``` is not rendered as one)."""
    return "\n".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", prose(path.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def source_files():
    """Every text file of the checkout that may cite a rule (virtual environments and build output skipped)."""
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if Path(name).suffix in SOURCE_SUFFIXES:
                yield Path(folder) / name


def test_readme_is_a_short_page_for_users():
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; keep it under {README_MAX_LINES} for users and "
                                       "move measurements, design and history to docs/")


def test_every_relative_link_resolves():
    broken = {str(page.relative_to(REPO)): found for page in markdown_pages() if (found := broken_links(page))}
    assert broken == {}, f"links to files or headings that do not exist: {broken}"


def test_the_map_cites_nothing_outside_the_repository():
    for name in ("README.md", "ARCHITECTURE.md"):
        text = (REPO / name).read_text(encoding="utf-8")
        assert "DESIGN §" not in text and "../shared" not in text, f"{name} points outside the repository"


def test_citations_of_the_rules_name_existing_sections():
    rules = anchors(REPO / "ARCHITECTURE.md")
    assert {"r-pool", "r-static-step", "r-page-score"} <= rules  # the rules the code cites most
    missing = {}
    for path in source_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        cited = set(CITATION.findall(text)) | {name.lower() for group in RULE_NAMES.findall(text)
                                               for name in re.findall(r"R-[\w-]+", group)}
        if cited - rules:
            missing[str(path.relative_to(REPO))] = sorted(cited - rules)
    assert missing == {}, f"citations of ARCHITECTURE.md sections that do not exist: {missing}"


def test_no_file_cites_a_design_document_outside_the_repository():
    citing = [str(path.relative_to(REPO)) for path in source_files() if path.name != "test_docs_map.py"
              and re.search(r"DESIGN §|DESIGN\.md|\.\./shared/", path.read_text(encoding="utf-8", errors="replace"))]
    assert citing == [], f"these files cite a document outside the repository (cite ARCHITECTURE.md's rules): {citing}"


def test_rule_citations_are_read_from_code(tmp_path):
    text = "x = 1  # ([R-pool], [R-candidates] to [R-exact-attention]; [R-pool, R-window]) and [not a rule]"
    found = {name for group in RULE_NAMES.findall(text) for name in re.findall(r"R-[\w-]+", group)}
    assert found == {"R-pool", "R-candidates", "R-exact-attention", "R-window"}


def test_the_link_checker_sees_broken_links(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nope) [web](https://x.y/z)\n"
                    "```\n[in code](also-missing.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "there.md#nope (no heading with that anchor)"]
