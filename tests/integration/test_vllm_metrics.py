"""``/metrics`` under vLLM's names after a mixed load: every series vLLM 0.32 exports that its
dashboard, autoscalers and routers read, with vLLM's type, labels and buckets, and counters
equal to what the load was answered."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from support import MODEL
from vlmserve.api.metrics_vllm import (
    FINISHED_REASONS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    token_buckets,
)

LABELS = {"model_name", "engine"}
# name -> (type, buckets or None); vLLM 0.32's PrometheusStatLogger
SERIES: dict[str, tuple[str, tuple[float, ...] | None]] = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("histogram", ITL_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("histogram", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_prompt_tokens": ("histogram", tuple(map(float, token_buckets()))),
    "vllm:request_generation_tokens": ("histogram", tuple(map(float, token_buckets()))),
    "vllm:request_max_num_generation_tokens": ("histogram", tuple(map(float, token_buckets()))),
}


def _chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}


async def _streamed(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[dict, str]:
    """A stream's usage and finish reason."""
    usage, finish = None, None
    options = {"include_usage": True}
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": options}
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    finish = choice["finish_reason"] or finish
    assert usage is not None and finish is not None
    return usage, finish


async def _load(client: httpx.AsyncClient) -> tuple[int, int, Counter[str]]:
    """Two ``length`` answers, one streamed ``length``, and ``stop`` ones (the model's end, or
    a stop string taken from a greedy answer); what they were answered."""
    answers: list[tuple[dict, str]] = []
    for body in (_chat(5, ignore_eos=True), _chat(7, ignore_eos=True, temperature=0)):
        out = (await client.post("/v1/chat/completions", json=body)).json()
        answers.append((out["usage"], out["choices"][0]["finish_reason"]))
    answers.append(await _streamed(client, _chat(4, ignore_eos=True)))
    greedy = _chat(24, temperature=0)
    out = (await client.post("/v1/chat/completions", json=greedy)).json()
    answers.append((out["usage"], out["choices"][0]["finish_reason"]))
    text = out["choices"][0]["message"]["content"]
    if out["choices"][0]["finish_reason"] != "stop":  # a stop string from its own answer
        answers.append(await _streamed(client, {**greedy, "stop": [text[-1]]}))
    prompt = sum(u["prompt_tokens"] for u, _ in answers)
    completion = sum(u["completion_tokens"] for u, _ in answers)
    return prompt, completion, Counter(reason for _, reason in answers)


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _check_family(family: Any, kind: str, buckets: tuple[float, ...] | None) -> None:
    assert family.type == kind, family.name
    extra = {"finished_reason"} if family.name == "vllm:request_success" else set()
    for sample in family.samples:
        names = set(sample.labels) - {"le"}
        assert names == LABELS | extra, (sample.name, sample.labels)
        assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    if buckets is not None:
        bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        assert bounds == [*buckets, float("inf")], family.name


async def test_every_vllm_series_is_exported_with_vllms_type_labels_buckets_and_the_load(
    make_client: Any,
) -> None:
    client = await make_client()
    before = _families((await client.get("/metrics")).text)
    prompt, completion, reasons = await _load(client)
    assert reasons["length"] >= 3 and reasons["stop"] >= 1
    families = _families((await client.get("/metrics")).text)
    for name, (kind, buckets) in SERIES.items():
        assert name in families, f"{name} is not exported"
        _check_family(families[name], kind, buckets)

    def total(name: str, family: dict[str, Any], **labels: str) -> float:
        if name not in family:
            return 0.0
        return sum(
            s.value
            for s in family[name].samples
            if s.name == f"{name}_total" and labels.items() <= s.labels.items()
        )

    def grew(name: str, **labels: str) -> float:
        return total(name, families, **labels) - total(name, before, **labels)

    assert grew("vllm:prompt_tokens") == prompt
    assert grew("vllm:generation_tokens") == completion
    for reason in FINISHED_REASONS:
        assert grew("vllm:request_success", finished_reason=reason) == reasons.get(reason, 0)
    finished = sum(reasons.values())
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_decode_time_seconds"):
        counts = {s.name: s.value for s in families[name].samples if s.name.endswith("_count")}
        old = {s.name: s.value for s in before[name].samples} if name in before else {}
        assert counts[f"{name}_count"] - old.get(f"{name}_count", 0) == finished
