"""Chunked prefill: a prompt longer than ``max_num_batched_tokens`` is computed in chunks of
that size, one per engine step, while the other rows keep decoding.

Pinned on the real tiny checkpoints: no prefill forward computes more than the budget; a
running stream gets tokens between the chunks of a long prompt; the answer is the one the
whole-prompt prefill gives (Qwen2-VL with an image, Qwen3-VL with its DeepStack features
split across chunks), alone and in a busy batch; a request cancelled in the middle of its
chunks ends cancelled and gives its blocks back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.unit.engine.core.test_batching import make_backend, request, run, wait_for
from tests.unit.engine.models.families.test_families_batched import backend_for

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.types import FinishReason

CHUNK = 48
LONG = "Describe every detail of this picture, its colours, shapes and light. " * 6


class Forwards:
    """Records the runner's forwards in order: ("prefill", tokens) and ("decode", rows); a
    forward that carries both (decode rows riding in a prefill) records both, prefill first."""

    def __init__(self, backend: HFChatBackend) -> None:
        assert backend.engine is not None
        self.log: list[tuple[str, int]] = []
        self.mixed = 0  # forwards that carried both
        runner = backend.engine.runner
        step = runner.step

        def step_(rows: list[Any], decode: Any) -> Any:
            if rows:
                self.log.append(("prefill", sum(r.embeds.shape[0] for r in rows)))
            if decode is not None:
                self.log.append(("decode", len(decode.tokens)))
            self.mixed += bool(rows) and decode is not None
            return step(rows, decode)

        runner.step = step_  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def whole(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8)
    yield b
    b.close()


@pytest.fixture
def chunked(tiny_dir: Path) -> Iterator[HFChatBackend]:
    # each test runs its prompts twice (alone, then batched): cached blocks would skip the chunks
    b = make_backend(tiny_dir, max_num_seqs=8, max_num_batched_tokens=CHUNK, prefix_caching=False)
    yield b
    b.close()


async def test_a_long_prompt_is_computed_in_chunks_with_the_whole_prefills_answer(
    whole: HFChatBackend, chunked: HFChatBackend
) -> None:
    long = request(LONG, image=(112, 112), max_tokens=12)
    prompt = (await run(whole, request(LONG, image=(112, 112), max_tokens=1))).completion_tokens
    forwards = Forwards(chunked)
    got = await run(chunked, long)
    prefills = [n for kind, n in forwards.log if kind == "prefill"]
    assert len(prefills) >= 3 and max(prefills) <= CHUNK, prefills
    assert prompt == 1 and sum(prefills) > 2 * CHUNK
    assert got.tokens == (await run(whole, long)).tokens


async def test_other_rows_decode_between_the_chunks_and_batching_changes_nothing(
    whole: HFChatBackend, chunked: HFChatBackend
) -> None:
    short = [request(f"short {i}", max_tokens=40) for i in range(3)]
    long = request(LONG, image=(112, 112), max_tokens=12)
    alone = [(await run(chunked, r)).tokens for r in [*short, long]]
    assert chunked.engine is not None
    forwards = Forwards(chunked)
    jobs = [asyncio.ensure_future(run(chunked, r)) for r in short]
    await wait_for(lambda: chunked.engine is not None and chunked.engine.gauges.running == 3)
    got = await asyncio.gather(*jobs, run(chunked, long))
    assert [g.tokens for g in got] == alone
    kinds = [kind for kind, n in forwards.log if kind == "decode" or n == CHUNK]
    first, last = kinds.index("prefill"), len(kinds) - 1 - kinds[::-1].index("prefill")
    assert "decode" in kinds[first:last], "the running rows stalled during the long prefill"
    assert max(n for kind, n in forwards.log if kind == "prefill") <= CHUNK
    # the running rows' tokens rode in the chunks' forwards: no separate pass for them
    assert forwards.mixed >= 3, forwards.log


async def test_qwen3_vl_deepstack_features_split_across_chunks() -> None:
    plain = backend_for("qwen3_vl")
    split = backend_for("qwen3_vl", max_num_batched_tokens=16)
    try:
        req = request("Read this card aloud.", image=(112, 112), max_tokens=10)
        forwards = Forwards(split)
        got = await run(split, req)
        assert len([k for k, _ in forwards.log if k == "prefill"]) >= 3
        assert got.tokens == (await run(plain, req)).tokens
    finally:
        plain.close()
        split.close()


async def test_a_request_cancelled_between_its_chunks_ends_cancelled_and_frees_its_blocks(
    chunked: HFChatBackend,
) -> None:
    engine = chunked.engine
    assert engine is not None
    prepared = await chunked.prepare(request(LONG * 3, max_tokens=8))
    chunks: list[Any] = []

    async def consume() -> None:
        async for chunk in chunked.generate(prepared):
            chunks.append(chunk)

    job = asyncio.ensure_future(consume())
    await wait_for(lambda: any(s.prefilled for s in engine.scheduler.running if s.chunk_row))
    seq = next(s for s in engine.scheduler.running if s.chunk_row is not None)
    assert 0 < seq.prefilled < seq.prompt_len  # between two of its chunks
    seq.cancelled = True  # what the consumer's cancel sets; read at the next step
    await asyncio.wait_for(job, 30)
    assert chunks and chunks[-1].finish_reason is FinishReason.CANCELLED
    assert not any(c.token_ids for c in chunks)
    await wait_for(lambda: engine.gauges.running == 0)
    engine.blocks.check([])


def test_the_step_budget_defaults_by_device_as_vllms_api_server() -> None:
    from vlmserve.engine.configs import ChatEngineConfig, batched_tokens

    assert ChatEngineConfig.defaults().max_num_batched_tokens is None
    assert batched_tokens(None, "cpu") == 2048  # a running stream waits ~one 2k prefill
    assert batched_tokens(None, "cuda") == 8192
    assert batched_tokens(300, "cpu") == batched_tokens(300, "cuda") == 300


async def test_by_default_a_cpu_engine_computes_at_most_2048_prompt_tokens_a_step(
    tiny_dir: Path,
) -> None:
    backend = make_backend(tiny_dir, max_num_seqs=4, prefix_caching=False)
    try:
        assert backend.engine is not None and backend.engine.chunk_size == 2048
        forwards = Forwards(backend)
        words = "stone river light " * 400  # ~2.8k prompt tokens on the tiny tokenizer
        result = await run(backend, request(words, max_tokens=2))
        prefills = [n for kind, n in forwards.log if kind == "prefill"]
        assert len(prefills) == 2 and prefills[0] == 2048 and prefills[1] > 0, prefills
        assert result.completion_tokens == 2
    finally:
        backend.close()
