"""`vlmserve loadtest` (a real process) against `vlmserve serve` (a real worker process).

The acceptance check: what the load tester reports (request count, input and output tokens)
is exactly what the worker's own Prometheus counters saw.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import ServerProcess, free_port, vlmserve_cmd
from vlmserve.client.loadtest import LoadConfig, run_load

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def counters(url: str) -> dict[tuple[str, str], float]:
    """``(metric name, labels text) -> value`` for every sample of the worker's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for match in re.finditer(r"^(\w+)(?:\{(.*)\})? (\S+)$", text, re.MULTILINE):
        out[(match[1], match[2] or "")] = float(match[3])
    return out


def chat_requests(samples: dict, status: str) -> float:
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "vlmserve_requests_total"
        and f'route="{CHAT}"' in labels
        and f'status="{status}"' in labels
    )


def tokens(samples: dict, kind: str) -> float:
    return samples.get((f"vlmserve_{kind}_tokens_total", 'model="tiny"'), 0.0)


def loadtest(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*vlmserve_cmd(), "loadtest", *args], capture_output=True, text=True, timeout=timeout
    )


def test_report_matches_what_the_worker_counted(worker: ServerProcess, tmp_path: Path) -> None:
    before = counters(worker.url)
    out = tmp_path / "report.json"
    run = loadtest(
        worker.url,
        "--model",
        "tiny",
        "--requests",
        "12",
        "--concurrency",
        "4",
        "--max-tokens",
        "6",
        "--image",
        "64x64",
        "--prompt-words",
        "8",
        "--slo-ttft-ms",
        "60000",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for label in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2E latency (ms)", "request throughput"):
        assert label in run.stdout
    report = json.loads(out.read_text())
    after = counters(worker.url)
    assert report["requests"] == report["completed"] == 12 and report["errors"] == {}
    assert chat_requests(after, "200") - chat_requests(before, "200") == 12
    assert report["total_input_tokens"] == tokens(after, "prompt") - tokens(before, "prompt")
    assert report["total_output_tokens"] == tokens(after, "output") - tokens(before, "output")
    assert report["total_output_tokens"] == 12 * 6  # ignore_eos: exactly max_tokens each
    assert report["total_input_tokens"] > 12 * 8  # prompt words + image tokens + template
    assert report["usage_missing"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[key]
        assert 0 < stats["median"] <= stats["p90"] <= stats["p99"]
    assert report["e2e_ms"]["mean"] > report["ttft_ms"]["mean"]
    assert report["goodput"] == pytest.approx(report["request_throughput"])  # generous SLO
    assert report["request_throughput"] == pytest.approx(12 / report["duration_s"])


async def test_http_errors_are_counted_not_fatal(worker: ServerProcess) -> None:
    cfg = LoadConfig(worker.url, "no-such-model", concurrency=2, requests=3, max_tokens=2)
    report = await run_load(cfg)
    assert report.completed == 0 and report.errors == {"404": 3}
    assert "no-such-model" in report.error_examples["404"]


async def test_video_payloads_stream_through(worker: ServerProcess) -> None:
    seen: list[tuple[int, int]] = []
    cfg = LoadConfig(
        worker.url,
        "tiny",
        concurrency=2,
        requests=2,
        max_tokens=3,
        video_frames=4,
        prompt_words=4,
        distinct_media=True,
        rate=50.0,
    )
    report = await run_load(cfg, progress=lambda done, total: seen.append((done, total)))
    assert report.completed == 2, report.error_examples
    assert report.total_output_tokens == 6
    assert seen[0] == (0, 2) and seen[-1] == (2, 2)


def test_a_refused_connection_is_a_clear_error_and_exit_1() -> None:
    run = loadtest(f"http://127.0.0.1:{free_port()}", "--model", "tiny", "--requests", "2")
    assert run.returncode == 1
    assert "cannot connect" in run.stderr and "Traceback" not in run.stderr
