"""``BatchEngine.call``: work run on the engine's thread between two steps (scoring beside a
chat model), on the tiny real Qwen2-VL. It runs at once when the engine is idle, between the
steps of a running generation (not after it), its error goes to its caller alone, and a
failed engine fails the calls still queued."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlmserve.engine.core.faults import EngineFailed
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart


@pytest.fixture
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    b = HFChatBackend("tiny", options, max_model_len=4096, vision_cache_bytes=0)
    b.load()
    assert b.engine is not None
    yield b
    b.close()


def _request(max_tokens: int) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest("r", [ChatMessage("user", [TextPart("hello")])], params)


async def test_a_call_on_an_idle_engine_runs_on_its_thread(backend: HFChatBackend) -> None:
    assert backend.engine is not None
    where = await asyncio.wrap_future(backend.engine.call(threading.current_thread))
    assert where is not threading.current_thread() and where.name.startswith("generate-tiny")


async def test_a_call_runs_between_the_steps_of_a_running_generation(
    backend: HFChatBackend,
) -> None:
    engine = backend.engine
    assert engine is not None
    prepared = await backend.prepare(_request(200))
    stream = backend.generate(prepared)
    await anext(stream)  # the generation is running
    steps = await asyncio.wrap_future(engine.call(lambda: engine.steps))
    produced = [t async for chunk in stream for t in chunk.token_ids]
    assert steps < engine.steps and len(produced) > 10  # it ran while tokens were still due


async def test_a_calls_error_goes_to_its_caller_and_the_engine_serves_on(
    backend: HFChatBackend,
) -> None:
    assert backend.engine is not None

    def broken() -> None:
        raise ValueError("this call's own fault")

    with pytest.raises(ValueError, match="own fault"):
        await asyncio.wrap_future(backend.engine.call(broken))
    prepared = await backend.prepare(_request(3))
    assert len([t async for c in backend.generate(prepared) for t in c.token_ids]) == 3


async def test_a_failed_engine_refuses_calls(backend: HFChatBackend) -> None:
    engine = backend.engine
    assert engine is not None
    engine.declare_stalled(1.0)
    with pytest.raises(EngineFailed):
        engine.call(lambda: None)
