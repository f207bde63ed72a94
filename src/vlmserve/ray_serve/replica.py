"""``ModelReplica``: one Ray Serve replica of one model, holding a vlmserve engine.

The engine is built exactly as ``vlmserve serve`` builds it (``registry.build.hf_backend``
from the model's ``[[models]]`` entry and the server settings), so batching, the KV budget,
caches and parsers behave the same. The replica speaks ``ray_serve/wire.py`` to its ingress
through a deployment handle: requests arrive already decoded (the ingress fetched and decoded
the media under its policy), and chunks go back as they are produced.

Ray Serve calls ``check_health`` every few seconds: a failed engine makes the replica
unhealthy, and Ray replaces it (the ingress then continues its streams on another replica).
The same call publishes the engine's load as Ray metrics (``vlmserve_engine_*``, tagged by
Ray with the deployment and replica). On scale-down Ray stops routing to the replica and waits
for its running streams (``graceful_shutdown_timeout_s``, the settings' drain timeout) before
``__del__`` unloads the model.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve import metrics

from vlmserve.config import Settings
from vlmserve.engine.types import EmbedInput, GenerateRequest, ModelState
from vlmserve.errors import ConfigError, VlmserveError
from vlmserve.ray_serve.wire import CHUNK, ERROR, READY, encode_error

__all__ = ["ModelReplica"]

log = logging.getLogger(__name__)
Item = tuple[str, Any]


def _gauges() -> dict[str, metrics.Gauge]:
    return {
        name: metrics.Gauge(f"vlmserve_engine_{name}", description=text, tag_keys=("model",))
        for name, text in (
            ("running", "sequences decoding on this replica"),
            ("waiting", "requests queued on this replica"),
            ("kv_usage", "share of this replica's KV cache in use"),
        )
    }


class ModelReplica:
    """A vlmserve engine for one model (see the module docstring)."""

    async def __init__(self, settings: dict[str, Any], model: str) -> None:
        from vlmserve.registry.build import hf_backend

        self.settings = Settings.model_validate(settings)
        configs = {c.served_name: c for c in self.settings.model_configs()}
        if model not in configs:
            raise ConfigError(f"model {model!r} is not in the settings' [[models]]")
        self.model = model
        self.backend = hf_backend(configs[model], self.settings)
        await self.backend.aload()  # a failure raises: Ray retries the replica elsewhere
        if self.backend.state is not ModelState.READY:
            raise RuntimeError(f"model {model!r} did not load: {self.backend.error}")
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.gauges = _gauges()
        for gauge in self.gauges.values():
            gauge.set_default_tags({"model": model})

    def info(self) -> dict[str, Any]:
        """What the ingress needs to know about the model (once, when it starts)."""
        caps = self.backend.capabilities()
        return {
            "replica": self.replica,
            "serves": self.backend.serves.value,
            "capabilities": sorted(caps) if caps is not None else None,
            "load_seconds": self.backend.load_seconds,
        }

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Item]:
        """Prepare (``READY`` or ``ERROR`` first), then stream the chunks. Ray cancels this
        generator when the ingress closes its end (cancel, client gone): the engine's
        sequence stops at its next step."""
        try:
            release = self.backend.admit()
        except VlmserveError as exc:
            yield ERROR, encode_error(exc)
            return
        try:
            prepared = await self.backend.prepare(request)
        except VlmserveError as exc:
            release()
            yield ERROR, encode_error(exc)
            return
        except BaseException:
            release()
            raise
        async for item in self._run(prepared, release):
            yield item

    async def _run(self, prepared: Any, release: Any) -> AsyncIterator[Item]:
        chunks = None
        try:
            yield READY, self.replica
            chunks = self.backend.generate(prepared)
            release()  # the engine takes the request at the first step below
            async for chunk in chunks:
                yield CHUNK, chunk
        except VlmserveError as exc:
            yield ERROR, encode_error(exc)
        finally:
            release()
            if chunks is None:
                await self.backend.discard(prepared)
            else:
                await chunks.aclose()  # type: ignore[attr-defined]

    async def embed(self, items: list[EmbedInput]) -> Item:
        """``("vectors", (array, prompt tokens))`` or ``("error", ...)``."""
        try:
            vectors = await self.backend.embed(items)
            return "vectors", (vectors, self.backend.count_tokens(items))
        except VlmserveError as exc:
            return ERROR, encode_error(exc)

    async def decode_tokens(self, arrays: list[list[int]]) -> Item:
        """``("texts", [...])``: token-id inputs as text, checked against the vocabulary."""
        try:
            return "texts", await self.backend.decode_tokens(arrays)
        except VlmserveError as exc:
            return ERROR, encode_error(exc)

    def check_health(self) -> None:
        """Ray's health check: unhealthy once the engine failed (Ray replaces the replica)."""
        if self.backend.state is not ModelState.READY:
            raise RuntimeError(
                f"model {self.model!r} is {self.backend.state.value}: {self.backend.error}"
            )
        stats = self.backend.stats()
        self.gauges["running"].set(float(stats.running or 0))
        self.gauges["waiting"].set(float(stats.waiting or 0))
        self.gauges["kv_usage"].set(float(stats.kv_usage))

    async def __del__(self) -> None:
        """Scale-down or shutdown: Ray drained the requests first; free the model."""
        backend = getattr(self, "backend", None)
        if backend is not None:
            await backend.aclose()
