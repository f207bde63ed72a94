"""Prefill paced against the running streams' decode (``engine/core/pacing.py``,
``--decode-share``).

The rule alone: a prefill step of S seconds with streams decoding owes them S x share /
(1 - share) seconds of decode-only steps, and until they are done a waiting prompt is held;
never while no stream decodes, never when as many prompts wait as streams decode, never
at share 0. In the engine, on the tiny real Qwen2-VL: a newcomer joining two running
streams waits decode-only steps in proportion to the share (none at 0), its greedy answer
and theirs are the same either way, and one request alone is never held.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tests.unit.engine.core.test_batching import make_backend, request, run, wait_for

from vlmserve.engine.core.pacing import Pacing


def test_a_prefill_step_owes_the_streams_a_share_of_decode_time() -> None:
    pacing = Pacing(1 / 3)  # the streams get a third: half a prefill step's time after it
    assert not pacing.hold(streams=7, pending=1)  # nothing owed yet
    pacing.prefilled(1.0, streams=7)
    assert pacing.owed == pytest.approx(0.5)
    assert pacing.hold(streams=7, pending=1)
    pacing.decoded(0.3)
    assert pacing.hold(streams=7, pending=1)
    pacing.decoded(0.25)
    assert not pacing.hold(streams=7, pending=1)
    assert pacing.holds == 2
    pacing.prefilled(0.2, streams=7)
    pacing.prefilled(0.2, streams=7)  # owed from the last prefill step, not summed
    assert pacing.owed == pytest.approx(0.1)


def test_prompts_are_not_held_without_streams_or_when_as_many_wait() -> None:
    pacing = Pacing(0.5)
    pacing.prefilled(1.0, streams=0)  # nobody was stalled
    assert pacing.owed == 0.0
    pacing.prefilled(1.0, streams=3)
    assert not pacing.hold(streams=3, pending=3)  # as many waiting as decoding
    assert not pacing.hold(streams=3, pending=0)
    assert pacing.hold(streams=3, pending=2)
    assert not pacing.hold(streams=0, pending=2)  # the streams ended: nothing owed
    assert pacing.owed == 0.0
    never = Pacing(0.0)
    never.prefilled(5.0, streams=8)
    assert not never.hold(streams=8, pending=1)


@pytest.mark.parametrize("share", [-0.1, 1.0, 1.5])
def test_a_share_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="decode share"):
        Pacing(share)


async def _newcomer(tiny_dir: Path, share: float) -> tuple[int, list[list[int]]]:
    """A stream decoding, a second joining it (its prefill stalls the first), then a third
    request right after: -> the steps a prompt was held for (counted by the engine), and the
    three greedy answers."""
    backend = make_backend(tiny_dir, max_num_seqs=4, decode_share=share)
    try:
        engine = backend.engine
        assert engine is not None
        tasks = [asyncio.create_task(run(backend, request("Stream one", max_tokens=80)))]
        await wait_for(lambda: len(engine.scheduler.running) == 1 and engine.steps > 2)
        tasks.append(asyncio.create_task(run(backend, request("Stream two", max_tokens=70))))
        await wait_for(lambda: len(engine.scheduler.running) == 2)
        tasks.append(asyncio.create_task(run(backend, request("A newcomer " * 8, max_tokens=8))))
        answers = [o.tokens for o in await asyncio.gather(*tasks)]
        return engine.pacing.holds, answers
    finally:
        backend.close()


async def test_a_newcomer_waits_for_the_streams_in_proportion_to_the_share(
    tiny_dir: Path,
) -> None:
    none, answers = await _newcomer(tiny_dir, 0.0)
    paced, paced_answers = await _newcomer(tiny_dir, 0.9)  # 9 s of decode per prefill second
    assert none == 0
    assert paced >= 3
    assert paced_answers == answers  # the answers do not depend on when a row joined


async def test_one_request_alone_is_never_held(tiny_dir: Path) -> None:
    backend = make_backend(tiny_dir, decode_share=0.9)
    try:
        await run(backend, request("Alone", max_tokens=6))
        await run(backend, request("Alone again", max_tokens=6))
        assert backend.engine is not None and backend.engine.pacing.holds == 0
    finally:
        backend.close()
