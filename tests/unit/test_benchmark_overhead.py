"""The plumbing of the overhead benchmarks (``byteproxy``, ``stores.py``), in seconds."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import import_benchmark
from upstreams import fake_upstreams
from vlmserve.streaming.store.memory import MemoryStore
from vlmserve.streaming.store.sqlite import SQLiteStore


async def test_byteproxy_forwards_bytes_status_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = import_benchmark("peers/byteproxy.py")
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
        200,
        sse,
        "text/event-stream",
    )
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "nope"


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_stores_bench_counts_every_event(store: str, tmp_path: Path) -> None:
    stores = import_benchmark("stores.py")
    ns = argparse.Namespace(sessions=3, events=5, step_ms=1.0)
    s = MemoryStore() if store == "memory" else SQLiteStore(tmp_path / "s.db")
    out = await stores._measured(s, ns, "t")
    assert out["events"] == 3 * (5 + 1)  # each event and each session's [DONE]
    assert out["cpu_us_per_event"] > 0
    assert (out["copies"] == "-") == (store == "memory")


def test_stores_bench_gil_check_times_both_copies_and_stores_every_event(capsys) -> None:
    stores = import_benchmark("stores.py")
    copied = []
    real = stores._copy_all
    stores._copy_all = lambda conn, rows: (real(conn, rows), copied.append(_count(conn)))
    try:
        assert stores.gil_check(copies=2, steps=3, sessions=2) == 0
    finally:
        stores._copy_all = real
    assert copied == [6, 12] * 2  # alone, then beside the busy thread: every event in
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("us CPU/event" in line for line in lines)
    assert sum("copy_entries" in line for line in lines) == 2


def _count(conn: Any) -> int:
    return int(conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])


async def test_interleaved_ttft_times_each_setup_in_turn_at_its_first_token() -> None:
    ttft = import_benchmark("peers/ttft.py")
    seen: list[str] = []
    sse = (
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    )

    def upstream(request: httpx.Request) -> httpx.Response:
        body = request.read()
        assert b'"stream":true' in body.replace(b" ", b"") and b"image_url" in body
        seen.append(request.url.host)
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    async with fake_upstreams(upstream, "http://a", "http://b") as fake:
        times = await ttft.interleaved_ttft(fake.urls, 3, "tiny")
    assert {k: len(v) for k, v in times.items()} == {"http://a": 3, "http://b": 3}
    assert all(t > 0 for v in times.values() for t in v)
    assert ttft.added_ms({"a": [3.0, 5.0, 4.0], "b": [1.0, 2.0, 9.0]}, "a", "b") == 2.0
    assert ttft.added_ms({"a": [3.0]}, "a", "b") is None


def test_the_gateway_ttft_budget_is_judged_on_interleaved_requests_when_there_are_some() -> None:
    overhead = import_benchmark("overhead.py")
    from peers.tables import Row

    def row(server: str, ttft: float) -> Row:
        return Row(server, 1, 2, 8, 0, 500.0, 490.0, 510.0, ttft, 1.5, 100.0)

    rows = [row("memory", 10.0), row("gateway", 14.0), row("byteproxy", 10.5)]
    by_rounds = {c["setup"]: c for c in overhead.budgets(rows) if c["metric"] == "ttft_ms"}
    assert by_rounds["gateway"]["cost"] == 4.0 and not by_rounds["gateway"]["ok"]
    times = {"memory": [10.0, 11.0, 12.0], "gateway": [11.5, 11.8, 12.2], "byteproxy": [11.0]}
    judged = {c["setup"]: c for c in overhead.budgets(rows, times) if c["metric"] == "ttft_ms"}
    assert judged["gateway"]["cost"] == pytest.approx(0.8) and judged["gateway"]["ok"]
    assert judged["byteproxy"]["cost"] == pytest.approx(0.0)


def test_both_gateway_setups_front_the_memory_worker_one_without_the_pass_through(
    tmp_path: Path,
) -> None:
    overhead = import_benchmark("overhead.py")
    cfg = argparse.Namespace(in_process=False, model_dir="/m", dtype="float32")
    specs = {s.name: s for s in overhead.overhead_specs(cfg, [1, 2, 3, 4, 5], tmp_path)}
    registry = (tmp_path / "registry.toml").read_text()
    assert specs["memory"].url in registry
    for name in ("gateway", "gateway-sessions"):
        argv = specs[name].argv
        assert "--model" not in argv and argv[argv.index("--registry") + 1].endswith(".toml")
    assert specs["gateway-sessions"].env["VLMSERVE_GATEWAY_PASSTHROUGH"] == "false"
    assert "VLMSERVE_GATEWAY_PASSTHROUGH" not in specs["gateway"].env
    assert len({s.port for s in specs.values()}) == 5


async def test_hops_times_the_request_and_the_first_token_of_one_stream() -> None:
    """Through the stamping worker (in process): both paths are measured from the stamps of
    the one content chunk, and a request is read to its end."""
    hops = import_benchmark("hops.py")
    worker = import_benchmark("peers/stamping_worker.py")
    transport = httpx.ASGITransport(app=worker.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
        request, first = await hops.one_request(client, {"model": "tiny", "stream": True})
        health = await client.get("/health")
    assert 0 <= request < 50 and 0 <= first < 50
    assert health.json()["resumableStreams"] is True  # a gateway passes its streams through
    assert worker.stamps('data: {"choices":[{"delta":{"content":"12 34"}}]}') == (12, 34)
    assert worker.stamps('data: {"choices":[{"delta":{"content":"Hi"}}]}') is None
    assert worker.stamps("data: [DONE]") is None


def test_hops_runs_the_worker_and_three_proxies_in_front_of_it(tmp_path: Path) -> None:
    hops = import_benchmark("hops.py")
    specs = {s.name: s for s in hops.hop_specs([1, 2, 3, 4], tmp_path)}
    assert list(specs) == ["direct", "gateway", "gateway-sessions", "byteproxy"]
    assert specs["byteproxy"].env["BYTEPROXY_UPSTREAM"] == "http://127.0.0.1:1"
    assert specs["gateway-sessions"].env == {"VLMSERVE_GATEWAY_PASSTHROUGH": "false"}
    registry = (tmp_path / "registry.toml").read_text()
    assert 'base_urls = ["http://127.0.0.1:1"]' in registry and "preflight = false" in registry


def test_sqlite_budgets_are_judged_round_by_round_against_the_neighbouring_baseline() -> None:
    """Drift that slows both setups alike (memory 3,000 -> 2,000 tok/s) cancels in each
    round's pair; the ratio of the medians (kept as ``cost_of_medians``) would not."""
    overhead = import_benchmark("overhead.py")
    from peers.tables import summarize

    tps = {"memory": [3000.0, 2000.0, 2500.0], "sqlite": [2940.0, 1900.0, 2000.0]}
    ttft = {"memory": [50.0, 60.0, 40.0], "sqlite": [51.0, 64.8, 60.0]}
    samples = []
    for name in tps:
        for rnd in range(3):
            report = {
                "output_throughput": tps[name][rnd],
                "ttft_ms": {"median": ttft[name][rnd]},
                "requests": 1,
                "failed": 0,
                "tpot_ms": {"median": 1.0},
                "e2e_ms": {"median": 1.0},
            }
            samples.append(overhead.Sample(name, 8, rnd, report, 1.0))
    paired = overhead.paired_costs(samples)
    assert paired[("sqlite", 8, "tok/s")] == pytest.approx(0.05)  # of 0.02, 0.05, 0.20
    assert paired[("sqlite", 8, "ttft")] == pytest.approx(0.08)  # of 0.02, 0.08, 0.50
    rows = summarize([(s.server, s.concurrency, s.report) for s in samples])
    checks = {c["metric"]: c for c in overhead.budgets(rows, None, paired)}
    assert checks["tok/s"]["cost"] == pytest.approx(0.05) and checks["tok/s"]["ok"]
    assert checks["tok/s"]["cost_of_medians"] == pytest.approx(0.20)
    assert checks["ttft"]["cost"] == pytest.approx(0.08) and checks["ttft"]["ok"]
    unpaired = {c["metric"]: c for c in overhead.budgets(rows)}
    assert unpaired["tok/s"]["cost"] == pytest.approx(0.20) and not unpaired["tok/s"]["ok"]
