"""Prometheus metrics: one private registry per app, a pure-ASGI request counter, ``/metrics``.

No global registry: every ``Metrics()`` owns a ``CollectorRegistry``, so tests (and one process
embedding several apps) never see each other's numbers or hit "Duplicated timeseries".

Labels stay low-cardinality on purpose: requests are counted by ROUTE TEMPLATE
(``/v1/streams/{session_id}``), never by concrete path; unknown paths are ``"unmatched"``. The
middleware cannot know which model served a request, so an endpoint tags it with
``request.state.model = name`` (that is ``scope["state"]["model"]``); untagged requests get ``""``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.exposition import generate_latest
from starlette.responses import Response

from vlmserve.api.metrics_http import MetricsMiddleware
from vlmserve.api.metrics_vllm import VllmSeries

__all__ = ["MODEL_STATES", "Metrics", "MetricsMiddleware", "metrics_endpoint"]

MODEL_STATES = ("unloaded", "loading", "ready", "unloading", "failed")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_TPS_BUCKETS = (1.0, 5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 150.0, 250.0, 500.0, 1000.0)
_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_MAX_CHILDREN = 4096  # remembered label children (``Metrics._child``)


class Metrics:
    """Every series vlmserve exports, on its own registry; the methods are the only writers."""

    def __init__(self, namespace: str = "vlmserve"):
        self.registry = CollectorRegistry(auto_describe=True)
        self._namespace = namespace
        self._states_seen: dict[str, set[str]] = {}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._add_request_series()
        self._add_generation_series()
        self._add_model_and_media_series()

    def _make(self, kind: Any, name: str, doc: str, labels: Sequence[str] = (), **kw: Any) -> Any:
        return kind(name, doc, labels, namespace=self._namespace, registry=self.registry, **kw)

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)`` (label values in the metric's order), remembered: the
        series every request touches skip ``prometheus_client``'s checks and lock. Bounded:
        a process whose label values keep changing starts over at ``_MAX_CHILDREN``."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= _MAX_CHILDREN:
                self._children.clear()
            child = self._children[key] = metric.labels(*values)
        return child

    def _add_request_series(self) -> None:
        make = self._make
        self.requests = make(Counter, "requests", "HTTP requests", ["route", "model", "status"])
        self.requests_in_flight = make(
            Gauge, "requests_in_flight", "HTTP requests being served", ["route"]
        )
        self.request_duration = make(
            Histogram,
            "request_duration_seconds",
            "HTTP request wall time, streaming included",
            ["route"],
            buckets=_DURATION_BUCKETS,
        )
        self.queue_depth = make(
            Gauge, "queue_depth", "requests waiting for the engine (not yet decoding)", ["model"]
        )
        self.running = make(Gauge, "num_requests_running", "requests decoding", ["model"])
        self.waiting = make(
            Gauge, "num_requests_waiting", "requests admitted, not yet decoding", ["model"]
        )
        self.cache_usage = make(
            Gauge, "kv_cache_usage_ratio", "share of the KV cache blocks in use", ["model"]
        )
        self.preemptions = make(
            Counter,
            "num_preemptions",
            "rows preempted when the KV cache ran out (recomputed)",
            ["model"],
        )
        self.kv_cache_bytes = make(
            Gauge, "kv_cache_bytes", "memory allocated for the KV cache (the budget)", ["model"]
        )
        self.prefix_queries = make(
            Counter,
            "prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            ["model"],
        )
        self.prefix_hits = make(
            Counter,
            "prefix_cache_hits",
            "prompt tokens whose K/V came from the prefix cache",
            ["model"],
        )
        self._seen: dict[tuple[str, str], int] = {}  # running totals read at the last scrape
        self.vllm = VllmSeries(self.registry)  # the same figures under vLLM's names

    def _add_generation_series(self) -> None:
        make = self._make
        self.ttft = make(
            Histogram,
            "time_to_first_token_seconds",
            "time to first token",
            ["model"],
            buckets=_TTFT_BUCKETS,
        )
        self.tpot = make(
            Histogram,
            "time_per_output_token_seconds",
            "decode time per token after the first",
            ["model"],
            buckets=_TPOT_BUCKETS,
        )
        self.tokens_per_second = make(
            Histogram,
            "generation_tokens_per_second",
            "output tokens per second of a request",
            ["model"],
            buckets=_TPS_BUCKETS,
        )
        self.prompt_tokens = make(Counter, "prompt_tokens", "prompt tokens processed", ["model"])
        self.output_tokens = make(Counter, "output_tokens", "tokens generated", ["model"])

    def _add_model_and_media_series(self) -> None:
        make = self._make
        self.model_state = make(
            Gauge, "model_state", "1 for the model's current state, else 0", ["model", "state"]
        )
        self.model_load_seconds = make(
            Gauge, "model_load_seconds", "how long the last load took", ["model"]
        )
        self.media_bytes = make(Counter, "media_bytes", "media bytes read", ["kind"])
        self.media_frames = make(Counter, "media_frames", "video frames decoded")
        self._add_media_pipeline_series()
        self.media_uuid = make(
            Counter, "media_uuid", "media parts by uuid: kept (stored), reused (hit)", ["result"]
        )
        self.vision_cache_hits = make(
            Counter,
            "vision_cache_hits",
            "images/videos whose vision-tower output was cached",
            ["model"],
        )
        self.vision_cache_misses = make(
            Counter, "vision_cache_misses", "images/videos run through the vision tower", ["model"]
        )
        self.vision_cache_bytes = make(
            Gauge, "vision_cache_bytes", "bytes held by the vision-tower cache", ["model"]
        )
        self.processor_cache_hits = make(
            Counter,
            "processor_cache_hits",
            "images whose preprocessed pixels were cached",
            ["model"],
        )
        self.processor_cache_misses = make(
            Counter, "processor_cache_misses", "images run through the image processor", ["model"]
        )
        self.processor_cache_bytes = make(
            Gauge, "processor_cache_bytes", "bytes held by the image-processor cache", ["model"]
        )
        self._cache_seen: dict[tuple[str, str], tuple[int, int]] = {}
        self._add_engine_series()

    def _add_media_pipeline_series(self) -> None:
        make = self._make
        self.media_items = make(Counter, "media_items", "images and videos decoded", ["kind"])
        self.media_seconds = make(
            Histogram,
            "media_preprocess_seconds",
            "seconds to read and decode one image or video",
            ["kind"],
            buckets=_DURATION_BUCKETS,
        )
        self.media_queue_depth = make(
            Gauge, "media_queue_depth", "requests waiting for media memory (VLMSERVE_MEDIA_MEMORY)"
        )
        self.media_decodes = make(
            Gauge, "media_decodes_in_flight", "reads and decodes queued or running in workers"
        )
        self.media_in_flight = make(
            Gauge, "media_bytes_in_flight", "media bytes held by requests not yet at the engine"
        )

    def watch_media(
        self, waiting: Callable[[], int], decodes: Callable[[], int], held: Callable[[], int]
    ) -> None:
        """The media pipeline's gauges, read at scrape time."""
        self.media_queue_depth.set_function(waiting)
        self.media_decodes.set_function(decodes)
        self.media_in_flight.set_function(held)

    def _add_engine_series(self) -> None:
        """The engine's figures: where step time goes, what memory is held."""
        make = self._make
        self.step_seconds = make(
            Counter,
            "engine_step_seconds",
            "engine step time by phase: vision (vision tower and "
            "prompt embedding), prefill, decode (forward + sampling)",
            ["model", "phase"],
        )
        self.weights_bytes = make(
            Gauge, "model_weights_bytes", "memory held by the model's weights", ["model"]
        )
        self.device_memory_bytes = make(
            Gauge,
            "device_memory_bytes",
            "accelerator memory allocated by torch (0 on CPU)",
            ["model"],
        )
        self.engine_process_rss = make(
            Gauge,
            "engine_process_resident_memory_bytes",
            "resident memory of the model's engine process (process_resident_memory_bytes is "
            "the API process's)",
            ["model"],
        )
        self._steps_seen: dict[tuple[str, str], float] = {}
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds

    # -- requests (the middleware calls these) --
    def request_started(self, route: str) -> None:
        self._child(self.requests_in_flight, route).inc()

    def request_finished(
        self, route: str, in_flight_route: str, model: str, status: int, seconds: float
    ) -> None:
        self._child(self.requests_in_flight, in_flight_route).dec()
        self._child(self.requests, route, model, str(status)).inc()
        self._child(self.request_duration, route).observe(seconds)

    # -- engine side --
    def set_load(self, model: str, *, running: int, waiting: int, usage: float) -> None:
        """A model's requests decoding and waiting, and its cache usage (read at scrape time)."""
        self.queue_depth.labels(model=model).set(waiting)
        for gauge, value in ((self.running, running), (self.waiting, waiting)):
            gauge.labels(model=model).set(value)
        self.cache_usage.labels(model=model).set(usage)
        self.vllm.set_load(model, running, waiting, usage)

    def set_kv_cache(
        self, model: str, *, preemptions: int, nbytes: int, prefix: tuple[int, int] = (0, 0)
    ) -> None:
        """The engine's running totals of preemptions and of prefix-cache (queried, hit)
        tokens, and its KV cache size."""
        self.vllm.add_totals(
            model,
            self._add_total("preemptions", model, preemptions),
            self._add_total("prefix_queries", model, prefix[0]),
            self._add_total("prefix_hits", model, prefix[1]),
        )
        self.kv_cache_bytes.labels(model=model).set(nbytes)

    def _add_total(self, counter: str, model: str, total: int) -> int:
        """The counter attribute ``counter`` fed from an engine's running total: only
        increases are added (a reloaded engine starts again from 0); the increase."""
        key = (counter, model)
        seen = self._seen.get(key, 0)
        self._seen[key] = total
        if total <= seen:
            return 0
        getattr(self, counter).labels(model=model).inc(total - seen)
        return total - seen

    def set_engine(
        self,
        model: str,
        *,
        step_seconds: dict[str, float],
        weights_bytes: int,
        device_memory_bytes: int,
        process_rss_bytes: int = 0,
    ) -> None:
        """The engine's running step-time totals (counters: only increases are added) and
        the memory its model (and its engine process, if it has one) holds."""
        for phase, total in step_seconds.items():
            seen = self._steps_seen.get((model, phase), 0.0)
            if total > seen:
                self.step_seconds.labels(model=model, phase=phase).inc(total - seen)
            self._steps_seen[(model, phase)] = total
        self.weights_bytes.labels(model=model).set(weights_bytes)
        self.device_memory_bytes.labels(model=model).set(device_memory_bytes)
        if process_rss_bytes:
            self.engine_process_rss.labels(model=model).set(process_rss_bytes)

    def observe_ttft(self, model: str, seconds: float) -> None:
        self._child(self.ttft, model).observe(seconds)

    def observe_time_per_output_token(self, model: str, seconds: float) -> None:
        self._child(self.tpot, model).observe(seconds)

    def observe_tokens(self, model: str, *, prompt: int = 0, output: int = 0) -> None:
        if prompt:
            self._child(self.prompt_tokens, model).inc(prompt)
        if output:
            self._child(self.output_tokens, model).inc(output)

    def observe_generation(
        self, model: str, *, prompt_tokens: int, output_tokens: int, ttft: float, total: float
    ) -> None:
        """One finished generation: token counts, TTFT, tokens/s and time per output token."""
        self.observe_tokens(model, prompt=prompt_tokens, output=output_tokens)
        self.observe_ttft(model, ttft)
        if output_tokens > 0 and total > 0:
            self._child(self.tokens_per_second, model).observe(output_tokens / total)
        decode = total - ttft
        if output_tokens > 1 and decode >= 0:
            self.observe_time_per_output_token(model, decode / (output_tokens - 1))

    def observe_finished(self, model: str, done: dict[str, Any]) -> None:
        """One finished request under vLLM's names (``VllmSeries.observe_request``)."""
        self.vllm.observe_request(model, done)

    def observe_inter_token(self, model: str, seconds: float, tokens: int) -> None:
        self.vllm.observe_itl(model, seconds, tokens)

    # -- model lifecycle --
    def set_model_state(self, model: str, state: str | Enum) -> None:
        """Set ``state`` to 1 and every other state this model can be in to 0."""
        name = str(state.value if isinstance(state, Enum) else state)
        seen = self._states_seen.setdefault(model, set(MODEL_STATES))
        seen.add(name)
        for other in seen:
            self.model_state.labels(model=model, state=other).set(1 if other == name else 0)

    def set_model_load_seconds(self, model: str, seconds: float) -> None:
        self.model_load_seconds.labels(model=model).set(seconds)

    # -- media and caches --
    def observe_media(self, kind: str, nbytes: int, frames: int = 0) -> None:
        self.media_bytes.labels(kind=kind).inc(nbytes)
        self._child(self.media_items, kind).inc()
        if frames:
            self.media_frames.inc(frames)

    def observe_media_seconds(self, kind: str, seconds: float) -> None:
        self._child(self.media_seconds, kind).observe(seconds)

    def observe_media_uuid(self, result: str) -> None:
        self.media_uuid.labels(result=result).inc()

    def set_vision_cache(self, model: str, stats: dict[str, int]) -> None:
        """Read the engine's cumulative cache counters (at scrape time) into the series."""
        series = (self.vision_cache_hits, self.vision_cache_misses, self.vision_cache_bytes)
        self._set_cache("vision", series, model, stats)

    def set_processor_cache(self, model: str, stats: dict[str, int]) -> None:
        series = (
            self.processor_cache_hits,
            self.processor_cache_misses,
            self.processor_cache_bytes,
        )
        self._set_cache("processor", series, model, stats)

    def _set_cache(
        self, cache: str, series: tuple[Any, Any, Any], model: str, stats: dict[str, int]
    ) -> None:
        hits_c, misses_c, bytes_g = series
        hits, misses = stats.get("hits", 0), stats.get("misses", 0)
        seen_hits, seen_misses = self._cache_seen.get((cache, model), (0, 0))
        if hits < seen_hits or misses < seen_misses:  # the model was reloaded: new counters
            seen_hits = seen_misses = 0
        hits_c.labels(model=model).inc(hits - seen_hits)
        misses_c.labels(model=model).inc(misses - seen_misses)
        bytes_g.labels(model=model).set(stats.get("bytes", 0))
        self._cache_seen[(cache, model)] = (hits, misses)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_endpoint(metrics: Metrics) -> Response:
    """The ``/metrics`` response: Prometheus text exposition of this app's registry only."""
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
