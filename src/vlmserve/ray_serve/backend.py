"""``RayBackend``: the ingress's ``Backend`` for a model that runs in a Ray Serve deployment.

The ingress is an ordinary vlmserve app (``build_app``) whose models are these backends, so
every endpoint, limit, session and error is the one ``vlmserve serve`` has. The backend is a
*local* one to the API (``proxied = False``): media are fetched and decoded here under the
fetch policy, and the decoded ``GenerateRequest`` goes to a model replica through the
deployment handle (Ray routes it to the replica with the fewest requests). That keeps the
engine's request type as the one contract between the two, and it is what lets a stream
survive its replica: the backend knows the token ids already sent, so when the replica dies
mid-stream it sends the same request again with those ids as ``prefix_token_ids`` (what a
restarted server does to continue a stored stream) and the engine goes on after exactly them,
on another replica or on the one Ray starts in the dead one's place.

Why a handle and not HTTP to a vlmserve per replica (``gateway/upstream.py``): Ray Serve does not
give replicas addresses of their own, and a proxied upstream's tokens are its own, so a stream
could not continue after its replica died; through the handle Ray does the routing, the
back-pressure (``max_queued_requests``: a 429) and the replacement of dead replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from vlmserve.engine.choices import merge_choices, open_choices
from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import Chunk, EmbedInput, GenerateRequest, ModelState, Serves
from vlmserve.errors import Overloaded, ServiceUnavailable
from vlmserve.ray_serve.wire import CHUNK, ERROR, READY, decode_error

__all__ = ["RayBackend"]

log = logging.getLogger(__name__)
# A replica that died or cannot be reached: the request may go to another one.
LOST = (
    ray_errors.RayActorError,
    serve_errors.ReplicaUnavailableError,
    serve_errors.DeploymentUnavailableError,
)


@dataclasses.dataclass(slots=True, eq=False)
class RayCall:
    """One request opened on a replica (what ``prepare`` hands to ``generate``)."""

    request: GenerateRequest
    stream: DeploymentResponseGenerator[Any]
    replica: str


class RayBackend(Backend):
    """A model served by a Ray Serve deployment (see the module docstring)."""

    kind = "ray"
    proxied = False

    def __init__(
        self,
        model_id: str,
        handle: DeploymentHandle,
        serves: Serves,
        *,
        reroute_seconds: float = 60.0,
        max_continuations: int = 3,
    ) -> None:
        self.model_id = model_id
        self.handle = handle
        self.serves = serves
        self.state = ModelState.UNLOADED
        self.error: str | None = None
        self.load_seconds: float | None = None
        self.reroute_seconds = reroute_seconds  # how long a request waits for a live replica
        self.max_continuations = max_continuations  # per stream
        self.continued = 0  # streams continued on another replica after theirs died
        self.streaming: Counter[str] = Counter()  # replica id -> streams it serves for us
        self._caps: frozenset[str] | None = None
        self._tokens: dict[int, int] = {}  # id(items) -> prompt tokens of the last embed

    # --- lifecycle: the replicas are Ray's; the ingress only asks one about the model -----
    async def aload(self) -> None:
        self.state, self.error = ModelState.LOADING, None
        started = time.perf_counter()
        try:
            info = await self.handle.info.remote()
        except Exception as exc:
            self.state, self.error = ModelState.FAILED, f"no replica answered: {exc}"
            raise
        caps = info.get("capabilities")
        self._caps = frozenset(caps) if caps is not None else None
        self.load_seconds = time.perf_counter() - started
        self.state = ModelState.READY

    async def aclose(self) -> None:
        self.state = ModelState.UNLOADED

    def close(self) -> None:
        self.state = ModelState.UNLOADED

    def capabilities(self) -> frozenset[str] | None:
        return self._caps if self.state is ModelState.READY else None

    def describe(self) -> dict[str, Any]:
        """``/admin/state``: continued streams, and which replicas this ingress streams from."""
        return {
            "deployment": self.handle.deployment_name,
            "continued": self.continued,
            "streams_by_replica": {r: n for r, n in self.streaming.items() if n > 0},
        }

    # --- generation ------------------------------------------------------------------------
    async def prepare(self, request: GenerateRequest) -> RayCall:
        """Open the request on a replica: its 4xx (template, context length) raise here."""
        return await self._open(request)

    def generate(self, prepared: RayCall) -> AsyncIterator[Chunk]:
        return self._chunks(prepared)

    async def discard(self, prepared: RayCall) -> None:
        prepared.stream.cancel()

    async def _open(self, request: GenerateRequest) -> RayCall:
        """Send ``request`` to a replica and wait for its ``READY``; a lost replica is tried
        again (Ray routes around it, or to its replacement) for ``reroute_seconds``."""
        deadline = time.monotonic() + self.reroute_seconds
        while True:
            stream = self.handle.options(stream=True).generate.remote(request)
            try:
                kind, value = await anext(stream, (None, None))
            except serve_errors.BackPressureError as exc:
                raise Overloaded(
                    f"every replica of {self.model_id!r} is busy and its queue is "
                    f"full ({exc}); retry later",
                    retry_after=1.0,
                ) from exc
            except LOST as exc:
                stream.cancel()
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(
                        f"no replica of {self.model_id!r} answered: {exc}", retry_after=5
                    ) from exc
                log.warning(
                    "%s: replica lost before answering (%s); trying again",
                    self.model_id,
                    type(exc).__name__,
                )
                await asyncio.sleep(0.5)
                continue
            if kind == ERROR:
                raise decode_error(value)
            if kind != READY:
                raise ServiceUnavailable(f"model replica answered {kind!r} first", retry_after=1)
            return RayCall(request, stream, value)

    async def _chunks(self, call: RayCall) -> AsyncIterator[Chunk]:
        prefix = list(call.request.prefix_token_ids)
        sent: dict[int, list[int]] = {}  # token ids each choice has produced so far
        finished: set[int] = set()  # choices that ended
        continuations = 0
        self.streaming[call.replica] += 1
        try:
            while True:
                try:
                    async for kind, value in call.stream:
                        if kind == ERROR:
                            raise decode_error(value)
                        if kind == CHUNK:
                            sent.setdefault(value.index, []).extend(value.token_ids)
                            if value.finish_reason is not None:
                                finished.add(value.index)
                            yield value
                    return
                except LOST as exc:
                    continuations += 1
                    if continuations > self.max_continuations:
                        raise ServiceUnavailable(
                            f"the replica of {self.model_id!r} generating this answer died and "
                            "it cannot be continued; send the request again",
                            retry_after=1,
                        ) from exc
                    log.warning(
                        "%s: replica %s died mid-stream after %d tokens (%s); "
                        "continuing on another replica",
                        self.model_id,
                        call.replica,
                        sum(map(len, sent.values())),
                        type(exc).__name__,
                    )
                    self.continued += 1
                    if _choices(call.request) > 1:
                        async for chunk in self._split(call.request, sent, finished):
                            yield chunk
                        return
                    again = dataclasses.replace(
                        call.request, prefix_token_ids=prefix + sent.get(0, [])
                    )
                    self.streaming[call.replica] -= 1
                    call = await self._open(again)
                    self.streaming[call.replica] += 1
        finally:
            self.streaming[call.replica] -= 1
            call.stream.cancel()  # a no-op once it ended; else the replica stops the sequence

    async def _split(
        self, request: GenerateRequest, sent: dict[int, list[int]], finished: set[int]
    ) -> AsyncIterator[Chunk]:
        """An ``n`` > 1 stream whose replica died: each unfinished choice goes on as a request
        of its own (``n`` = 1, seed + i as choice i samples with, its tokens as the prefix), and
        their chunks come back under the choice's index."""

        async def open_one(i: int) -> RayCall:
            return await self._open(_one_choice(request, i, sent.get(i, [])))

        async def abandon(call: RayCall) -> None:
            call.stream.cancel()

        opened = await open_choices(_choices(request), finished, open_one, abandon)
        async for chunk in merge_choices([(i, self._chunks(call)) for i, call in opened]):
            yield chunk

    # --- embeddings ------------------------------------------------------------------------
    async def embed(self, items: list[EmbedInput]) -> np.ndarray:
        if self.serves is not Serves.EMBEDDING:
            return await super().embed(items)
        kind, value = await self._call(lambda: self.handle.embed.remote(items))
        if kind == ERROR:
            raise decode_error(value)
        vectors, tokens = value
        if len(self._tokens) > 256:  # callers that never asked for the count
            self._tokens.clear()
        self._tokens[id(items)] = tokens
        return vectors

    def count_tokens(self, items: list[EmbedInput]) -> int:
        """The count the replica sent with the vectors of ``items`` (asked right after)."""
        return self._tokens.pop(id(items), 0)

    async def decode_tokens(self, arrays: list[list[int]]) -> list[str]:
        """Token-id inputs: the ingress holds no tokenizer, so a model replica decodes them
        (and checks them against its vocabulary: a 400 from there reaches the client)."""
        if self.serves is not Serves.EMBEDDING:
            return await super().decode_tokens(arrays)
        kind, value = await self._call(lambda: self.handle.decode_tokens.remote(arrays))
        if kind == ERROR:
            raise decode_error(value)
        return list(value)

    async def _call(self, send: Any) -> tuple[str, Any]:
        """One unary call to a replica; a lost replica is tried again (``reroute_seconds``)."""
        deadline = time.monotonic() + self.reroute_seconds
        while True:
            try:
                return tuple(await send())  # type: ignore[return-value]
            except LOST:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


def _choices(request: GenerateRequest) -> int:
    """``n`` of the request: several choices' tokens cannot be continued as one prefix."""
    return int(getattr(request.sampling, "n", 1) or 1)


def _one_choice(request: GenerateRequest, index: int, tokens: list[int]) -> GenerateRequest:
    """Choice ``index`` of ``request`` as a request of its own, continuing after ``tokens``."""
    sampling = dataclasses.replace(request.sampling, n=1, seed=request.sampling.choice_seed(index))
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}-choice{index}",
        sampling=sampling,
        prefix_token_ids=list(tokens),
    )
