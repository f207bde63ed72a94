"""vLLM's own metric names, next to ours: what vLLM's Grafana dashboard, KEDA/HPA examples and
Kubernetes inference routers read.

Names, types, label names and histogram buckets are those of vLLM 0.32's
``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``): every series has the labels
``model_name`` and ``engine`` (one engine per model here: ``"0"``), and
``vllm:request_success_total`` adds ``finished_reason`` with vLLM's values (``stop``,
``length``, ``abort``, ``error``, ``repetition``), each created at 0 for a model on its first
request, as vLLM does. Counters are named without ``_total`` (``prometheus_client`` adds it
on the wire, as in vLLM). ``vllm:time_per_output_token_seconds`` is not here: vLLM renamed it
``vllm:inter_token_latency_seconds`` in 0.11 and removed it in 0.13.

What the values mean here (the engine's phases, ``Chunk.timings``): queue is the wait for
admission; prefill is vLLM's (from admission to the first token, the vision tower included);
decode runs from the first to the last token; time to first token and end-to-end latency run
from the moment the request arrived (media fetch and decode included), as a client sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["FINISHED_REASONS", "VllmSeries", "finished_reason", "token_buckets"]

LABELS = ("model_name", "engine")
ENGINE = "0"
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
_REASONS = {
    "stop": "stop",
    "tool_calls": "stop",
    "length": "length",
    "cancelled": "abort",
    "repetition": "repetition",  # vLLM's repetition_detection
}


def _floats(values: str) -> tuple[float, ...]:
    return tuple(float(v) for v in values.split())


# vLLM's buckets, as its logger lists them
TTFT_BUCKETS = _floats(
    "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 "
    "2.5 5.0 7.5 10.0 20.0 40.0 80.0 160.0 640.0 2560.0"
)
ITL_BUCKETS = _floats(
    "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0"
)
REQUEST_LATENCY_BUCKETS = _floats(
    "0.3 0.5 0.8 1.0 1.5 2.0 2.5 5.0 10.0 15.0 20.0 30.0 "
    "40.0 50.0 60.0 120.0 240.0 480.0 960.0 1920.0 7680.0"
)
N_BUCKETS = (1, 2, 5, 10, 20)
MAX_MODEL_LEN = 131072  # token-count histograms: 1-2-5 buckets up to this (vLLM: max_model_len)


def token_buckets(max_value: int = MAX_MODEL_LEN) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


def finished_reason(reason: str) -> str:
    """vLLM's ``finished_reason`` label for one of our finish reasons (a tool call is the
    model stopping; a cancelled request is vLLM's abort)."""
    return _REASONS.get(reason, "error")


class VllmSeries:
    """Every ``vllm:`` series, on the app's registry; ``Metrics`` calls the methods."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry
        self._children: dict[tuple[Any, ...], Any] = {}
        self._models: set[str] = set()
        self._add_scheduler_series()
        self._add_token_series()
        self._add_latency_series()

    def _make(self, kind: Any, name: str, doc: str, extra: Sequence[str] = (), **kw: Any) -> Any:
        return kind(name, doc, [*LABELS, *extra], registry=self._registry, **kw)

    def _add_scheduler_series(self) -> None:
        make = self._make
        self.running = make(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = make(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = make(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.preemptions = make(
            Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_queries = make(
            Counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = make(
            Counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )

    def _add_token_series(self) -> None:
        make, tokens = self._make, token_buckets()
        self.prompt_tokens = make(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = make(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = make(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["finished_reason"],
        )
        self.request_prompt = make(
            Histogram,
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            buckets=tokens,
        )
        self.request_generation = make(
            Histogram,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            buckets=tokens,
        )
        self.max_generation = make(
            Histogram,
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            buckets=tokens,
        )
        self.params_max_tokens = make(
            Histogram,
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            buckets=tokens,
        )
        self.params_n = make(
            Histogram,
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            buckets=N_BUCKETS,
        )

    def _add_latency_series(self) -> None:
        make = self._make

        def latency(name: str, doc: str) -> Any:
            return make(Histogram, name, doc, buckets=REQUEST_LATENCY_BUCKETS)

        self.ttft = make(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.itl = make(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
        )
        self.request_tpot = make(
            Histogram,
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets=ITL_BUCKETS,
        )
        self.e2e = latency(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self.queue = latency(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self.inference = latency(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        )
        self.prefill = latency(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self.decode = latency(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )

    def _child(self, metric: Any, model: str, *extra: str) -> Any:
        key = (metric, model, *extra)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= 4096:  # label values that keep changing: start over
                self._children.clear()
            child = self._children[key] = metric.labels(model, ENGINE, *extra)
        return child

    def _known(self, model: str) -> None:
        """A model's success counters at 0 for every reason, as vLLM creates them."""
        if model not in self._models:
            self._models.add(model)
            for reason in FINISHED_REASONS:
                self._child(self.success, model, reason)

    # -- engine state, read at scrape time --
    def set_load(self, model: str, running: int, waiting: int, usage: float) -> None:
        self._child(self.running, model).set(running)
        self._child(self.waiting, model).set(waiting)
        self._child(self.kv_usage, model).set(usage)

    def add_totals(self, model: str, preemptions: int, queries: int, hits: int) -> None:
        """Increases of the engine's running totals (``Metrics._add_total`` found them)."""
        for counter, value in (
            (self.preemptions, preemptions),
            (self.prefix_queries, queries),
            (self.prefix_hits, hits),
        ):
            child = self._child(counter, model)
            if value > 0:
                child.inc(value)

    # -- requests --
    def observe_itl(self, model: str, seconds: float, tokens: int) -> None:
        """``tokens`` new tokens arrived ``seconds`` after the previous ones."""
        child = self._child(self.itl, model)
        for _ in range(tokens):
            child.observe(seconds / tokens)

    def observe_request(self, model: str, done: dict[str, Any]) -> None:
        """One finished request (``Metrics.observe_generation``'s ``done``): its tokens,
        finish reason, time to first token and phases (``Chunk.timings``)."""
        self._known(model)
        prompt, output = done["prompt_tokens"], done["output_tokens"]
        self._child(self.prompt_tokens, model).inc(prompt)
        self._child(self.generation_tokens, model).inc(output)
        self._child(self.success, model, finished_reason(done["finish_reason"])).inc()
        self._child(self.request_prompt, model).observe(prompt)
        self._child(self.request_generation, model).observe(output)
        for histogram in (self.max_generation, self.params_max_tokens):
            self._child(histogram, model).observe(done["max_tokens"])
        self._child(self.params_n, model).observe(done["n"])
        self._child(self.ttft, model).observe(done["ttft"])
        t = done["timings"]
        prefill, decode = t["vision"] + t["prefill"], t["decode"]
        self._child(self.e2e, model).observe(t["e2e"])
        self._child(self.queue, model).observe(t["queue"])
        self._child(self.prefill, model).observe(prefill)
        self._child(self.decode, model).observe(decode)
        self._child(self.inference, model).observe(prefill + decode)
        tpot = decode / (output - 1) if output > 1 else 0.0
        self._child(self.request_tpot, model).observe(tpot)
