"""The plumbing of the overhead benchmarks (``byteproxy``, ``stores.py``), in seconds."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from upstreams import fake_upstreams
from vlmserve.streaming.store.memory import MemoryStore
from vlmserve.streaming.store.sqlite import SQLiteStore

BENCH = Path(__file__).parents[2] / "benchmarks"


def load(name: str, path: Path) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_byteproxy_forwards_bytes_status_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = load("bench_byteproxy", BENCH / "peers" / "byteproxy.py")
    sse = b'data: {"a": 1}\n\ndata: [DONE]\n\n'

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/missing":
            return httpx.Response(404, json={"error": {"message": "nope"}})
        assert request.content == b'{"stream": true}'
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    async with fake_upstreams(upstream, "http://up") as fake:
        monkeypatch.setenv("BYTEPROXY_UPSTREAM", fake.urls["http://up"])
        transport = httpx.ASGITransport(app=proxy.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            ok = await client.post("/v1/chat/completions", content=b'{"stream": true}')
            missing = await client.get("/missing")
        if proxy._session is not None:
            await proxy._session.close()
    assert (ok.status_code, ok.content, ok.headers["content-type"]) == (
        200, sse, "text/event-stream")  # fmt: skip
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "nope"


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_stores_bench_counts_every_event(store: str, tmp_path: Path) -> None:
    stores = load("bench_stores", BENCH / "stores.py")
    ns = argparse.Namespace(sessions=3, events=5, step_ms=1.0)
    s = MemoryStore() if store == "memory" else SQLiteStore(tmp_path / "s.db")
    out = await stores._measured(s, ns, "t")
    assert out["events"] == 3 * (5 + 1)  # each event and each session's [DONE]
    assert out["cpu_us_per_event"] > 0
    assert (out["writes"] == "-") == (store == "memory")
