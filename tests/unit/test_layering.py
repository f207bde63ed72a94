"""The package's layering (../shared/DESIGN.md, "Imports flow one way"), checked on the source.

- ``api/`` reaches models only through ``engine.protocol`` and ``engine.types``: it never
  imports ``engine.hf``, ``gateway.upstream`` or ``gateway.vllm``;
- only ``registry/build.py`` (and ``engine/`` and ``gateway/`` themselves) names a concrete
  backend class, so no ``isinstance``/``type()`` on one can exist anywhere else;
- ``engine`` never imports ``api``; ``media``, ``streaming``, ``engine/types.py`` and
  ``engine/protocol.py`` import without torch;
- files stay under 400 lines and functions under 60 (``cli/serve.py``'s ``command`` is the
  flag declarations generated from ``Settings``, one line per flag, and is left out).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src" / "vlmserve"
BACKEND_CLASSES = {"HFChatBackend", "HFEmbedBackend", "HFModel", "UpstreamBackend", "VllmBackend",
                   "EngineProcClient"}  # fmt: skip
LONG_FUNCTIONS_ALLOWED = {("cli/serve.py", "command")}


def _modules(under: str = "") -> list[Path]:
    return sorted((SRC / under).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _names(path: Path) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)} | {
        a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
        for a in n.names
    }  # fmt: skip


def _rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_api_imports_no_concrete_engine_module() -> None:
    banned = ("vlmserve.engine.hf", "vlmserve.gateway.upstream", "vlmserve.gateway.vllm")
    offenders = {
        _rel(p): sorted(m for m in _imports(p) if m.startswith(banned)) for p in _modules("api")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_only_the_build_module_names_a_backend_class() -> None:
    allowed = {"registry/build.py"}
    offenders = {}
    for path in _modules():
        rel = _rel(path)
        if rel.startswith(("engine/", "gateway/")) or rel in allowed:
            continue
        used = _names(path) & BACKEND_CLASSES
        if used:
            offenders[rel] = sorted(used)
    assert offenders == {}


def test_the_engine_never_imports_the_api() -> None:
    offenders = [_rel(p) for p in _modules("engine") if any(
        m.startswith("vlmserve.api") for m in _imports(p))]  # fmt: skip
    assert offenders == []


@pytest.mark.parametrize(
    "module",
    [
        "vlmserve.media",
        "vlmserve.streaming",
        "vlmserve.engine.types",
        "vlmserve.engine.protocol",
        "vlmserve.gateway.upstream",
        "vlmserve.gateway.pool",
    ],
)
def test_pure_layers_import_without_torch(module: str) -> None:
    code = f"import sys; sys.modules['torch'] = None; import {module}; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_files_stay_under_400_lines() -> None:
    long = {_rel(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_functions_stay_under_60_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > 60 and (_rel(path), node.name) not in LONG_FUNCTIONS_ALLOWED:
                    long[f"{_rel(path)}:{node.name}"] = size
    assert long == {}
