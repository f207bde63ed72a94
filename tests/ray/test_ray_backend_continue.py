"""``RayBackend`` continuing streams after their replica died, against a scripted handle.

The fake replica is deterministic the way the engine is: choice i of a request with seed s
emits token ``1000 * (s + i) + position``, and a request with ``prefix_token_ids`` goes on
after them. A replica "dies" (``RayActorError``) after a set number of chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray import exceptions as ray_errors

from vlmserve.engine.choices import merge_choices
from vlmserve.engine.types import (
    Chunk,
    FinishReason,
    GenerateRequest,
    ModelState,
    SamplingParams,
    Serves,
)
from vlmserve.errors import ServiceUnavailable
from vlmserve.ray_serve.backend import RayBackend
from vlmserve.ray_serve.wire import CHUNK, READY

pytestmark = pytest.mark.timeout(30)
MAX_TOKENS = 6


class Stream:
    """One replica's answer: READY, then chunks; dies after ``die_after`` chunks."""

    def __init__(self, request: GenerateRequest, die_after: int | None):
        self.request, self.die_after, self.cancelled = request, die_after, False

    async def _items(self) -> AsyncIterator[tuple[str, Any]]:
        yield READY, "replica-x"
        req, n = self.request, self.request.sampling.n
        seed = req.sampling.seed or 0
        start = len(req.prefix_token_ids)
        sent = 0
        for position in range(start, MAX_TOKENS):
            for i in range(n):
                if self.die_after is not None and sent >= self.die_after:
                    raise ray_errors.RayActorError()
                await asyncio.sleep(0)
                last = position == MAX_TOKENS - 1
                token = 1000 * (seed + i) + position
                yield (
                    CHUNK,
                    Chunk(
                        text=f"<{i}:{position}>",
                        token_ids=[token],
                        finish_reason=FinishReason.LENGTH if last else None,
                        completion_tokens=position + 1,
                        prompt_tokens=5,
                        index=i,
                    ),
                )
                sent += 1

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """``handle.options(stream=True).generate.remote(request)``; the first ``deaths`` streams
    die after ``die_after`` chunks each."""

    deployment_name = "model-fake"

    def __init__(self, die_after: int, deaths: int = 1):
        self.die_after, self.deaths = die_after, deaths
        self.requests: list[GenerateRequest] = []
        self.generate = self

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, request: GenerateRequest) -> Any:
        self.requests.append(request)
        dies = self.die_after if len(self.requests) <= self.deaths else None
        return _Opened(Stream(request, dies))


class _Opened:
    """What ``remote`` gives: an async iterator (the backend reads READY with anext)."""

    def __init__(self, stream: Stream):
        self.stream, self._it = stream, stream._items()

    def __aiter__(self) -> _Opened:
        return self

    async def __anext__(self) -> Any:
        return await self._it.__anext__()

    def cancel(self) -> None:
        self.stream.cancel()


def backend(handle: Handle) -> RayBackend:
    b = RayBackend("fake", handle, Serves.CHAT, reroute_seconds=2)  # type: ignore[arg-type]
    b.state = ModelState.READY
    return b


def request(n: int, seed: int | None) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, n=n, seed=seed, temperature=1.0)
    return GenerateRequest("req-1", [], sampling)


async def answer(b: RayBackend, req: GenerateRequest) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    async for chunk in b.generate(await b.prepare(req)):
        got.setdefault(chunk.index, []).extend(chunk.token_ids)
    return got


@pytest.mark.parametrize("die_after", [0, 1, 3, 7])
async def test_an_n_2_stream_goes_on_choice_by_choice_after_its_replica_died(
    die_after: int,
) -> None:
    reference = await answer(backend(Handle(die_after=10**6, deaths=0)), request(2, seed=7))
    handle = Handle(die_after=die_after)
    b = backend(handle)
    assert await answer(b, request(2, seed=7)) == reference  # every token, once, in order
    assert b.continued == 1
    again = handle.requests[1:]
    assert [r.sampling.n for r in again] == [1, 1]
    assert [r.sampling.seed for r in again] == [7, 8]  # choice i samples with seed + i
    assert len({r.request_id for r in handle.requests}) == 3
    for i, r in enumerate(again):  # each continues after exactly its own tokens
        assert r.prefix_token_ids == reference[i][: len(r.prefix_token_ids)]


async def test_a_finished_choice_is_not_asked_again() -> None:
    handle = Handle(die_after=2 * MAX_TOKENS - 1)  # choice 0 ends, then the replica dies
    b = backend(handle)
    got = await answer(b, request(2, seed=None))
    assert [len(got[0]), len(got[1])] == [MAX_TOKENS, MAX_TOKENS]
    assert [r.request_id for r in handle.requests[1:]] == ["req-1-choice1"]


async def test_one_choice_dying_again_is_continued_again() -> None:
    handle = Handle(die_after=3, deaths=2)  # the n=2 stream, then the first one-choice stream
    b = backend(handle)
    reference = await answer(backend(Handle(die_after=10**6, deaths=0)), request(2, seed=1))
    assert await answer(b, request(2, seed=1)) == reference
    assert b.continued == 2


async def test_too_many_deaths_end_the_stream_with_a_503() -> None:
    handle = Handle(die_after=1, deaths=100)
    b = backend(handle)
    with pytest.raises(ServiceUnavailable, match="cannot be continued"):
        await answer(b, request(1, seed=None))


async def test_merge_raises_the_first_error_and_closes_the_others() -> None:
    closed: list[int] = []

    async def fine() -> AsyncIterator[Chunk]:
        try:
            for k in range(100):
                await asyncio.sleep(0.01)
                yield Chunk(text=str(k), token_ids=[k])
        finally:
            closed.append(0)

    async def broken() -> AsyncIterator[Chunk]:
        yield Chunk(text="x", token_ids=[1])
        raise ServiceUnavailable("gone")

    seen = []
    with pytest.raises(ServiceUnavailable, match="gone"):
        async for chunk in merge_choices([(0, fine()), (1, broken())]):
            seen.append(chunk.index)
    assert 1 in seen and closed == [0]


@pytest.mark.parametrize("die_after", [0, 2])
async def test_a_one_choice_stream_goes_on_after_its_own_tokens(die_after: int) -> None:
    reference = await answer(backend(Handle(die_after=10**6, deaths=0)), request(1, seed=3))
    handle = Handle(die_after=die_after)
    b = backend(handle)
    assert await answer(b, request(1, seed=3)) == reference
    assert handle.requests[1].prefix_token_ids == reference[0][:die_after]
    assert handle.requests[1].sampling.seed == 3 and b.continued == 1
    assert b.describe()["streams_by_replica"] == {}  # every stream counted out again


@pytest.mark.parametrize(("deaths", "ends"), [(3, "complete"), (4, "503")])
async def test_a_stream_is_continued_at_most_max_continuations_times(
    deaths: int, ends: str
) -> None:
    b = backend(Handle(die_after=1, deaths=deaths))
    if ends == "complete":
        assert len((await answer(b, request(1, seed=None)))[0]) == MAX_TOKENS
        return
    with pytest.raises(ServiceUnavailable) as info:
        await answer(b, request(1, seed=None))
    assert info.value.retry_after == 1 and b.describe()["streams_by_replica"] == {}
