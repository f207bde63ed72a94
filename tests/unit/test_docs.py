"""The manual in docs/: its design page maps every folder of the package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "vlmserve"
DOCS = ROOT / "docs"


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
