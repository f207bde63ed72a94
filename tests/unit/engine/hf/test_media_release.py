"""A request's decoded media leave memory with its answer, not at the next full collection.

The media budget stops counting a request's images once the engine holds them; the engine
must then let them go when the request ends. Held by a reference cycle, they (and the
processor's pixel tensors) stay until the cyclic GC runs a full collection, which a busy
server does rarely: with the engine in the API process (``--no-engine-process``) a flood of
photos grew its memory far past the budget that way.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.unit.engine.core.test_batching import make_backend, request, run

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.types import GenerateRequest, ImagePart


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    backend = make_backend(tiny_dir)
    asyncio.run(run(backend, request("warm", image=(64, 64), max_tokens=2)))
    yield backend
    backend.close()


def _cyclic_garbage(work: object) -> list[str]:
    """The request objects that ``work`` left for the cyclic GC (gc paused while it runs)."""
    gc.collect()
    gc.disable()
    try:
        asyncio.run(work)  # type: ignore[arg-type]
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
    finally:
        gc.set_debug(0)
        gc.enable()
    left = [type(o).__name__ for o in gc.garbage if isinstance(o, Prepared | GenerateRequest)]
    left += [type(o).__name__ for o in gc.garbage if isinstance(o, ImagePart)]
    gc.garbage.clear()
    return left


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_an_answered_requests_image_is_freed_by_reference_counting(
    backend: HFChatBackend, max_tokens: int
) -> None:
    async def answer() -> None:
        out = await run(backend, request("describe", image=(320, 240), max_tokens=max_tokens))
        assert out.completion_tokens == max_tokens

    assert _cyclic_garbage(answer()) == []


def test_a_cancelled_requests_image_is_freed_by_reference_counting(
    backend: HFChatBackend,
) -> None:
    async def cancel_after_first_token() -> None:
        req: GenerateRequest = request("describe", image=(320, 240), max_tokens=200)
        stream = backend.generate(await backend.prepare(req))
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)  # the engine takes the row out at its next step

    assert _cyclic_garbage(cancel_after_first_token()) == []
