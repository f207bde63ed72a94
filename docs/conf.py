"""Sphinx configuration of the vlmserve manual (Markdown pages read by MyST).

Build: ``sphinx-build -W --keep-going -b html docs docs/_build`` (CI runs it; warnings fail it).
"""

project = "vlmserve"
author = "vlmserve contributors"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# Links like [x](engine.md#cpu-dtype) resolve to the GitHub-style anchor of a heading.
myst_heading_anchors = 4
html_theme = "alabaster"
html_title = "vlmserve manual"
