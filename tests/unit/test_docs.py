"""The manual in docs/ and the comments in src/: what the code is, not the history of its making.

The design page maps every folder of the package. No line of src/ or docs/ names this project's
own work items ("issue 22", "session 18", "stop 12", "seed 000") or a dated log entry; an
upstream project's issue is cited as ``owner/repo#N``. Dates belong in the changelog only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "vlmserve"
DOCS = ROOT / "docs"

# "issue 22", "Session 18", "stop #12", "seed 000"; an upstream reference such as
# huggingface/transformers#38105 or "transformers issue 38105" says whose issue it is.
WORK_ITEM = re.compile(r"(?<![\w/#.-])(?:issue|session|stop|seed) #?\d+\b", re.IGNORECASE)
BARE_NUMBER = re.compile(r"(?<![\w/#&-])#\d{2,}\b")  # "#403", not owner/repo#403
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
TEXT_SUFFIXES = {".py", ".md", ".js", ".html", ".jinja", ".toml", ".txt"}


def _package_folders() -> list[str]:
    folders = ["vlmserve/"]
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_dir() and path.name != "__pycache__" and not path.name.startswith("."):
            folders.append(path.relative_to(PACKAGE).as_posix() + "/")
    return folders


def test_the_design_page_has_one_line_per_package_folder() -> None:
    text = (DOCS / "design.md").read_text()
    section = text[text.index("## Module map") :]
    table = next(block for block in section.split("\n\n") if block.startswith("|"))
    listed = re.findall(r"(?m)^\| `([^`]+/)` \|", table)
    assert sorted(set(listed)) == sorted(listed), "a folder is listed twice"
    missing = sorted(set(_package_folders()) - set(listed))
    gone = sorted(set(listed) - set(_package_folders()))
    assert not missing, f"folders without a line in docs/design.md's module map: {missing}"
    assert not gone, f"docs/design.md maps folders that no longer exist: {gone}"


def _text_files(root: Path) -> list[Path]:
    return sorted(
        path
        for path in root.rglob("*")
        if path.is_file()
        and path.suffix in TEXT_SUFFIXES
        and "_build" not in path.parts
        and "vendor" not in path.parts  # third-party libraries, kept as released
    )


def _offending_lines(pattern: re.Pattern[str], files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_no_line_of_src_or_docs_names_a_work_item_of_this_project() -> None:
    files = _text_files(PACKAGE) + _text_files(DOCS)
    found = _offending_lines(WORK_ITEM, files) + _offending_lines(BARE_NUMBER, files)
    assert not found, "say what is and why, or cite upstream as owner/repo#N:\n" + "\n".join(found)


def test_dates_appear_only_in_the_changelog() -> None:
    files = [p for p in _text_files(PACKAGE) + _text_files(DOCS) if p.name != "changelog.md"]
    found = _offending_lines(DATE, files)
    assert not found, "a dated entry belongs in docs/changelog.md:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "fixed in issue 22",
        "see Session 18's runs",
        "stop #12 of the plan",
        "(seed 000's form)",
        "bug #403",
    ],
)
def test_the_check_catches_work_item_references(line: str) -> None:
    assert WORK_ITEM.search(line) or BARE_NUMBER.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "after huggingface/transformers#38105",
        "seeds 1..8, with seed + i",
        "a stream session's id",
        "color: #18794e;",
        "stop_token_ids",
    ],
)
def test_the_check_lets_upstream_references_and_plain_words_through(line: str) -> None:
    assert not WORK_ITEM.search(line) and not BARE_NUMBER.search(line)
