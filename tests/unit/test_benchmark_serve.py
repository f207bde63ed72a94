"""benchmarks/serve.py plumbing: arguments, server command lines, process cleanup, the
rewrite for peers without ``ignore_eos``, and the summary / ratio tables on canned load reports.
No peer and no model server is started here (the benchmark itself is run by hand)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from support import import_benchmark
from vlmserve.client.stats import LoadReport, Summary

serve = import_benchmark("serve.py")
from peers import servers, tables  # noqa: E402 -- importable once serve.py is loaded


def report(
    tps: float, ttft: float, *, failed: int = 0, requests: int = 16, itl: float = 5.0
) -> dict:
    """A real LoadReport's dict: the shape serve.py reads must match the load tester's."""
    lat = Summary(mean=ttft, median=ttft, p90=ttft * 2, p99=ttft * 3)
    return LoadReport(
        requests=requests,
        completed=requests - failed,
        failed=failed,
        errors={},
        duration_s=1.0,
        request_throughput=1.0,
        output_throughput=tps,
        total_token_throughput=tps,
        total_input_tokens=100,
        total_output_tokens=int(tps),
        ttft_ms=lat,
        tpot_ms=Summary(5, 5, 6, 7),
        itl_ms=Summary(itl, itl, 2 * itl, 10 * itl),
        e2e_ms=Summary(300, 300, 400, 500),
        goodput=None,
    ).to_dict()


def config(tmp_path: Path, *extra: str):
    argv = ["--model", str(tmp_path / "ckpt"), "--peers-dir", str(tmp_path / "peers"), *extra]
    return serve.build_config(serve.parse_args(argv))


def test_defaults_are_image_requests_of_fixed_length_at_three_concurrencies(tmp_path):
    cfg = config(tmp_path)
    assert cfg.workloads == ["short"]
    assert cfg.concurrencies == [1, 8, 32]
    assert cfg.image == (64, 64)
    assert cfg.max_tokens == 64
    assert cfg.sequential and cfg.peers == [] and cfg.rounds >= 2
    assert serve.requests_for(cfg, 1) == 8 and serve.requests_for(cfg, 32) == 64


def test_image_flag_takes_wxh_or_none_and_rejects_the_rest(tmp_path, capsys):
    assert config(tmp_path, "--image", "32x48").image == (32, 48)
    assert config(tmp_path, "--image", "none").image is None
    with pytest.raises(SystemExit):
        config(tmp_path, "--image", "64")
    assert "use WxH" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="at least 1"):
        config(tmp_path, "--concurrency", "0")


def test_plan_gives_each_server_its_own_port_and_the_one_at_a_time_flag(tmp_path):
    cfg = config(tmp_path, "--peer", "vllm", "--peer", "transformers-serve", "--peer", "vllm")
    specs = serve.plan_specs(cfg, servers.free_ports(4))
    assert [s.name for s in specs] == ["vlmserve", "vlmserve-1seq", "vllm", "transformers-serve"]
    assert len({s.port for s in specs}) == 4
    one = specs[1]
    assert one.argv[one.argv.index("--max-num-seqs") + 1] == "1"
    assert one.env["VLMSERVE_MAX_NUM_SEQS"] == "1"
    assert "--max-num-seqs" not in specs[0].argv
    vllm = specs[2]
    assert vllm.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # not `vllm serve`
    assert vllm.env["HF_HUB_OFFLINE"] == "1" and vllm.ready_path == "/health"
    assert vllm.ignore_eos and vllm.extra_body(64) == {}


def test_missing_peer_is_reported_as_not_installed_with_the_fix(tmp_path):
    cfg = config(tmp_path, "--peer", "vllm")
    spec = serve.plan_specs(cfg, [1, 2, 3])[2]
    out = serve.Outcome()
    assert serve.start(spec, cfg, out, Console(file=io.StringIO())) is None
    assert out.status["vllm"].startswith("not installed: ")
    assert "install_vllm.sh" in out.status["vllm"]


def test_transformers_serve_pins_length_with_generation_config_not_ignore_eos(tmp_path):
    cfg = config(tmp_path, "--no-sequential", "--peer", "transformers-serve")
    spec = serve.plan_specs(cfg, [1, 2])[1]
    assert spec.model == cfg.model_dir  # a pinned `transformers serve DIR` only answers to DIR
    assert not spec.ignore_eos
    extra = spec.extra_body(64)
    assert json.loads(extra["generation_config"]) == {"min_new_tokens": 64, "max_new_tokens": 64}


async def test_body_rewrite_drops_ignore_eos_and_adds_the_extra_fields():
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={})

    transport = servers.BodyRewrite({"generation_config": "{}"}, connections=2)
    transport.inner = httpx.MockTransport(handler)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        body = {"model": "m", "max_tokens": 8, "ignore_eos": True, "stream": True}
        await client.post("/v1/chat/completions", json=body)
    assert seen == [{"model": "m", "max_tokens": 8, "stream": True, "generation_config": "{}"}]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_stop_kills_the_server_and_the_children_it_forked(tmp_path):
    port = servers.free_ports(1)[0]
    child_pid = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {child_pid}; exec {sys.executable} -m http.server {port}"
    spec = servers.ServerSpec(
        name="fake", argv=["sh", "-c", script], port=port, model="m", ready_path="/"
    )
    server = servers.Server(spec, tmp_path / "logs")
    server.start(timeout=30)
    leader, child = server.proc.pid, int(child_pid.read_text())
    server.stop(grace=5)
    deadline = time.monotonic() + 5
    while not (_gone(leader) and _gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(leader) and _gone(child)


def test_a_server_that_exits_at_start_raises_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('bad flag --foo'); sys.exit(3)"]
    spec = servers.ServerSpec(name="bad", argv=argv, port=servers.free_ports(1)[0], model="m")
    server = servers.Server(spec, tmp_path)
    with pytest.raises(servers.StartError, match=r"exited with 3: bad flag --foo"):
        server.start(timeout=30)
    server.stop()


def test_summary_takes_medians_over_rounds_and_ratios_compare_with_vlmserve():
    samples = [
        ("vlmserve", 8, report(100.0, 40.0)),
        ("vlmserve", 8, report(300.0, 60.0)),
        ("vlmserve", 8, report(200.0, 50.0, failed=1)),
        ("vllm", 8, report(400.0, 25.0)),
        ("vlmserve-1seq", 8, report(50.0, 200.0)),
        ("vlmserve", 1, report(90.0, 30.0)),
    ]
    rows = tables.summarize(samples)
    assert (rows[0].server, rows[0].concurrency) == ("vlmserve", 1)  # sorted by level
    mine = next(r for r in rows if r.server == "vlmserve" and r.concurrency == 8)
    assert (mine.output_tps, mine.output_tps_min, mine.output_tps_max) == (200.0, 100.0, 300.0)
    assert mine.ttft_p50_ms == 50.0 and mine.rounds == 3
    assert (mine.failed, mine.requests) == (1, 48)
    ratios = tables.ratio_rows(rows, "vlmserve", ["vlmserve-1seq", "vllm"])
    by_other = {r["other"]: r for r in ratios}
    assert set(by_other) == {"vllm", "vlmserve-1seq"}  # no peer row at c=1: nothing to divide
    assert by_other["vllm"]["output_tps_ratio"] == pytest.approx(0.5)
    assert by_other["vllm"]["ttft_p50_ratio"] == pytest.approx(2.0)
    assert by_other["vlmserve-1seq"]["output_tps_ratio"] == pytest.approx(4.0)


def test_rendered_tables_show_ratios_and_servers_not_measured():
    no_usage = {**report(0.0, 0), "usage_missing": 16}  # like `transformers serve` streams
    rows = tables.summarize([("vlmserve", 8, report(200.0, 50.0)), ("vllm", 8, no_usage)])
    ratios = tables.ratio_rows(rows, "vlmserve", ["vllm"])
    assert ratios[0]["output_tps_ratio"] is None  # division by zero tok/s is shown as "-"
    console = Console(record=True, width=160, file=io.StringIO())
    status = {"vlmserve": "ok", "vllm": "ok", "transformers-serve": "not installed: no venv"}
    tables.render(console, rows, ratios, status, "vlmserve-1seq")
    text = console.export_text()
    assert "vlmserve / vllm" in text and "200.0" in text
    assert "transformers-serve: not measured: not installed: no venv" in text
    assert "vllm: replies without a usage chunk" in text
    assert "vlmserve: replies without" not in text


def test_json_output_holds_config_statuses_samples_and_ratios(tmp_path):
    cfg = config(tmp_path, "--json", str(tmp_path / "out.json"))
    out = serve.Outcome(status={"vlmserve": "ok"}, commands={"vlmserve": ["vlmserve", "serve"]})
    out.samples.append(serve.Sample("vlmserve", 8, 0, report(200.0, 50.0)))
    rows = tables.summarize([(s.server, s.concurrency, s.report) for s in out.samples])
    doc = json.loads(json.dumps(serve.to_json(cfg, out, rows, [])))
    assert doc["servers"]["vlmserve"] == {"status": "ok", "command": ["vlmserve", "serve"]}
    assert doc["samples"][0]["report"]["output_throughput"] == 200.0
    assert doc["summary"][0]["output_tps"] == 200.0
    assert doc["config"]["image"] == [64, 64] and doc["config"]["max_tokens"] == 64


def test_cache_check_flags_default_to_a_448_image_at_qwens_pixel_cap(tmp_path):
    cfg = config(tmp_path)
    assert cfg.cache_image == (448, 448) and cfg.cache_max_pixels == 1280 * 28 * 28
    assert config(tmp_path, "--cache-image", "none").cache_image is None
    with pytest.raises(SystemExit, match="at least 1"):
        config(tmp_path, "--cache-rounds", "0")


def test_cache_check_times_new_and_repeated_images_and_the_caches_answer(live_server):
    from peers.cache import cache_table, run_cache_check

    from support import MODEL

    server = live_server()
    before = httpx.get(f"{server.url}/metrics").text
    check = run_cache_check(server.url, MODEL, (96, 96), rounds=2, requests=3, log=lambda _: None)
    assert len(check.cold_ttft_ms) == len(check.warm_ttft_ms) == 2
    assert check.ratio is not None and check.ratio > 0
    assert check.to_dict()["warm_over_cold"] == check.ratio

    def hits(text: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith("vlmserve_processor_cache_hits")]
        return sum(float(ln.split()[-1]) for ln in lines if "_total" in ln)

    after = httpx.get(f"{server.url}/metrics").text
    assert hits(after) - hits(before) >= 6  # every warm request was a processor-cache hit
    out = io.StringIO()
    Console(file=out, width=140).print(cache_table(check))
    assert "repeated / new" in out.getvalue()


def test_size_medium_builds_the_issue_checkpoint_in_bf16_and_defaults_to_each_servers_dtype(
    tmp_path,
):
    ns = serve.parse_args(["--size", "medium", "--peers-dir", str(tmp_path)])
    cfg = serve.build_config(ns)
    assert (cfg.size, cfg.dtype) == ("medium", "auto")  # each server's own default
    spec = serve.SIZES["medium"]()
    assert (spec.hidden_size, spec.num_hidden_layers, spec.intermediate_size) == (1024, 8, 2816)
    assert spec.torch_dtype == "bfloat16"
    pinned = serve.build_config(serve.parse_args(["--size", "medium", "--dtype", "float32"]))
    assert pinned.dtype == "float32"
    assert serve.build_config(serve.parse_args([])).dtype == "float32"  # tiny: as before
    assert "--dtype" in (argv := serve.plan_specs(cfg, [1, 2])[0].argv)
    assert argv[argv.index("--dtype") + 1] == "auto"


def test_each_measurement_waits_for_idle_cpus_up_to_the_settle_flag(tmp_path, monkeypatch):
    from peers import settle

    assert config(tmp_path).settle == 15.0 and config(tmp_path, "--settle", "0").settle == 0.0
    readings = iter([85.0, 40.0, 3.0, 90.0])  # busy, busy, idle: the wait ends at the idle one
    calls: list[float] = []

    def cpu_percent(interval: float) -> float:
        calls.append(interval)
        return next(readings)

    monkeypatch.setattr(settle.psutil, "cpu_percent", cpu_percent)
    settle.wait_idle(10.0)
    assert len(calls) == 3 and all(i > 0 for i in calls)
    assert settle.wait_idle(0) == 0.0 and len(calls) == 3  # 0: no wait, nothing sampled


def test_the_wait_for_idle_cpus_gives_up_at_its_timeout(monkeypatch):
    from peers import settle

    def busy(interval: float) -> float:
        time.sleep(interval)
        return 100.0

    monkeypatch.setattr(settle.psutil, "cpu_percent", busy)
    waited = settle.wait_idle(0.3, window=0.05)
    assert 0.3 <= waited < 1.0


def test_workload_flag_takes_several_once_each_and_rejects_unknown_ones(tmp_path, capsys):
    cfg = config(tmp_path, "--workload", "long", "photo", "video", "long")
    assert cfg.workloads == ["long", "photo", "video"]
    with pytest.raises(SystemExit):
        config(tmp_path, "--workload", "audio")
    assert "invalid choice: 'audio'" in capsys.readouterr().err
    assert cfg.long_words == 0  # sized by the checkpoint's tokenizer at the start
    assert config(tmp_path, "--long-words", "1500").long_words == 1500
    with pytest.raises(SystemExit, match="--long-words"):
        config(tmp_path, "--long-words", "-1")


def test_summary_and_ratios_are_per_workload_with_itl_p50_and_p99():
    samples = [
        ("vlmserve", 4, report(100.0, 40.0, itl=20.0), "long"),
        ("vllm", 4, report(200.0, 80.0, itl=10.0), "long"),
        ("vlmserve", 4, report(300.0, 40.0, itl=4.0), "short"),
        ("vllm", 4, report(100.0, 80.0, itl=8.0), "short"),
    ]
    rows = tables.summarize(samples)
    assert [(r.workload, r.server) for r in rows] == [
        ("long", "vlmserve"),
        ("long", "vllm"),
        ("short", "vlmserve"),
        ("short", "vllm"),
    ]
    assert (rows[0].itl_p50_ms, rows[0].itl_p99_ms, rows[0].input_tokens) == (20.0, 200.0, 6.25)
    ratios = {r["workload"]: r for r in tables.ratio_rows(rows, "vlmserve", ["vllm"])}
    assert ratios["long"]["output_tps_ratio"] == pytest.approx(0.5)
    assert ratios["long"]["itl_p50_ratio"] == ratios["long"]["itl_p99_ratio"] == 2.0
    assert ratios["short"]["itl_p50_ratio"] == pytest.approx(0.5)
    assert ratios["short"]["tpot_p50_ratio"] == 1.0
    console = Console(record=True, width=200, file=io.StringIO())
    tables.render(console, rows, list(ratios.values()), {"vlmserve": "ok"}, "vlmserve-1seq")
    text = console.export_text()
    assert "ITL p50 ms" in text and "ITL p99 ms" in text and "200.0" in text


def test_rounds_send_new_requests_per_workload_level_and_round_the_same_to_every_server(
    tmp_path, monkeypatch
):
    cfg = config(
        tmp_path,
        "--peer",
        "vllm",
        "--peer",
        "transformers-serve",
        "--rounds",
        "2",
        "--concurrency",
        "1",
        "2",
        "--workload",
        "short",
        "long",
        "--warmup",
        "2",
        "--settle",
        "0",
    )
    cfg.long_words = 40
    specs = serve.plan_specs(cfg, [1, 2, 3, 4])
    sent: list[tuple[str, int, list[dict]]] = []

    class Running:
        def stop(self) -> None:
            pass

    def start(spec, cfg, out, console, workloads=None):
        out.status[spec.name] = "ok"
        for workload in workloads or cfg.workloads:  # as serve.start warms up
            sent.append((spec.name, -1, serve.bodies_for(spec, cfg, workload, ("warmup",), 2)))
        return Running()

    def measure(spec, cfg, bodies, concurrency):
        sent.append((spec.name, concurrency, bodies))
        return report(10.0, 5.0)

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "measure", measure)
    out = serve.run_rounds(specs, cfg, Console(file=io.StringIO()))
    assert {(s.workload, s.concurrency, s.round) for s in out.samples} == {
        (w, c, r) for w in ("short", "long") for c in (1, 2) for r in (0, 1)
    }
    assert len(out.samples) == 8 * len(specs)

    def texts(server: str) -> list[str]:
        return [_text(b) for name, c, bodies in sent if name == server and c > 0 for b in bodies]

    mine = texts("vlmserve")
    assert len(mine) == len(set(mine)) == 2 * 2 * (8 + 8)  # 8 requests a level at least
    assert sorted(texts("vllm")) == sorted(mine)  # the same work for every server
    warm = [_text(b) for name, c, bodies in sent if name == "vlmserve" and c < 0 for b in bodies]
    assert not set(warm) & set(mine)
    vllm = [b for name, _, bodies in sent if name == "vllm" for b in bodies]
    assert all(b["ignore_eos"] and b["model"] == "tiny" for b in vllm)
    hf = [b for name, _, bodies in sent if name == "transformers-serve" for b in bodies]
    assert all("ignore_eos" not in b and b["model"] == cfg.model_dir for b in hf)
    longs = [b for _, _, bodies in sent for b in bodies if isinstance(_content(b), str)]
    assert longs and all(len(_text(b).split()) == 2 + 40 for b in longs)


def _content(body: dict):
    return body["messages"][0]["content"]


def _text(body: dict) -> str:
    content = _content(body)
    return content if isinstance(content, str) else content[-1]["text"]


def test_drive_streams_the_bodies_and_reports_itl(live_server):
    from peers.drive import drive
    from peers.workloads import WORKLOADS, build_bodies

    from support import MODEL

    server = live_server()
    bodies = build_bodies(
        WORKLOADS["short"],
        (0, "measure", 2, 0),
        requests=3,
        model=MODEL,
        max_tokens=5,
        prompt_words=8,
        image=(32, 32),
        ignore_eos=True,
    )
    got = asyncio.run(drive(server.url, bodies, 2)).to_dict()
    assert (got["completed"], got["failed"]) == (3, 0)
    assert got["total_output_tokens"] == 15
    assert got["itl_ms"]["median"] > 0 and got["itl_ms"]["p99"] >= got["itl_ms"]["median"]


def test_one_at_a_time_warms_each_fresh_server_for_its_own_workload_only(tmp_path, monkeypatch):
    cfg = config(
        tmp_path,
        "--no-sequential",
        "--concurrency",
        "1",
        "--rounds",
        "1",
        "--workload",
        "short",
        "photo",
        "--one-at-a-time",
        "--settle",
        "0",
    )
    warmed: list[list[str] | None] = []

    class Running:
        def stop(self) -> None:
            pass

    def start(spec, cfg, out, console, workloads=None):
        out.status[spec.name] = "ok"
        warmed.append(workloads)
        return Running()

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "measure", lambda *args: report(10.0, 5.0))
    serve.run_rounds(serve.plan_specs(cfg, [1]), cfg, Console(file=io.StringIO()))
    assert warmed == [["short"], ["photo"]]
