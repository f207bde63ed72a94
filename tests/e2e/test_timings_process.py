"""Per-request timings on a real server (``--per-request-metrics``): the phases of a request of
300 ms or more add up to what its client measured, within 10%, non-streamed and streamed;
the official ``openai`` client parses answers that carry them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from support import ServerProcess
from vlmserve.testing.media import data_url, gradient_image, image_bytes

pytestmark = pytest.mark.slow
PHASES = ("media_ms", "queue_time_ms", "time_to_first_token_ms", "generation_time_ms")
PROMPT = "Describe the picture and the sea behind it, in many words. " * 20


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[ServerProcess]:
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]
    server = ServerProcess([*args, "--per-request-metrics"], engine_process=True)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _messages() -> list[dict[str, Any]]:
    image = gradient_image(96, 96)
    png = data_url(image_bytes(image.width, image.height), "image/png")
    content = [{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": PROMPT}]
    return [{"role": "user", "content": content}]


def _body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": _messages(),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def _json(client: httpx.Client, max_tokens: int) -> tuple[float, dict[str, Any], httpx.Response]:
    started = time.perf_counter()
    r = client.post("/v1/chat/completions", json=_body(max_tokens))
    took = time.perf_counter() - started
    assert r.status_code == 200, r.text
    return took, r.json()["metrics"], r


def _streamed(client: httpx.Client, max_tokens: int) -> tuple[float, dict[str, Any]]:
    body = _body(max_tokens, stream=True, stream_options={"include_usage": True})
    metrics = None
    started = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                metrics = json.loads(line[6:]).get("metrics") or metrics
    took = time.perf_counter() - started
    assert metrics is not None
    return took, metrics


def _sized(measure: Any, client: httpx.Client) -> int:
    """max_tokens for a request of at least 300 ms here."""
    for max_tokens in (48, 192, 768):
        took, *_ = measure(client, max_tokens)
        if took >= 0.3:
            return max_tokens
    pytest.fail("no request took 300 ms")


@pytest.mark.parametrize("measure", [_json, _streamed], ids=["json", "stream"])
def test_the_phases_add_up_to_what_the_client_measured(served: ServerProcess, measure: Any) -> None:
    client = httpx.Client(base_url=served.url, timeout=120)  # one connection, made once
    measure(client, 4)  # the first request's lazy work is not what this measures
    max_tokens = _sized(measure, client)
    errors = []
    for _ in range(3):  # the median of three: one request may be held up by a busy machine
        took, metrics, *_ = measure(client, max_tokens)
        phases = sum(metrics[name] for name in PHASES) / 1000
        errors.append(abs(phases - took) / took)
        assert metrics["vision_ms"] + metrics["prefill_ms"] == pytest.approx(
            metrics["time_to_first_token_ms"], abs=0.01
        )
        assert metrics["media_ms"] > 0 and metrics["vision_ms"] > 0
        assert metrics["e2e_ms"] <= took * 1000 and phases * 1000 <= metrics["e2e_ms"] + 0.01
        assert metrics["mean_itl_ms"] > 0 and metrics["tokens_per_second"] > 0
    client.close()
    assert sorted(errors)[1] <= 0.10, errors


def test_a_json_answer_has_a_server_timing_header(served: ServerProcess) -> None:
    with httpx.Client(base_url=served.url, timeout=120) as client:
        _, metrics, response = _json(client, 4)
    entries = dict(
        part.strip().split(";dur=") for part in response.headers["server-timing"].split(",")
    )
    assert set(entries) == {"media", "queue", "vision", "prefill", "decode", "e2e"}
    assert float(entries["prefill"]) == pytest.approx(metrics["prefill_ms"], abs=0.1)


def test_openai_python_parses_answers_with_metrics(served: ServerProcess) -> None:
    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    params: dict[str, Any] = {"model": "tiny", "messages": _messages(), "max_tokens": 5}
    answer = client.chat.completions.create(**params)
    assert answer.choices[0].message.content is not None
    assert (answer.model_extra or {})["metrics"]["generation_time_ms"] >= 0
    stream = client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    last = list(stream)[-1]
    assert last.usage is not None and (last.model_extra or {})["metrics"]["e2e_ms"] > 0
    off = client.chat.completions.create(**params, extra_body={"include_metrics": False})
    assert "metrics" not in (off.model_extra or {})
