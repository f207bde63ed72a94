"""Faults in the batching engine, on the tiny real Qwen2-VL: one engine method made to raise.

Pinned: an error that belongs to one request ends that request alone (``RequestFailed``) and
the others produce exactly what they produce undisturbed; an error that leaves the engine
unusable ends every request in flight, waiting or queued with ``EngineFailed`` within
seconds (never a hang), marks the model failed, and the engine refuses new work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vlmserve.engine.core.engine import BatchEngine
from vlmserve.engine.core.faults import EngineFailed, OutOfMemory, RequestFailed, out_of_memory
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.lifecycle import ModelState
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart
from vlmserve.errors import ServiceUnavailable

FAST = 5.0  # seconds: a fault must end the requests well within this


@pytest.fixture
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    """A fresh model per test: a fatal fault leaves its engine unusable."""
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    b = HFChatBackend(
        "tiny",
        options,
        max_model_len=4096,
        max_queued=64,
        max_num_seqs=3,
        vision_cache_bytes=0,
        processor_cache_bytes=0,
    )
    b.load()
    assert b.engine is not None
    yield b
    b.close()


def request(text: str, max_tokens: int = 16, **sampling: Any) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return GenerateRequest(text, [ChatMessage("user", [TextPart(text)])], params)


async def tokens(backend: HFChatBackend, req: GenerateRequest) -> list[int]:
    prepared = await backend.prepare(req)
    return [t async for chunk in backend.generate(prepared) for t in chunk.token_ids]


async def outcomes(backend: HFChatBackend, reqs: list[GenerateRequest]) -> list[Any]:
    """Each request's tokens or the exception it ended with, all run concurrently."""
    jobs = [tokens(backend, r) for r in reqs]
    return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), FAST * 4)


def engine_of(backend: HFChatBackend) -> BatchEngine:
    assert backend.engine is not None
    return backend.engine


async def until_running(engine: BatchEngine, rows: int, queued: int = 0) -> None:
    """Wait until ``rows`` rows decode together and ``queued`` more wait inside the engine
    (submitted, so a fault reaches them rather than the state check a later submit meets)."""
    deadline = time.monotonic() + 30
    while not (
        engine.gauges.running == rows and engine.gauges.queued == queued and engine.steps > 2
    ):
        assert time.monotonic() < deadline, "the rows never ran together"
        await asyncio.sleep(0.005)


def is_poison(items: list[Any]) -> bool:
    """Whether a POISON row is among a forward's items (rows, or (row, prompt) pairs)."""
    seqs = [item[0] if isinstance(item, tuple) else item for item in items]
    return any(s.prepared.request.request_id.startswith("POISON") for s in seqs)


def poison_decode(engine: BatchEngine) -> None:
    """Every forward that decodes a POISON row raises (also when that row runs alone), in a
    decode step or riding in a prefill forward."""
    decode, prefill = engine._decode_forward, engine._prefill_forward

    def poisoned(seqs: list[Any]) -> list[int]:
        if is_poison(seqs):
            raise RuntimeError("poison")
        return decode(seqs)

    def poisoned_ride(items: list[Any]) -> list[int]:
        if is_poison([item for item in items if not isinstance(item, tuple)]):
            raise RuntimeError("poison")
        return prefill(items)

    engine._decode_forward = poisoned  # type: ignore[method-assign]
    engine._prefill_forward = poisoned_ride  # type: ignore[method-assign]


# --- one request's error: that request alone ---------------------------------------------------
async def test_a_request_whose_decode_always_fails_fails_alone(backend: HFChatBackend) -> None:
    engine = engine_of(backend)
    reqs = [request(f"companion {i}", max_tokens=12 + i) for i in range(4)]
    alone = [await tokens(backend, r) for r in reqs]
    poison_decode(engine)
    got = await outcomes(backend, [*reqs[:2], request("POISON here"), *reqs[2:]])
    assert isinstance(got[2], RequestFailed) and got[2].status_code == 500
    assert [got[0], got[1], got[3], got[4]] == alone  # greedy: the same tokens as undisturbed
    assert backend.state is ModelState.READY and engine.failure is None


async def test_a_request_whose_prefill_always_fails_fails_alone(backend: HFChatBackend) -> None:
    engine = engine_of(backend)
    reqs = [request(f"other {i}") for i in range(3)]
    alone = [await tokens(backend, r) for r in reqs]
    prefill = engine._prefill_forward

    def poisoned(items: list[Any]) -> list[int]:
        if is_poison(items):
            raise MemoryError("this prompt alone does not fit")
        return prefill(items)

    engine._prefill_forward = poisoned  # type: ignore[method-assign]
    got = await outcomes(backend, [reqs[0], request("POISON"), reqs[1], reqs[2]])
    assert isinstance(got[1], RequestFailed)
    assert [got[0], got[2], got[3]] == alone
    assert engine.failure is None


async def test_an_input_that_fails_to_embed_fails_alone(backend: HFChatBackend) -> None:
    engine = engine_of(backend)
    build = engine.embedder.build

    def broken(inputs: Any, slot: int) -> Any:
        if inputs["input_ids"].shape[1] > 30:  # the long prompt only
            raise ValueError("cannot embed this input")
        return build(inputs, slot)

    engine.embedder.build = broken  # type: ignore[method-assign]
    got = await outcomes(backend, [request("short"), request("long " * 40)])
    assert isinstance(got[0], list) and len(got[0]) == 16
    assert isinstance(got[1], RequestFailed)


async def test_a_transient_batch_failure_is_retried_row_by_row_without_losing_a_token(
    backend: HFChatBackend,
) -> None:
    engine = engine_of(backend)
    reqs = [request(f"row {i}", max_tokens=20) for i in range(3)]
    alone = [await tokens(backend, r) for r in reqs]
    decode, failures = engine._decode_forward, []

    def flaky(seqs: list[Any]) -> list[int]:
        if len(seqs) > 1 and engine.steps % 5 == 3:  # some batched steps fail (an OOM, say)
            failures.append(engine.steps)
            raise RuntimeError("out of memory for the batch")
        return decode(seqs)

    engine._decode_forward = flaky  # type: ignore[method-assign]
    assert await outcomes(backend, reqs) == alone
    assert failures


async def test_a_sampled_token_outside_the_vocabulary_fails_its_row_before_the_embedding(
    backend: HFChatBackend,
) -> None:
    engine = engine_of(backend)
    sample = engine.sampler.sample

    def out_of_range(logits: Any, seqs: list[Any]) -> list[int]:
        picked = sample(logits, seqs)
        return [engine.vocab if is_poison([s]) else t for s, t in zip(seqs, picked, strict=True)]

    engine.sampler.sample = out_of_range  # type: ignore[method-assign]
    got = await outcomes(backend, [request("fine"), request("POISON")])
    assert len(got[0]) == 16
    assert isinstance(got[1], RequestFailed)
    assert engine.failure is None


# --- running out of memory: a 503 for the request, never a dead engine ---------------------------
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes"


async def test_a_request_out_of_memory_even_alone_gets_a_503_and_the_others_go_on(
    backend: HFChatBackend,
) -> None:
    engine = engine_of(backend)
    reqs = [request(f"companion {i}", max_tokens=12 + i) for i in range(3)]
    alone = [await tokens(backend, r) for r in reqs]
    decode = engine._decode_forward

    def short(seqs: list[Any]) -> list[int]:
        if is_poison(seqs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return decode(seqs)

    engine._decode_forward = short  # type: ignore[method-assign]
    got = await outcomes(backend, [reqs[0], request("POISON big"), *reqs[1:]])
    assert isinstance(got[1], OutOfMemory), got[1]
    assert got[1].status_code == 503 and got[1].code == "out_of_memory"
    assert got[1].retry_after == 5 and "OutOfMemoryError" in got[1].message
    assert [got[0], got[2], got[3]] == alone
    assert backend.state is ModelState.READY and engine.failure is None


@pytest.mark.parametrize("phase", ["decode", "prefill", "embed"])
async def test_every_row_out_of_memory_alone_is_no_engine_failure(
    backend: HFChatBackend, phase: str
) -> None:
    """Unlike any other error (test below), every row of a batch failing alone for memory
    says the memory is short, not that the engine is broken: each gets its 503, the engine
    and the model stay up and serve the next request."""
    engine = engine_of(backend)
    after = await tokens(backend, request("after", max_tokens=8))
    short = {"on": True}

    def starved(original: Any) -> Any:
        def run(*args: Any) -> Any:
            if short["on"]:
                raise RuntimeError(CPU_OOM)  # what the CPU allocator raises
            return original(*args)

        return run

    target = {"decode": "_decode_forward", "prefill": "_prefill_forward"}.get(phase)
    if target is None:
        engine.embedder.build = starved(engine.embedder.build)  # type: ignore[method-assign]
    else:
        setattr(engine, target, starved(getattr(engine, target)))
    got = await outcomes(backend, [request(f"r{i}", max_tokens=8) for i in range(3)])
    assert all(isinstance(g, OutOfMemory) for g in got), got
    assert backend.state is ModelState.READY and engine.failure is None
    short["on"] = False
    assert await tokens(backend, request("after", max_tokens=8)) == after


def test_what_counts_as_out_of_memory() -> None:
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert out_of_memory(RuntimeError(CPU_OOM))
    assert not out_of_memory(RuntimeError("shape mismatch"))
    assert not out_of_memory(MemoryError("KV cache: 3 blocks needed, 0 free"))


# --- fatal errors: everyone, at once ------------------------------------------------------------
def raising(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected")


@pytest.mark.parametrize("method", ["step", "lifecycle.take_inbox", "_flush", "_reap_cancelled"])
async def test_an_error_outside_a_forward_ends_every_request_within_seconds(
    backend: HFChatBackend, method: str
) -> None:
    engine = engine_of(backend)
    reqs = [request(f"r{i}", max_tokens=200) for i in range(6)]  # 3 run, 3 wait
    jobs = asyncio.gather(*(tokens(backend, r) for r in reqs), return_exceptions=True)
    await until_running(engine, 3, queued=3)
    part, _, name = method.rpartition(".")
    setattr(getattr(engine, part) if part else engine, name, raising)
    injected = time.monotonic()
    got = await asyncio.wait_for(jobs, FAST)
    assert time.monotonic() - injected < FAST
    assert all(isinstance(g, EngineFailed) for g in got), got
    assert got[0].status_code == 503 and got[0].code == "engine_failed"
    assert backend.state is ModelState.FAILED
    assert backend.error == "engine failed: RuntimeError: injected"
    with pytest.raises(ServiceUnavailable):  # refused at once, not queued behind a dead loop
        await tokens(backend, request("after"))


async def test_a_lone_request_whose_decode_fails_fails_alone_not_the_engine(
    backend: HFChatBackend,
) -> None:
    engine = engine_of(backend)
    poison_decode(engine)
    got = await outcomes(backend, [request("POISON alone")])
    assert isinstance(got[0], RequestFailed)
    assert backend.state is ModelState.READY and engine.failure is None
    assert len(await tokens(backend, request("after", max_tokens=4))) == 4


@pytest.mark.parametrize("rows", [2, 3])
async def test_every_row_failing_alone_is_the_engines_fault_not_the_requests(
    backend: HFChatBackend, rows: int
) -> None:
    engine = engine_of(backend)
    jobs = asyncio.gather(
        *(tokens(backend, request(f"r{i}", 300)) for i in range(rows)), return_exceptions=True
    )
    await until_running(engine, rows)
    engine._decode_forward = raising  # type: ignore[method-assign]
    got = await asyncio.wait_for(jobs, FAST)
    assert all(isinstance(g, EngineFailed) for g in got), got
    assert backend.state is ModelState.FAILED


async def test_a_scheduler_that_admits_nothing_fails_fast_instead_of_spinning(
    backend: HFChatBackend,
) -> None:
    engine = engine_of(backend)
    engine.scheduler.schedule = lambda used=0: []  # type: ignore[method-assign]  # nobody, ever
    got = await outcomes(backend, [request("stuck")])
    assert isinstance(got[0], EngineFailed)
    assert "admitted none" in (backend.error or "")


async def test_a_broken_slot_invariant_is_fatal(backend: HFChatBackend) -> None:
    engine = engine_of(backend)
    schedule = engine.scheduler.schedule

    def misplaced(used: int = 0) -> list[Any]:
        admitted = schedule(used)
        for seq in admitted:
            seq.slot += 1  # rows no longer dense: the KV cache would mix requests up
        return admitted

    engine.scheduler.schedule = misplaced  # type: ignore[method-assign]
    got = await outcomes(backend, [request("x"), request("y")])
    # The first admission breaks the engine; the second request either was inside it
    # (EngineFailed) or arrived after and was refused by the failed model: a 503 either way.
    assert any(isinstance(g, EngineFailed) for g in got), got
    assert all(isinstance(g, ServiceUnavailable) and g.status_code == 503 for g in got), got
    assert "EngineStateError" in (backend.error or "")


async def test_a_loop_cancelled_by_an_executor_shutdown_ends_its_requests(
    backend: HFChatBackend,
) -> None:
    release = threading.Event()
    backend._executor.submit(release.wait)  # the model's thread is busy
    job = asyncio.ensure_future(tokens(backend, request("queued behind")))
    await asyncio.sleep(0.05)  # the engine loop is queued on the executor
    backend._executor.shutdown(wait=False, cancel_futures=True)
    try:
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(job, FAST)
    finally:
        release.set()


async def test_the_owner_is_told_once_with_an_event_loop_to_reload_on(
    backend: HFChatBackend,
) -> None:
    told: list[Any] = []
    backend.on_engine_failure = told.append
    engine = engine_of(backend)
    engine.step = raising  # type: ignore[method-assign]
    await outcomes(backend, [request("a"), request("b")])
    assert told == [asyncio.get_running_loop()]
    assert backend.engine_failures == 1
    assert backend.last_engine_error == "RuntimeError: injected"


async def test_closing_the_model_ends_queued_requests_without_a_reload(
    backend: HFChatBackend,
) -> None:
    told: list[Any] = []
    backend.on_engine_failure = told.append
    jobs = asyncio.gather(
        *(tokens(backend, request(f"r{i}", 300)) for i in range(5)), return_exceptions=True
    )
    await asyncio.sleep(0.2)
    backend.close()
    got = await asyncio.wait_for(jobs, FAST)
    assert all(isinstance(g, ServiceUnavailable | list) for g in got), got
    assert told == []


async def test_closing_right_after_a_stream_stopped_is_quiet(
    backend: HFChatBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream closed a moment before the model is: its row is still in the engine when the
    engine is freed; that ends it as an unload, not as an engine failure."""
    told: list[Any] = []
    backend.on_engine_failure = told.append
    stream = backend.generate(await backend.prepare(request("stopped", 2000)))
    async for _ in stream:
        break
    await stream.aclose()  # the row leaves at the engine's next step
    with caplog.at_level(logging.ERROR):
        await backend.aclose()
        await asyncio.sleep(0.3)  # the loop's end, on the model's thread
    assert told == [] and backend.engine_failures == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_client_error_found_in_the_engine_stays_a_client_error(
    backend: HFChatBackend,
) -> None:
    from vlmserve.errors import InvalidRequest

    req = request("resume me")
    req.response_format = {"type": "json_object"}
    req.prefix_token_ids = backend.processor.tokenizer.encode("not json")  # the grammar refuses
    req.sampling.max_tokens = 20
    got = await outcomes(backend, [req, request("bystander")])
    assert isinstance(got[0], InvalidRequest) and got[0].status_code == 400
    assert "resumed tokens" in got[0].message
    assert len(got[1]) == 16
