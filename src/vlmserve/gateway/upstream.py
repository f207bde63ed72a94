"""The ``openai`` backend: a model served by OpenAI-compatible upstreams, proxied chunk by chunk.

``prepare`` opens the upstream stream (so an upstream 4xx reaches the client as the same status
before any byte, and a refused or failing replica is retried on another); ``generate`` turns
the upstream's SSE into ``Chunk``s as they arrive. Closing the generator (cancel, client gone)
closes the upstream response and asks the replica to cancel (vlmserve's ``/v1/cancel``; vLLM
aborts on the disconnect itself). The client's Authorization header is never forwarded: the
upstream gets the entry's own ``api_key``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from vlmserve.engine.protocol import Proxied
from vlmserve.engine.types import Chunk, GenerateRequest, ModelState, Serves
from vlmserve.errors import InvalidRequest, ServiceUnavailable, VlmserveError
from vlmserve.gateway.media_routes import MediaRoutes
from vlmserve.gateway.pool import PoolPolicy, Replica, ReplicaPool
from vlmserve.gateway.upstream_http import RETRYABLE, UpstreamAnswer, UpstreamHTTP
from vlmserve.gateway.upstream_passthrough import PassThrough
from vlmserve.gateway.upstream_wire import (
    ChunkReader,
    UpstreamError,
    announces_sessions,
    encode_body,
    error_from_body,
    json_object,
    upstream_body,
)

__all__ = ["UpstreamBackend", "UpstreamConfig", "UpstreamError", "UpstreamStream"]

log = logging.getLogger(__name__)
# An uncompressed stream: its bytes are read as they come, with no decoder between.
_STREAM_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
_JSON_HEADERS = {"Content-Type": "application/json"}


class _StreamCutShort(Exception):
    """The upstream's stream ended without a finish_reason (retryable before the first chunk)."""


_RETRYABLE: tuple[type[BaseException], ...] = (*RETRYABLE, _StreamCutShort)


@dataclass(slots=True)
class UpstreamConfig:
    model: str  # the upstream's name for the model (the entry's served_model_id)
    base_urls: list[str] = field(default_factory=list)
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    api_key: str | None = None
    health_interval: float = 5.0  # seconds between active checks; 0 = none
    preflight: bool = True  # run vlmserve.client.preflight on each replica before routing
    embedding: bool = False  # an embedding model (/v1/embeddings, /encode-*)
    rerank: bool = False  # a reranker (/v1/rerank, /v1/score)
    chat: bool = False  # with ``rerank``: a chat model that also scores (both roles)
    policy: PoolPolicy = field(default_factory=PoolPolicy)


@dataclass(slots=True, eq=False)
class UpstreamStream:
    """One opened upstream response (what ``prepare`` hands to ``generate``)."""

    body: dict[str, Any]
    replica: Replica
    response: UpstreamAnswer
    tried: set[str] = field(default_factory=set)


class UpstreamBackend(PassThrough, Proxied):
    """A backend whose model lives on upstream replicas (see the module docstring)."""

    kind = "openai"
    proxied = True

    def __init__(self, model_id: str, config: UpstreamConfig):
        self.model_id = model_id
        self.config = config
        self.pool = ReplicaPool(model_id, config.base_urls, config.policy)
        self.media_routes = MediaRoutes()  # media uuid -> the replica that has it
        self.state = ModelState.UNLOADED
        self.error: str | None = None
        self.load_seconds: float | None = None
        self._client: UpstreamHTTP | None = None
        self._health: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def serves(self) -> Serves:  # type: ignore[override]
        if self.config.rerank and not self.config.chat:
            return Serves.RERANK
        return Serves.EMBEDDING if self.config.embedding else Serves.CHAT

    @property
    def also_serves(self) -> frozenset[Serves]:
        chat_and_rerank = self.config.rerank and self.config.chat
        return frozenset({Serves.RERANK}) if chat_and_rerank else frozenset()

    # --- gateway: replicas registered at run time ----------------------------------------
    @property
    def accepts_replicas(self) -> bool:
        return True

    async def add_replica(self, url: str, instance: str) -> dict[str, Any]:
        """Add (or refresh) a replica; it gets traffic once health and preflight pass."""
        replica = self.pool.add(url, instance)
        if self.state is ModelState.READY:
            await self.admit_replica(replica)
        return replica.describe(time.monotonic())

    def remove_replica(self, instance: str) -> bool:
        return self.pool.remove(instance=instance)

    # --- lifecycle -------------------------------------------------------------------------
    async def aload(self) -> None:
        """Start routing: a client, one round of health checks and preflight, the check loop."""
        self.state, self.error = ModelState.LOADING, None
        started = time.perf_counter()
        await self._stop()  # what a failed or dead earlier run left behind
        try:
            await self._start()
        except Exception as exc:
            self.state, self.error = ModelState.FAILED, str(exc)
            await self._stop()
            raise
        self.load_seconds = time.perf_counter() - started
        self.state = ModelState.READY

    async def _start(self) -> None:
        self._client = UpstreamHTTP(
            connect_timeout=self.config.connect_timeout,
            read_timeout=self.config.read_timeout,
            headers=self._auth(),
        )
        await asyncio.gather(*(self.admit_replica(r) for r in list(self.pool.replicas)))
        if self.config.health_interval > 0:
            self._health = asyncio.create_task(self._check_loop())

    async def aclose(self) -> None:
        await self._stop()
        self.state = ModelState.UNLOADED

    async def _stop(self) -> None:
        tasks = [t for t in (self._health, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._health = None
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def close(self) -> None:
        """Synchronous best effort (process shutdown): stop the tasks, drop the client."""
        for task in (self._health, *self._background):
            if task is not None:
                task.cancel()
        client, self._health, self._client = self._client, None, None
        self.state = ModelState.UNLOADED
        if client is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: the process is ending
                closing = asyncio.get_running_loop().create_task(client.aclose())
                self._background.add(closing)  # held until done (a bare task may be collected)
                closing.add_done_callback(self._background.discard)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "upstream_model": self.config.model,
            "replicas": self.pool.describe(),
            "queued": self.pool.admitted,
        }

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def _require(self) -> UpstreamHTTP:
        if self.state is not ModelState.READY or self._client is None:
            msg = f"model {self.model_id!r} is {self.state.value}"
            raise ServiceUnavailable(
                msg + (f": {self.error}" if self.error else "") + "; retry shortly"
            )
        return self._client

    # --- replicas: health and preflight ------------------------------------------------------
    async def admit_replica(self, replica: Replica) -> None:
        """Check a (new) replica before it gets traffic: health, then preflight."""
        await self.check(replica)
        if replica.healthy and self.config.preflight:
            await self._preflight(replica)

    async def check(self, replica: Replica) -> bool:
        """``GET /health`` (2xx), falling back to ``GET /v1/models``."""
        client = self._client
        if client is None:
            return False
        reason = "health check failed"
        for path in ("/health", "/v1/models"):
            try:
                status, body = await client.request(
                    "GET", replica.url + path, timeout=self.config.connect_timeout
                )
            except RETRYABLE as exc:
                reason = f"GET {path}: {type(exc).__name__}"
                break  # unreachable: the fallback would fail the same way
            if 200 <= status < 300:
                replica.sessions = path == "/health" and announces_sessions(body)
                self.pool.checked(replica, True)
                return True
            reason = f"GET {path} answered {status}"
        self.pool.checked(replica, False, reason)
        return False

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await asyncio.gather(
                *(self.check(r) for r in list(self.pool.replicas)), return_exceptions=True
            )

    async def _preflight(self, replica: Replica) -> None:
        try:
            from vlmserve.client.preflight import run_preflight
        except ImportError:
            log.warning(
                "vlmserve.client.preflight is not available; %s not preflighted", replica.url
            )
            return
        try:
            report = await run_preflight(
                replica.url,
                self.config.model,
                api_key=self.config.api_key,
                timeout=self.config.read_timeout,
            )
        except Exception as exc:
            self.pool.preflight(replica, False, f"{type(exc).__name__}: {exc}")
            return
        failing = [c for c in report.checks if c.ok is False]
        reason = f"{failing[0].name}: {failing[0].detail}" if failing else "failed"
        self.pool.preflight(replica, report.ok, None if report.ok else reason)
        if not report.ok:
            log.warning(
                "upstream %s of %s fails preflight (%s); not routing to it",
                replica.url,
                self.model_id,
                reason,
            )

    # --- requests ----------------------------------------------------------------------------
    async def prepare(self, request: GenerateRequest) -> UpstreamStream:
        """Open the upstream stream (4xx passed on; failing replicas retried on others)."""
        if request.raw is None:
            raise InvalidRequest(f"model {self.model_id!r} is proxied; the request body is missing")
        body = upstream_body(request.raw, self.config.model)
        self._require()
        self.pool.admit()
        try:
            stream = await self._open(body, set(), self.media_routes.replica_for(body))
        except BaseException:
            self.pool.leave()
            raise
        self.media_routes.remember(body, stream.replica.url)
        return stream

    async def _open(
        self, body: dict[str, Any], tried: set[str], prefer: str | None = None
    ) -> UpstreamStream:
        client = self._require()

        def send(replica: Replica) -> Awaitable[UpstreamAnswer]:
            url, content = replica.url + "/v1/chat/completions", encode_body(body)
            return client.open("POST", url, content=content, headers=_STREAM_HEADERS, lean=True)

        replica, response = await self._first_success(tried, send, prefer)
        return UpstreamStream(body, replica, response, tried)

    async def _first_success(
        self,
        tried: set[str],
        send: Callable[[Replica], Awaitable[UpstreamAnswer]],
        prefer: str | None = None,
    ) -> tuple[Replica, UpstreamAnswer]:
        """Replicas in turn (``prefer`` first while usable) until one answers 2xx: connection
        errors, 5xx and 429 try the next; a 4xx raises at once; none left raises the last
        error (or 503)."""
        last: VlmserveError | None = None
        while True:
            try:
                replica = await self.pool.take(tried, prefer)
            except ServiceUnavailable:
                raise (last if last is not None else self.pool.unavailable(tried)) from None
            tried.add(replica.url)
            try:
                response = await send(replica)
            except _RETRYABLE as exc:
                self._failed(replica, f"{type(exc).__name__} on connect")
                continue
            except BaseException:
                self.pool.give(replica)
                raise
            if response.is_success:
                return replica, response
            try:
                content = await response.read()
            except _RETRYABLE:
                content = b""
            finally:
                response.close()
            last = self._refused(replica, response.status, content)

    def _failed(self, replica: Replica, reason: str) -> None:
        log.warning("upstream %s failed (%s); trying another replica", replica.url, reason)
        self.pool.failed(replica, reason)
        self.pool.give(replica)

    def _refused(self, replica: Replica, status: int, content: bytes) -> VlmserveError:
        """A non-2xx answer: 4xx raises now (no retry); 5xx and 429 try another replica."""
        error = error_from_body(status, content)
        if status >= 500:
            self._failed(replica, f"status {status}: {error.message[:200]}")
            return ServiceUnavailable(f"upstream failed: {error.message}", code="upstream_error")
        self.pool.give(replica)
        if status == 429:
            return error
        self.pool.succeeded(replica)
        if status in (401, 403):
            raise ServiceUnavailable(
                f"upstream {replica.url} refused the gateway's credentials ({error.message}); "
                "set backend_config.api_key or api_key_env for this model",
                code="upstream_auth",
            )
        raise error

    async def generate(self, prepared: UpstreamStream) -> AsyncIterator[Chunk]:
        """Upstream SSE -> Chunks, as they come. A stream that breaks before its first chunk is
        reopened on another replica; closing this generator closes the upstream stream."""
        held: UpstreamStream | None = prepared
        reader = ChunkReader()
        try:
            while held is not None:
                try:
                    async for data in held.response.chunks():
                        for chunk in reader.feed_bytes(data):
                            yield chunk
                    for chunk in reader.close():
                        yield chunk
                    if not reader.done:
                        raise _StreamCutShort("stream ended without a finish_reason")
                    self.pool.succeeded(held.replica)
                    return
                except _RETRYABLE as exc:
                    if reader.pieces:  # the client has text from this replica: cannot retry
                        self.pool.failed(held.replica, f"{type(exc).__name__} mid-stream")
                        raise ServiceUnavailable(
                            f"upstream {held.replica.url} broke off the stream",
                            code="upstream_error",
                        ) from exc
                    broken, held = held, None
                    await self._release(broken)
                    self._failed(broken.replica, f"{type(exc).__name__} before the first chunk")
                    held = await self._open(broken.body, broken.tried)
                    reader = ChunkReader()
        finally:
            if held is not None:
                await self._release(held)
                self._let_go(held.replica, reader)
            self.pool.leave()

    async def discard(self, prepared: UpstreamStream) -> None:
        """Let go of a prepared stream that will never be generated from (the caller failed
        between ``prepare`` and ``generate``)."""
        await self._release(prepared)
        self.pool.give(prepared.replica)
        self.pool.leave()

    async def _release(self, stream: UpstreamStream) -> None:
        with contextlib.suppress(Exception):
            stream.response.close()

    def _let_go(self, replica: Replica, reader: ChunkReader) -> None:
        self.pool.give(replica)
        if reader.done or not reader.upstream_id or self._client is None:
            return
        task = asyncio.get_running_loop().create_task(self._cancel(replica, reader.upstream_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, replica: Replica, upstream_id: str) -> None:
        """Best effort: vlmserve upstreams keep a stream running after a disconnect (it is
        resumable), so tell them; others (vLLM) answer 404 and have aborted already."""
        client = self._client
        if client is None:
            return
        with contextlib.suppress(*RETRYABLE, VlmserveError):
            await client.request(
                "POST",
                f"{replica.url}/v1/cancel/{upstream_id}",
                timeout=self.config.connect_timeout,
            )

    async def relay(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The same endpoint on one of the replicas, under the upstream's model name."""
        return await self.forward(path, {**body, "model": self.config.model})

    async def forward(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a JSON body to ``path`` on a replica, return its JSON (worker endpoints,
        embeddings). Same retry and error rules as chat, without streaming."""
        client = self._require()
        self.pool.admit()
        try:
            replica, response = await self._first_success(
                set(),
                lambda replica: client.open(
                    "POST", replica.url + path, content=encode_body(body), headers=_JSON_HEADERS
                ),
            )
            try:
                content = await response.read()
            finally:
                response.close()
                self.pool.give(replica)
            self.pool.succeeded(replica)
            return json_object(content, replica.url + path)
        finally:
            self.pool.leave()
