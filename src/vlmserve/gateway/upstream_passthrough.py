"""Streams of an ``openai`` model passed through as bytes (the gateway's lean path).

When every usable replica of the model is a vlmserve worker (its ``/health`` says
``"resumableStreams": true``), a streamed chat request needs nothing of the gateway's own
session: the worker validates it, runs it as a resumable session of its own, and writes the
OpenAI wire the client asked for. The gateway then forwards the request's bytes to a replica
and the answer's bytes back (``gateway/passthrough.py``), and routes the stream's later requests
(resume, cancel) to the replica that holds it. Replica choice, admission, retries on another
replica before the answer starts, ejection and health are the backend's, as on the full path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from vlmserve.engine.types import ModelState
from vlmserve.errors import ServiceUnavailable
from vlmserve.gateway.pool import Replica, ReplicaPool
from vlmserve.gateway.upstream_http import RETRYABLE, UpstreamAnswer

__all__ = ["PassThrough", "Passage"]


@dataclass(slots=True, eq=False)
class Passage:
    """One passed request's answer (``engine.protocol.PassedAnswer``)."""

    response: UpstreamAnswer
    replica: Replica
    pool: ReplicaPool | None  # None: a later request, outside the pool's accounting
    _closed: bool = False

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self.response.headers

    @property
    def replica_url(self) -> str:
        return self.replica.url

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for data in self.response.chunks():
                yield data
        except RETRYABLE as exc:
            if self.pool is not None:  # counts toward ejecting a replica that keeps breaking
                self.pool.failed(self.replica, f"{type(exc).__name__} mid-answer")
            raise ServiceUnavailable(
                f"upstream {self.replica.url} broke off the answer", code="upstream_error"
            ) from exc

    def close(self, completed: bool) -> None:
        """Let go of the answer and the replica's slot (once; ``completed``: read to its end)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.response.close()
        if self.pool is not None:
            self.pool.give(self.replica)
            if completed:
                self.pool.succeeded(self.replica)
            self.pool.leave()


class PassThrough:
    """``UpstreamBackend``'s side of the pass-through (see the module docstring)."""

    config: Any
    pool: ReplicaPool
    state: ModelState

    def passes_streams(self) -> bool:
        """A chat model that is routing, whose usable replicas all run resumable streams."""
        if self.config.embedding or self.state is not ModelState.READY:
            return False
        now = time.monotonic()
        usable = [r for r in self.pool.replicas if r.usable(now)]
        return bool(usable) and all(r.sessions for r in usable)

    @property
    def upstream_name(self) -> str:
        return str(self.config.model)

    async def pass_stream(self, path: str, content: bytes, headers: Mapping[str, str]) -> Passage:
        """POST ``content`` to ``path`` on a replica chosen as for any request of the model:
        admitted (429 when its queue is full), retried on another replica while none has
        answered 2xx; an upstream 4xx raises as the same error."""
        client = self._require()  # type: ignore[attr-defined]
        self.pool.admit()
        try:
            replica, response = await self._first_success(  # type: ignore[attr-defined]
                set(),
                lambda r: client.open(
                    "POST", r.url + path, content=content, headers=headers, lean=True
                ),
            )
        except BaseException:
            self.pool.leave()
            raise
        return Passage(response, replica, self.pool)

    async def pass_later(
        self,
        replica_url: str,
        method: str,
        path: str,
        content: bytes | None,
        headers: Mapping[str, str],
    ) -> Passage:
        """A stream's later request (resume, cancel) sent to the replica that holds it,
        whatever it answers (a 204 or 404 is the client's answer too)."""
        client = self._require()  # type: ignore[attr-defined]
        try:
            response = await client.open(
                method, replica_url + path, content=content, headers=headers, lean=True
            )
        except RETRYABLE as exc:
            raise ServiceUnavailable(
                f"the replica holding this stream ({replica_url}) cannot be reached: "
                f"{type(exc).__name__}",
                code="upstream_unavailable",
            ) from exc
        return Passage(response, Replica(replica_url), None)
