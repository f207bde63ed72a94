"""``/docs`` and ``/redoc`` work without internet: every asset they load is served here."""

from __future__ import annotations

import re

import httpx
import pytest

_SRC = re.compile(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_load_only_assets_this_server_serves(
    client: httpx.AsyncClient, page: str
) -> None:
    r = await client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    refs = _SRC.findall(r.text)
    assert any(ref.endswith(".js") for ref in refs), refs
    for ref in refs:
        assert ref.startswith("/"), f"{page} loads {ref} from another host"
        asset = await client.get(ref)
        assert asset.status_code == 200, ref
        assert len(asset.content) > 500, ref
    assert "openapi.json" in r.text


async def test_the_openapi_document_lists_the_api(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    assert "/v1/chat/completions" in spec["paths"]
    assert "/v1/models/{model_id}" in spec["paths"]
