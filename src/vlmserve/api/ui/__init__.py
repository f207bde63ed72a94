"""The web console at ``/``: static files shipped in the package, no CDN, no build step.

The page (``static/index.html`` plus small ES modules and one stylesheet) talks only to the
server's public API with ``fetch``; the API key is typed into the page and kept in memory. Its
files are public even when API keys are set (they hold no data), so ``install_console`` returns
their exact paths for ``AuthMiddleware(public_paths=...)``, with ``/ui/config.json``: which keys
the server asks for (no key itself), so the page tells a keyless server from a keyed one before
anything is typed (a 401 or a 403 tells anyone as much). Every console response carries a
strict Content-Security-Policy: scripts and styles from this origin only, no inline code, no
frames, and connections to this origin only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

__all__ = [
    "ASSETS_PATH",
    "CONFIG_PATH",
    "CONTENT_SECURITY_POLICY",
    "STATIC_DIR",
    "console_config",
    "install_console",
]

STATIC_DIR = Path(__file__).parent / "static"
ASSETS_PATH = "/ui"
CONFIG_PATH = f"{ASSETS_PATH}/config.json"
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: an upgraded server never runs stale scripts
}


class ConsoleFiles(StaticFiles):
    """``StaticFiles`` whose answers (files, 304s and 404s alike) carry the security headers."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def public_paths(static_dir: Path = STATIC_DIR) -> list[str]:
    """``/`` and every shipped file's URL: what the page loads before a key is typed."""
    files = sorted(p for p in static_dir.rglob("*") if p.is_file())
    return ["/", *(f"{ASSETS_PATH}/{p.relative_to(static_dir).as_posix()}" for p in files)]


def console_config(settings: Any) -> dict[str, Any]:
    """What the page needs to know before a key is typed: whether ``/v1`` needs an API key,
    whether the admin API is open to an admin key (it is closed without one), and whether
    ``/metrics`` answers without a key."""
    return {
        "api_key_required": bool(getattr(settings, "api_keys", None)),
        "admin_api": bool(getattr(settings, "admin_keys", None)),
        "metrics_public": bool(getattr(settings, "metrics_public", True)),
    }


def install_console(app: FastAPI, settings: Any) -> list[str]:
    """Serve the console at ``/`` (assets under ``/ui``) unless ``settings.ui`` is false;
    returns the paths to make public (none when the console is off)."""
    if not getattr(settings, "ui", True):
        return []
    index = STATIC_DIR / "index.html"
    config = console_config(settings)

    async def console(request: Request) -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=SECURITY_HEADERS)

    async def config_json(request: Request) -> JSONResponse:
        return JSONResponse(config, headers=SECURITY_HEADERS)

    # Plain routes like the /ui mount, not APIRoutes: a page, not part of the API. The config
    # route comes before the mount, which would otherwise answer its path with a 404.
    app.add_route("/", console, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_route(CONFIG_PATH, config_json, methods=["GET"], include_in_schema=False)
    app.mount(ASSETS_PATH, ConsoleFiles(directory=STATIC_DIR), name="console-assets")
    return [*public_paths(), CONFIG_PATH]
