"""The package's layering (../shared/DESIGN.md, "Imports flow one way"), checked on the source.

- ``api/`` reaches models only through ``engine.protocol`` and ``engine.types``: it never
  imports ``engine.hf``, ``gateway.upstream`` or ``gateway.vllm``;
- only ``registry/build.py`` (and ``engine/`` and ``gateway/`` themselves) names a concrete
  backend class, so no ``isinstance``/``type()`` on one can exist anywhere else;
- ``engine`` never imports ``api``; ``media``, ``streaming``, ``engine/types.py`` and
  ``engine/protocol.py`` import without torch;
- code is laid out by ``ruff format`` (CI checks it): no ``# fmt: skip``/``# fmt: off`` markers;
- files stay under 400 lines and functions under 60 (``cli/serve.py``'s ``command`` is the
  flag declarations generated from ``Settings``, one line per flag, and is left out);
- the gateway is one room: only its modules import the upstream HTTP clients (the rule and its
  reasons are at ``HTTPX_OUTSIDE_THE_GATEWAY``), no module outside it (but ``registry/build.py``)
  names an upstream class, it imports neither the registry nor the API (the pass-through
  middleware gets what it needs of them from ``api/app.py``), and ``Backend`` has no member
  that only proxied models implement (those are ``Proxied``'s);
- no import cycle between files (module-level imports, as they run on import).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src" / "vlmserve"
BACKEND_CLASSES = {
    "HFChatBackend",
    "HFEmbedBackend",
    "HFModel",
    "UpstreamBackend",
    "VllmBackend",
    "EngineProcClient",
}
LONG_FUNCTIONS_ALLOWED = {
    ("cli/serve.py", "command"),
    ("engine/models/paged_attention.py", "_partial_kernel"),  # a Triton kernel is one function
}


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
        a.name
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    }


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
    offenders = [
        _rel(p)
        for p in _modules("engine")
        if any(m.startswith("vlmserve.api") for m in _imports(p))
    ]
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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_files_stay_under_500_lines() -> None:
    """Files are split by concept near 400 lines; past 500 one holds more than one."""
    long = {_rel(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_no_formatter_escapes() -> None:
    """``ruff format`` lays out every file; a squeezed line is a file to split by concept."""
    marked = [
        f"{_rel(p)}:{i}"
        for p in _modules()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert marked == []


def test_functions_stay_under_60_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > 60 and (_rel(path), node.name) not in LONG_FUNCTIONS_ALLOWED:
                    long[f"{_rel(path)}:{node.name}"] = size
    assert long == {}


# --- the gateway's room ------------------------------------------------------------------------
# Outbound HTTP: a model behind another server is reached only through the gateway package.
# aiohttp is imported by nothing; httptools (the lean client's parser) and the gateway's own
# clients only by the gateway. httpx is the one general client, and besides the gateway only
# these call other servers on their own behalf: media/ (media URLs, under the fetch policy),
# client/ (the Python client package and its tools), tagger/client.py (the tagger, a client of
# a server) and watchdog.py (the idle hook's deregistration POST). So api/, engine/, registry/
# and streaming/ never open a connection of their own.
HTTPX_OUTSIDE_THE_GATEWAY = ("media/", "client/", "tagger/client.py", "watchdog.py")
GATEWAY_CLIENTS = ("httptools", "vlmserve.gateway.upstream_http", "vlmserve.gateway.upstream_lean")


def _imported(path: Path, names: tuple[str, ...]) -> list[str]:
    below = tuple(f"{n}." for n in names)
    return sorted(m for m in _imports(path) if m in names or m.startswith(below))


def test_only_the_gateway_imports_the_upstream_http_clients() -> None:
    offenders = {}
    for path in _modules():
        rel = _rel(path)
        banned = ("aiohttp",) if rel.startswith("gateway/") else ("aiohttp", *GATEWAY_CLIENTS)
        if not rel.startswith(("gateway/", *HTTPX_OUTSIDE_THE_GATEWAY)):
            banned += ("httpx",)
        if found := _imported(path, banned):
            offenders[rel] = found
    assert offenders == {}


def _upstream_classes() -> set[str]:
    """Every class the gateway's backends are made of (``gateway/upstream*.py``, ``vllm.py``)."""
    paths = [*_modules("gateway")]
    return {
        node.name
        for p in paths
        if p.stem.startswith("upstream") or p.stem == "vllm"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
    }


def _names_and_attributes(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return _names(path) | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def test_no_module_outside_the_gateway_names_an_upstream_class() -> None:
    upstream = _upstream_classes()
    assert {"UpstreamBackend", "UpstreamConfig", "UpstreamHTTP", "VllmBackend"} <= upstream
    offenders = {}
    for path in _modules():
        rel = _rel(path)
        if rel.startswith("gateway/") or rel == "registry/build.py":  # build: entry -> backend
            continue
        if used := _names_and_attributes(path) & upstream:
            offenders[rel] = sorted(used)
    assert offenders == {}


# The registry builds the gateway's backends and the API serves them: the gateway imports
# neither (the pass-through middleware is handed the settings, sessions, models, metrics and the
# API's error answer by api/app.py).
def test_the_gateway_imports_neither_the_registry_nor_the_api() -> None:
    above = ("vlmserve.registry", "vlmserve.api")
    offenders = {}
    for path in _modules("gateway"):
        if found := sorted(m for m in _imports(path) if m.startswith(above)):
            offenders[_rel(path)] = found
    assert offenders == {}


# --- Backend carries what local models use ------------------------------------------------------
def _class_members() -> dict[str, tuple[str, list[str], set[str]]]:
    """Class name -> (its module, its bases' names, the names it defines: methods, class
    attributes, and ``self.x`` assignments)."""
    found: dict[str, tuple[str, list[str], set[str]]] = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            defs = ast.FunctionDef | ast.AsyncFunctionDef
            members = {i.name for i in node.body if isinstance(i, defs)}
            members |= {
                i.target.id
                for i in node.body
                if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)
            }
            members |= {
                t.id
                for i in node.body
                if isinstance(i, ast.Assign)
                for t in i.targets
                if isinstance(t, ast.Name)
            }
            members |= {
                e.attr
                for sub in ast.walk(node)
                if isinstance(sub, ast.Assign | ast.AnnAssign)
                for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                if isinstance(e, ast.Attribute)
                and isinstance(e.value, ast.Name)
                and e.value.id == "self"
            }
            bases = [getattr(b, "id", None) or getattr(b, "attr", "") for b in node.bases]
            found.setdefault(node.name, (_rel(path), bases, members))
    return found


def _ancestors(classes: dict[str, tuple[str, list[str], set[str]]], name: str) -> set[str]:
    seen: set[str] = set()
    todo = list(classes[name][1])
    while todo:
        if (base := todo.pop()) not in seen:
            seen.add(base)
            todo.extend(classes[base][1] if base in classes else [])
    return seen


def test_every_backend_member_is_one_a_local_backend_has() -> None:
    """A member only proxied models implement belongs on ``Proxied``: each of ``Backend``'s
    is defined by a local backend (hf, the engine process's client, Ray) or its own bases."""
    classes = _class_members()
    protocols = {"Backend", "Proxied", "Protocol"}
    local = [
        name
        for name, (rel, _, _) in classes.items()
        if "Backend" in _ancestors(classes, name)
        and not rel.startswith("gateway/")
        and name not in protocols
    ]
    assert {"HFModel", "EngineProcClient", "RayBackend"} <= set(local)
    parts = {c for name in local for c in {name} | _ancestors(classes, name)} - protocols
    have = set().union(*(classes[c][2] for c in parts if c in classes))
    assert sorted(classes["Backend"][2] - have) == []


# --- no import cycle between files ---------------------------------------------------------------
def _module_names() -> dict[str, Path]:
    names = {}
    for path in _modules():
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _top_level_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` imports when it is imported: module-level
    statements (inside ``if``/``try`` too), not function bodies nor ``if TYPE_CHECKING:``.
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``."""
    found: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += node.body + node.orelse + node.finalbody
            body += [n for h in node.handlers for n in h.body]
    return found & known.keys()


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in import order, the first again at the
    end), or None: a depth-first search that finds an edge back into its own path."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_cycle_between_files() -> None:
    known = _module_names()
    graph = {name: _top_level_imports(path, known) - {name} for name, path in known.items()}
    assert sum(map(len, graph.values())) > len(graph)  # the graph is really built
    cycle = _a_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])
