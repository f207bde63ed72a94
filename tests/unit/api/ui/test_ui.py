"""The console's files: served at ``/`` and ``/ui/*`` with a strict CSP, public even with API
keys, self-contained (no inline code, no other host), and absent with ``ui = false``."""

from __future__ import annotations

import re
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

from vlmserve.api.auth import AuthMiddleware
from vlmserve.api.ui import CONTENT_SECURITY_POLICY, STATIC_DIR, install_console, public_paths

_REF = re.compile(r"""(?:src|href)=["']([^"']+)["']""")
_IMPORT = re.compile(r"""from\s+["'](\./[^"']+)["']""")


def _client(ui: bool = True) -> tuple[httpx.AsyncClient, list[str]]:
    app = FastAPI()
    paths = install_console(app, SimpleNamespace(ui=ui))
    guarded = AuthMiddleware(app, api_keys=["k"], public_paths=("/health", *paths))
    transport = httpx.ASGITransport(app=guarded)
    return httpx.AsyncClient(transport=transport, base_url="http://console.test"), paths


async def test_every_console_file_is_public_and_carries_the_csp() -> None:
    client, paths = _client()
    async with client:
        assert "/" in paths and "/ui/app.js" in paths
        for path in paths:
            r = await client.get(path)
            assert r.status_code == 200, path
            assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert r.headers["x-content-type-options"] == "nosniff"
        script = await client.get("/ui/app.js")
        assert script.headers["content-type"].startswith("text/javascript")
        assert (await client.get("/ui/missing.js")).status_code == 401  # only shipped files
        assert (await client.get("/v1/models")).status_code == 401


async def test_ui_false_serves_no_console() -> None:
    client, paths = _client(ui=False)
    async with client:
        assert paths == []
        assert (await client.get("/", headers={"Authorization": "Bearer k"})).status_code == 404


def test_the_page_loads_only_shipped_files_and_has_no_inline_code() -> None:
    html = (STATIC_DIR / "index.html").read_text()
    shipped = set(public_paths())
    refs = [ref for ref in _REF.findall(html) if not ref.startswith("#")]
    assert refs and all(ref in shipped for ref in refs), refs
    assert not re.search(r"<script(?![^>]*\bsrc=)", html), "inline <script>"
    assert not re.search(r"\sstyle=|<style|\son[a-z]+=", html), "inline style or handler"
    for script in STATIC_DIR.glob("*.js"):
        code = script.read_text()
        for module in _IMPORT.findall(code):
            assert (STATIC_DIR / module).is_file(), f"{script.name} imports {module}"
        assert "innerHTML" not in code and "eval(" not in code, script.name  # text only
        stores = re.findall(r"(local|session)Storage\.|document\.cookie", code)
        if script.name == "conversation.js":  # the chat's turns, in this tab only; no key
            assert set(stores) == {"session"} and 'from "./api.js"' not in code
        else:
            assert not stores, script.name  # keys included: they stay in memory
        assert "http://" not in code and "https://" not in code, script.name


async def test_the_console_config_says_which_keys_the_server_asks_for_and_no_key() -> None:
    keyless = FastAPI()
    install_console(keyless, SimpleNamespace(ui=True, api_keys=[], admin_keys=[]))
    keyed = FastAPI()
    settings = SimpleNamespace(ui=True, api_keys=["k"], admin_keys=["a"], metrics_public=False)
    paths = install_console(keyed, settings)
    assert "/ui/config.json" in paths
    guarded = AuthMiddleware(keyed, api_keys=["k"], public_paths=("/health", *paths))
    answers = []
    for app in (keyless, guarded):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c.test") as client:
            r = await client.get("/ui/config.json")  # no key: the page reads it first
            assert r.status_code == 200
            assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            answers.append(r.json())
    assert answers[0] == {"api_key_required": False, "admin_api": False, "metrics_public": True}
    assert answers[1] == {"api_key_required": True, "admin_api": True, "metrics_public": False}
    assert all(isinstance(v, bool) for answer in answers for v in answer.values())  # no key


def test_vendored_libraries_carry_their_license_and_no_source_map_request() -> None:
    vendor = STATIC_DIR / "vendor"
    heads = {
        "marked.esm.js": "MIT License",
        "purify.min.js": "@license DOMPurify",
        "uPlot.iife.min.js": "MIT License",
    }
    for name, notice in heads.items():
        code = (vendor / name).read_text()
        assert notice in code[:400], name
        assert "sourceMappingURL" not in code, name  # the maps are not shipped
    for library in ("marked", "dompurify", "uplot"):
        assert (vendor / f"LICENSE-{library}.txt").stat().st_size > 500
    shipped = set(public_paths())
    assert "/ui/vendor/purify.min.js" in shipped and "/ui/vendor/uPlot.min.css" in shipped
