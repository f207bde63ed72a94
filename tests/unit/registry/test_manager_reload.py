"""The model manager after a fatal engine error: the model is reloaded, a bounded number of
times, each attempt logged; when every attempt fails it stays ``failed`` (with the reason)
until someone activates it. Real tiny Qwen2-VL; the faults are one method made to raise."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from support import MODEL, make_settings
from vlmserve.engine.core.faults import EngineFailed
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ModelState,
    SamplingParams,
    Serves,
    TextPart,
)
from vlmserve.registry.manager import ModelManager


def raising(*_: Any) -> Any:
    raise RuntimeError("injected")


async def generate(manager: ModelManager) -> list[int]:
    lease = await manager.acquire(MODEL, "chat", Serves.CHAT)
    try:
        backend = lease.backend
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        req = GenerateRequest("r", [ChatMessage("user", [TextPart("hi")])], params)
        prepared = await backend.prepare(req)
        return [t async for chunk in backend.generate(prepared) for t in chunk.token_ids]
    finally:
        lease.release()


async def until(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def manager(tiny_dir: Path) -> Any:
    manager = ModelManager.from_settings(make_settings(tiny_dir))
    manager.policy.reload_backoff = 0.01
    for handle in manager.handles:
        handle.backend.load()
    yield manager
    manager.close()


async def test_an_engine_failure_reloads_the_model_and_it_serves_again(
    manager: ModelManager, caplog: pytest.LogCaptureFixture
) -> None:
    backend = manager.resolve(MODEL).backend
    assert isinstance(backend, HFChatBackend) and backend.engine is not None
    expected = await generate(manager)
    backend.engine.step = raising  # type: ignore[method-assign]
    caplog.set_level(logging.INFO)
    with pytest.raises(EngineFailed):
        await generate(manager)
    await until(lambda: backend.state is ModelState.READY)
    await until(lambda: not manager.reloader.busy)
    assert await generate(manager) == expected
    assert "reloading (attempt 1 of 3)" in caplog.text
    assert "reloaded after its engine failed" in caplog.text
    assert manager.state()[0]["engine_failures"] == 1


async def test_reloads_stop_after_three_attempts_and_the_model_stays_failed_until_activated(
    manager: ModelManager, caplog: pytest.LogCaptureFixture
) -> None:
    backend = manager.resolve(MODEL).backend
    assert isinstance(backend, HFChatBackend) and backend.engine is not None
    loads: list[int] = []

    def unreadable() -> Any:
        loads.append(1)
        raise OSError("weights unreadable")

    backend._load = unreadable  # type: ignore[method-assign]
    backend.engine.step = raising  # type: ignore[method-assign]
    caplog.set_level(logging.INFO)
    with pytest.raises(EngineFailed):
        await generate(manager)
    await until(lambda: len(loads) == 3 and not manager.reloader.busy)
    await asyncio.sleep(0.1)
    assert len(loads) == 3  # bounded
    assert backend.state is ModelState.FAILED and "weights unreadable" in (backend.error or "")
    assert "reloading (attempt 3 of 3)" in caplog.text
    assert "still failed after 3 reloads" in caplog.text
    del backend._load  # the fault is gone: an activation (POST /admin/activate) loads it
    await manager.activate(MODEL)
    assert backend.state is ModelState.READY
    assert len(await generate(manager)) == 8
