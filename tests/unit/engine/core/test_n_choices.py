"""``n`` > 1 on the batched engine: one prefill, the other choices forked from a copy of the
prompt's KV blocks, choice i sampled with seed + i — so each choice equals the single request
with that seed; and on the ``model.generate`` fallback, the same choices one after another."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.unit.engine.core.test_batching import make_backend, request, wait_for
from tests.unit.engine.core.test_penalties import fallback  # noqa: F401  (fixture: the internvl generate path)

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.types import FinishReason, GenerateRequest


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8)
    yield b
    b.close()


async def choices(backend: HFChatBackend, req: GenerateRequest) -> dict[int, Any]:
    """index -> {"tokens", "finish", "completion"} of each choice."""
    out: dict[int, Any] = defaultdict(lambda: {"tokens": [], "finish": None, "completion": 0})
    async for chunk in backend.generate(await backend.prepare(req)):
        entry = out[chunk.index]
        entry["tokens"] += chunk.token_ids
        entry["completion"] = chunk.completion_tokens
        entry["finish"] = chunk.finish_reason or entry["finish"]
    return dict(out)


async def single(backend: HFChatBackend, seed: int, **kw: Any) -> list[int]:
    got = await choices(backend, request("Tell a story", seed=seed, **kw))
    return got[0]["tokens"]


SAMPLED = {"temperature": 1.0, "max_tokens": 16}


async def test_each_choice_equals_the_single_request_with_seed_plus_index(
    backend: HFChatBackend,
) -> None:
    engine = backend.engine
    assert engine is not None
    before = (engine.prefilled_rows, engine.forked_rows)
    got = await choices(backend, request("Tell a story", seed=100, n=3, **SAMPLED))
    assert (engine.prefilled_rows - before[0], engine.forked_rows - before[1]) == (1, 2)
    assert sorted(got) == [0, 1, 2]
    for i in range(3):
        assert got[i]["tokens"] == await single(backend, 100 + i, **SAMPLED)
        assert got[i]["finish"] is FinishReason.LENGTH and got[i]["completion"] == 16
    assert len({tuple(c["tokens"]) for c in got.values()}) == 3  # really different samples


async def test_choices_with_an_image_prompt_share_its_prefill(backend: HFChatBackend) -> None:
    req = request("Describe", image=(64, 48), seed=7, n=2, **SAMPLED)
    got = await choices(backend, req)
    for i in range(2):
        alone = await choices(backend, request("Describe", image=(64, 48), seed=7 + i, **SAMPLED))
        assert got[i]["tokens"] == alone[0]["tokens"]


async def test_more_choices_than_free_rows_queue_and_still_match(tiny_dir: Path) -> None:
    narrow = make_backend(tiny_dir, max_num_seqs=2)
    try:
        got = await choices(narrow, request("Tell a story", seed=100, n=3, **SAMPLED))
        assert narrow.engine is not None and narrow.engine.forked_rows == 1  # 1 forked, 1 queued
        for i in range(3):
            assert got[i]["tokens"] == await single(narrow, 100 + i, **SAMPLED)
    finally:
        narrow.close()


async def test_each_choice_has_its_own_finish_reason(backend: HFChatBackend) -> None:
    baseline = await single(backend, 3, **SAMPLED)
    stop = backend._require().processor.tokenizer.decode(baseline[4:6])
    got = await choices(backend, request("Tell a story", seed=3, n=2, stop=[stop], **SAMPLED))
    assert got[0]["finish"] is FinishReason.STOP and got[0]["completion"] <= 6
    assert got[1]["tokens"] == await single(backend, 4, stop=[stop], **SAMPLED)


async def test_closing_the_stream_ends_every_choice(backend: HFChatBackend) -> None:
    engine = backend.engine
    assert engine is not None
    req = request("Tell a story", seed=1, n=4, temperature=1.0, max_tokens=400)
    stream = backend.generate(await backend.prepare(req))
    await anext(stream)
    await wait_for(lambda: engine.gauges.running == 4)
    await stream.aclose()
    await wait_for(lambda: engine.gauges.running == 0 and engine.gauges.queued == 0)


async def test_greedy_choices_with_logprobs_each_carry_their_own(backend: HFChatBackend) -> None:
    req = request("Hi", n=2, max_tokens=5, logprobs=True, top_logprobs=1)
    seen: dict[int, int] = defaultdict(int)
    async for chunk in backend.generate(await backend.prepare(req)):
        seen[chunk.index] += len(chunk.logprobs or [])
    assert seen == {0: 5, 1: 5}


async def test_concurrent_n_requests_do_not_mix_their_choices(backend: HFChatBackend) -> None:
    reqs = [request("Tell a story", seed=s, n=2, **SAMPLED) for s in (10, 20)]
    together = await asyncio.gather(*(choices(backend, r) for r in reqs))
    for s, got in zip((10, 20), together, strict=True):
        assert [got[0]["tokens"], got[1]["tokens"]] == [
            await single(backend, s, **SAMPLED),
            await single(backend, s + 1, **SAMPLED),
        ]


async def test_the_generate_fallback_runs_the_choices_with_the_same_seeds(
    fallback: HFChatBackend,  # noqa: F811
) -> None:
    got = await choices(fallback, request("Tell a story", seed=5, n=2, **SAMPLED))
    for i in range(2):
        assert got[i]["tokens"] == await single(fallback, 5 + i, **SAMPLED)
    assert got[0]["tokens"] != got[1]["tokens"]


async def test_forked_choices_survive_preemption_with_the_same_tokens(tiny_dir: Path) -> None:
    """A KV budget too small for all 4 choices at full length: rows are preempted and
    recomputed, and each choice still equals its single seeded request."""
    block = 16 * 1024  # the tiny float32 checkpoint's block bytes (docs/engine.md)
    small = make_backend(tiny_dir, max_num_seqs=8, kv_cache_bytes=12 * block)
    try:
        engine = small.engine
        assert engine is not None and engine.blocks.usable == 11
        kw = {"temperature": 1.0, "max_tokens": 40}
        got = await choices(small, request("Tell a story", seed=9, n=4, **kw))
        assert engine.gauges.preemptions > 0
        for i in range(4):
            assert got[i]["tokens"] == await single(small, 9 + i, **kw)
        engine.blocks.check(s.block_table for s in engine.scheduler.running)
        assert engine.blocks.used == 0
    finally:
        small.close()


async def test_each_choice_follows_the_response_format_with_its_own_grammar_state(
    backend: HFChatBackend,
) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    req = request("JSON please", temperature=1.0, seed=0, max_tokens=40, n=3)
    req.sampling.ignore_eos = False
    req.response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, FinishReason | None] = {}
    async for chunk in backend.generate(await backend.prepare(req)):
        texts[chunk.index] += chunk.text
        finish[chunk.index] = chunk.finish_reason or finish.get(chunk.index)
    assert sorted(texts) == [0, 1, 2]
    for i in range(3):
        assert finish[i] is FinishReason.STOP
        assert isinstance(json.loads(texts[i])["n"], int)


async def test_a_choice_continues_alone_after_its_own_tokens(backend: HFChatBackend) -> None:
    """What the Ray ingress does when an n > 1 stream's replica dies: choice i goes on as a
    request of its own with seed + i and its tokens so far as the prefix."""
    got = await choices(backend, request("Tell a story", seed=40, n=2, **SAMPLED))
    for i, cut in ((0, 3), (1, 9)):
        alone = request("Tell a story", seed=40 + i, **SAMPLED)
        alone.prefix_token_ids = got[i]["tokens"][:cut]
        rest = await choices(backend, alone)
        assert rest[0]["tokens"] == got[i]["tokens"][cut:]
        assert rest[0]["completion"] == 16  # counted from the choice's start, as before
