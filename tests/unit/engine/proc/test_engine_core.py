"""The engine process's side of a request (``EngineCore``): it starts generating once the
request is prepared, holds the chunks until the API process asks for them (``generate``), and
stops the generation on ``discard`` or ``cancel``. Pinned with a backend whose chunks the
test releases one by one, so what was sent when is exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from vlmserve.engine.proc.core import EngineCore
from vlmserve.engine.proc.wire import decode_error
from vlmserve.engine.types import (
    ChatMessage,
    Chunk,
    GenerateRequest,
    SamplingParams,
    TextPart,
)


class Backend:
    """``prepare`` refuses the id "bad" and waits for ``preparing`` on "slow"; ``generate``
    yields a chunk per ``step`` set (for "fails", one chunk, then an error)."""

    def __init__(self) -> None:
        self.step = asyncio.Event()
        self.preparing = asyncio.Event()
        self.generating: list[str] = []
        self.stopped: list[str] = []
        self.discarded: list[str] = []

    async def prepare(self, request: GenerateRequest) -> str:
        if request.request_id == "bad":
            raise ValueError("bad request")
        if request.request_id == "slow":
            await self.preparing.wait()
        return request.request_id

    async def generate(self, prepared: str) -> AsyncIterator[Chunk]:
        self.generating.append(prepared)
        try:
            for i in range(2):
                await self.step.wait()
                self.step.clear()
                yield Chunk(text=f"{prepared}{i}", token_ids=[i])
                if prepared == "fails":
                    raise RuntimeError("the model broke")
        except asyncio.CancelledError:
            self.stopped.append(prepared)
            raise

    async def discard(self, prepared: str) -> None:
        self.discarded.append(prepared)


class Conn:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, batch: list[Any]) -> None:
        self.sent.extend(batch)

    def kinds(self, rid: int) -> list[str]:
        return [m[0] for m in self.sent if m[1] == rid]


def text(rid: str) -> GenerateRequest:
    message = ChatMessage(role="user", content=[TextPart(text="hi")])
    return GenerateRequest(request_id=rid, messages=[message], sampling=SamplingParams())


def idle(engine: EngineCore) -> bool:
    """Nothing of any request is left (its prepare, chunks, task or prepared input)."""
    return not (engine.preparing or engine.held or engine.tasks or engine.prepared)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def prepared(engine: EngineCore, backend: Backend, rid: int, name: str, steps: int) -> None:
    """Prepare the request ``name`` as ``rid``, then let its generation take ``steps`` steps."""
    engine._handle(("prepare", rid, text(name)))
    await settle()
    for _ in range(steps):
        backend.step.set()
        await settle()


@pytest.fixture
async def core() -> tuple[EngineCore, Backend, Conn]:
    conn = Conn()
    engine = EngineCore(conn, Backend)  # type: ignore[arg-type]
    engine.loop = asyncio.get_running_loop()
    engine.backend = Backend()  # type: ignore[assignment]
    return engine, engine.backend, conn  # type: ignore[return-value]


async def test_chunks_made_before_generate_are_held_then_sent_in_order(core: Any) -> None:
    engine, backend, conn = core
    engine._handle(("prepare", 1, text("a")))
    await settle()
    assert conn.kinds(1) == ["done"]  # answered, and started with nobody reading
    assert backend.generating == ["a"]
    backend.step.set()
    await settle()
    assert conn.kinds(1) == ["done"]  # its first chunk is held
    engine._handle(("generate", 1))
    await settle()
    assert conn.kinds(1) == ["done", "chunk"]
    backend.step.set()
    await settle()
    assert conn.kinds(1) == ["done", "chunk", "chunk", "end"]
    texts = [m[2].text for m in conn.sent if m[0] == "chunk"]
    assert texts == ["a0", "a1"]
    assert idle(engine)


async def test_a_failed_prepare_answers_its_error_and_starts_nothing(core: Any) -> None:
    engine, backend, conn = core
    engine._handle(("prepare", 2, text("bad")))
    await settle()
    [(kind, rid, error)] = conn.sent
    assert (kind, rid) == ("error", 2)
    assert "bad request" in str(decode_error(error))
    assert backend.generating == [] and not engine.tasks and not engine.held


async def test_generate_for_a_request_never_prepared_is_an_error_not_a_hang(core: Any) -> None:
    engine, _, conn = core
    engine._handle(("generate", 9))
    await settle()
    [(kind, rid, error)] = conn.sent
    assert (kind, rid) == ("error", 9)
    assert "not prepared" in str(decode_error(error))


@pytest.mark.parametrize("how", ["discard", "cancel"])
async def test_discard_or_cancel_of_a_started_request_stops_it_unsent(core: Any, how: str) -> None:
    engine, backend, conn = core
    await prepared(engine, backend, 3, "c", steps=1)
    engine._handle((how, 3))
    await settle()
    assert backend.stopped == ["c"]
    assert "chunk" not in conn.kinds(3)  # the held chunk never went out
    assert idle(engine)


async def test_a_request_cancelled_before_its_first_step_is_discarded_in_the_backend(
    core: Any,
) -> None:
    engine, backend, _ = core
    engine._handle(("prepare", 4, text("d")))
    await asyncio.sleep(0)  # prepared and answered; its generate task has not run yet
    assert 4 in engine.prepared and 4 in engine.tasks and backend.generating == []
    engine._handle(("cancel", 4))
    await settle()
    assert backend.discarded == ["d"] and backend.generating == []
    assert idle(engine)


async def test_an_error_after_a_chunk_is_held_behind_it_and_sent_in_order(core: Any) -> None:
    engine, backend, conn = core
    await prepared(engine, backend, 5, "fails", steps=1)
    assert conn.kinds(5) == ["done"]
    engine._handle(("generate", 5))
    await settle()
    assert conn.kinds(5) == ["done", "chunk", "error"]
    assert "the model broke" in str(decode_error(conn.sent[-1][2]))
    assert idle(engine)


async def test_a_discard_during_the_prepare_waits_for_it_and_starts_nothing_unsent(
    core: Any,
) -> None:
    engine, backend, conn = core
    engine._handle(("prepare", 6, text("slow")))
    await settle()
    engine._handle(("discard", 6))  # the API process gave up waiting for the prepare
    await settle()
    assert 6 in engine.preparing
    backend.preparing.set()
    backend.step.set()
    await settle()
    assert backend.stopped == ["slow"] or backend.discarded == ["slow"]
    assert "chunk" not in conn.kinds(6)
    assert idle(engine)


async def test_a_cancel_for_a_request_that_already_ended_is_ignored(core: Any) -> None:
    engine, backend, conn = core
    await prepared(engine, backend, 7, "g", steps=0)
    engine._handle(("generate", 7))
    for _ in range(2):
        await settle()
        backend.step.set()
    await settle()
    assert conn.kinds(7)[-1] == "end"
    sent = len(conn.sent)
    engine._handle(("cancel", 7))
    engine._handle(("cancel", 99))
    await settle()
    assert len(conn.sent) == sent and idle(engine)


async def test_a_request_that_ended_before_it_was_asked_for_sends_it_all_then(core: Any) -> None:
    engine, backend, conn = core
    await prepared(engine, backend, 8, "h", steps=2)
    assert conn.kinds(8) == ["done"] and 8 not in engine.tasks  # ended, all of it held
    engine._handle(("generate", 8))
    await settle()
    assert conn.kinds(8) == ["done", "chunk", "chunk", "end"]
    assert idle(engine)
