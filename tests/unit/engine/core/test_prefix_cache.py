"""Prefix caching (``--enable-prefix-caching``): a prompt's full blocks are computed once.

Pinned on the real tiny checkpoints: a shared system prompt and a second turn about the same
image take their K/V from the cache (the scheduler counts the tokens), a different image
shares only the text before it, the answers are the ones the engine gives without the
cache, and under a small budget idle cached blocks are handed out again with the books
balanced. The keys and the block manager's sharing are pinned directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tests.unit.engine.core.test_batching import make_backend, run
from tests.unit.engine.core.test_paged_kv import crowd
from tests.unit.engine.models.families.test_families_batched import backend_for

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.core.prefix import block_hashes
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import Sequence
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, SamplingParams, TextPart
from vlmserve.testing.media import gradient_image

SYSTEM = "You read identity cards and answer with the fields asked for. " * 6


def ask(*turns: tuple[str, list[Any]], max_tokens: int = 16) -> GenerateRequest:
    """A conversation: (role, parts) turns; the last is the user's question."""
    messages = [ChatMessage("system", [TextPart(SYSTEM)])]
    messages += [ChatMessage(role, parts) for role, parts in turns]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest("t", messages, params)


def card(seed: int) -> ImagePart:
    return ImagePart(gradient_image(112, 112, seed=seed))


@pytest.fixture(scope="module")
def off(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8)
    yield b
    b.close()


@pytest.fixture
def on(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8, prefix_caching=True)
    yield b
    b.close()


def sized(prompt_tokens: int) -> Sequence:
    """A row whose prepared input only carries a prompt length (all the scheduler reads)."""
    return Sequence(SimpleNamespace(prompt_tokens=prompt_tokens), None, None, 8)  # type: ignore[arg-type]


def hits(backend: HFChatBackend) -> int:
    assert backend.engine is not None
    return backend.engine.scheduler.prefix_hits


# --- keys and books -----------------------------------------------------------------------------
def test_a_block_key_covers_everything_before_it_and_the_media_from_their_block_on() -> None:
    ids = list(range(100, 164))  # 4 blocks of 16
    base = block_hashes(ids, 16)
    assert len(base) == 4 and len(set(base)) == 4
    assert block_hashes(ids[:40], 16) == base[:2]  # a partial block has no key
    assert block_hashes(ids[:47], 16) == base[:2] and block_hashes(ids[:48], 16) == base[:3]
    changed = block_hashes([*ids[:20], 7, *ids[21:]], 16)
    assert changed[0] == base[0] and changed[1:] != base[1:] and changed[2] != base[2]
    one, other = block_hashes(ids, 16, (33, b"image A")), block_hashes(ids, 16, (33, b"image B"))
    assert one[:2] == other[:2] == base[:2]  # text before the image's block: shared
    assert one[2] != other[2] and one[3] != other[3] and one[2] != base[2]
    at_32 = block_hashes(ids, 16, (32, b"image A")), block_hashes(ids, 16, (32, b"image B"))
    assert at_32[0][:2] == at_32[1][:2] == base[:2]  # the image starts the third block
    assert at_32[0][2] != at_32[1][2]


def test_a_cache_salt_starts_its_own_chain() -> None:
    ids = list(range(100, 164))
    base, salted = block_hashes(ids, 16), block_hashes(ids, 16, salt="tenant-a")
    assert len(salted) == 4 and not set(salted) & set(base)  # no block shared with unsalted
    assert block_hashes(ids, 16, salt="tenant-a") == salted  # the same salt: the same keys
    assert not set(block_hashes(ids, 16, salt="tenant-b")) & set(salted)
    with_media = block_hashes(ids, 16, (33, b"image A"), salt="tenant-a")
    assert with_media[:2] == salted[:2] and with_media[2] != salted[2]


def test_registered_blocks_are_shared_counted_and_reused_least_recently_used_first() -> None:
    blocks = BlockManager(7, 4, prefix_caching=True)  # 6 usable
    first: list[int] = []
    blocks.allocate(first, 12)
    keys = block_hashes(list(range(12)), 4)
    blocks.register(first, keys)
    second: list[int] = []
    blocks.share(second, blocks.lookup(keys[:2]))
    blocks.allocate(second, 10)
    assert second[:2] == first[:2] and second[2] not in first
    assert blocks.refs[first[0]] == 2 and blocks.available == 2
    blocks.check([first, second])
    blocks.free_table(first)  # its shared blocks stay owned, its own third block goes idle
    assert blocks.lookup(keys) == [second[0], second[1], *blocks.idle] and blocks.available == 3
    blocks.free_table(second)
    assert blocks.available == 6 and len(blocks.idle) == 3  # all findable, all available
    taken: list[int] = []
    blocks.allocate(taken, 24)  # the 3 never-registered first, then idle ones, oldest first
    assert blocks.lookup(keys) == [] and not blocks.idle and blocks.by_hash == {}
    blocks.check([taken])


def test_idle_blocks_go_least_recently_freed_first_and_a_shared_one_is_owned_again() -> None:
    blocks = BlockManager(4, 4, prefix_caching=True)  # 3 usable
    old, new = [], []
    blocks.allocate(old, 4)
    blocks.allocate(new, 4)
    k_old, k_new = block_hashes([1] * 4, 4), block_hashes([2] * 4, 4)
    blocks.register(old, k_old)
    blocks.register(new, k_new)
    kept = new[0]
    blocks.free_table(old)  # idle first: the least recently used
    blocks.free_table(new)
    taken: list[int] = []
    blocks.allocate(taken, 8)  # the never-registered free block, then the oldest idle one
    assert blocks.lookup(k_old) == [] and blocks.lookup(k_new) == [kept]
    again: list[int] = []
    blocks.share(again, blocks.lookup(k_new))  # an idle block owned again
    assert again == [kept] and kept not in blocks.idle and blocks.available == 0
    blocks.check([again, taken])


def test_a_prompt_registers_after_a_block_someone_else_registered_first() -> None:
    blocks = BlockManager(9, 4, prefix_caching=True)
    first, second = [], []
    blocks.allocate(first, 8)
    blocks.allocate(second, 16)  # prompt of 3 full blocks + a decode block: 4 in the table
    shared = block_hashes([7] * 8, 4)
    mine = block_hashes([7] * 4 + [8] * 8, 4)  # same first block, then its own
    blocks.register(first, shared)
    blocks.register(second, mine)  # fewer keys than blocks: the rest stays private
    assert blocks.lookup(mine) == [first[0], second[1], second[2]]
    assert blocks.lookup(shared) == first
    assert second[0] not in blocks.hash_of and second[3] not in blocks.hash_of


def test_admission_counts_a_cached_prefix_once_and_idle_blocks_as_taken() -> None:
    blocks = BlockManager(7, 4, prefix_caching=True)  # 6 usable
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=100, blocks=blocks)
    scheduler.prefix_hasher = lambda seq: block_hashes([3] * seq.prompt_len, 4)
    owner = sized(9)  # 2 full blocks + 1
    scheduler.add(owner)
    assert scheduler.schedule() == [owner]
    blocks.register(owner.block_table, scheduler.prefix_hasher(owner))
    reader = sized(13)  # 4 blocks, its first 2 cached and owned by a running row
    scheduler.add(reader)
    assert scheduler.schedule() == [reader]  # 2 new + 1 spare for the running row == 3 free
    assert reader.cached == 8 and reader.block_table[:2] == owner.block_table[:2]
    assert scheduler.prefix_hits == 8 and scheduler.prefix_queried == 9 + 13
    blocks.check([owner.block_table, reader.block_table])
    scheduler.remove(owner)
    scheduler.remove(reader)  # the 2 cached blocks are idle now, 4 free
    too_big = sized(28)  # 7 blocks: more than the cache, its 2 cached ones included
    scheduler.add(too_big)
    assert scheduler.schedule() == [] and list(scheduler.waiting) == [too_big]
    scheduler.waiting.clear()
    whole = sized(24)  # 6 blocks: its 2 idle cached ones and all 4 free ones
    scheduler.add(whole)
    assert scheduler.schedule() == [whole] and whole.cached == 8
    assert scheduler.prefix_hits == 16
    blocks.check([whole.block_table])


def test_a_cached_prompt_always_leaves_its_last_token_to_compute() -> None:
    blocks = BlockManager(9, 4, prefix_caching=True)
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100, blocks=blocks)
    scheduler.prefix_hasher = lambda seq: block_hashes([5] * seq.prompt_len, 4)
    first = sized(9)
    scheduler.add(first)
    scheduler.schedule()
    blocks.register(first.block_table, scheduler.prefix_hasher(first))
    same, exact = sized(9), sized(8)  # 2 full blocks + 1 token; exactly 2 blocks
    for seq in (same, exact):
        scheduler.add(seq)
    assert scheduler.schedule() == [same, exact]
    assert same.cached == 8 and exact.cached == 4  # its last block is computed again


def test_nothing_is_counted_without_prefix_caching() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100, blocks=BlockManager(9, 4))
    scheduler.prefix_hasher = lambda seq: block_hashes([5] * seq.prompt_len, 4)
    scheduler.add(sized(9))
    scheduler.schedule()
    assert scheduler.prefix_queried == scheduler.prefix_hits == 0


def test_without_prefix_caching_nothing_is_found() -> None:
    blocks = BlockManager(7, 4)
    table: list[int] = []
    blocks.allocate(table, 8)
    keys = block_hashes(list(range(8)), 4)
    blocks.register(table, keys)
    assert blocks.lookup(keys) == [] and not blocks.hash_of


# --- on the engine ------------------------------------------------------------------------------
async def test_a_shared_system_prompt_is_computed_once_and_answers_do_not_change(
    off: HFChatBackend, on: HFChatBackend
) -> None:
    questions = [ask(("user", [TextPart(q)])) for q in ("Name?", "Date of birth?", "Number?")]
    got = [await run(on, q) for q in questions]
    assert hits(on) >= 2 * 6 * 16  # the system prompt's blocks, twice
    assert [g.tokens for g in got] == [(await run(off, q)).tokens for q in questions]


async def test_only_requests_with_the_same_cache_salt_share_cached_blocks(
    off: HFChatBackend, on: HFChatBackend
) -> None:
    def salted(question: str, salt: str | None) -> GenerateRequest:
        request = ask(("user", [TextPart(question)]))
        request.cache_salt = salt
        return request

    await run(on, salted("Name?", None))
    before = hits(on)
    answer = await run(on, salted("Date of birth?", "tenant-a"))
    assert hits(on) == before  # the unsalted system prompt is not the salted one
    await run(on, salted("Number?", "tenant-b"))
    assert hits(on) == before
    await run(on, salted("Address?", "tenant-a"))
    assert hits(on) - before >= 6 * 16  # tenant a's own earlier blocks
    assert answer.tokens == (await run(off, salted("Date of birth?", "tenant-a"))).tokens


async def test_a_second_turn_about_the_same_image_reuses_it_another_image_only_the_text(
    off: HFChatBackend, on: HFChatBackend
) -> None:
    first = ask(("user", [card(1), TextPart("Read the card.")]))
    answer = await run(on, first)
    prepared = await on.prepare(first)
    prompt = prepared.prompt_tokens
    await on.discard(prepared)
    turn = ("user", [card(1), TextPart("Read the card.")])
    follow = ask(turn, ("assistant", [TextPart(answer.text)]), ("user", [TextPart("Name?")]))
    before = hits(on)
    again = await run(on, follow)
    assert hits(on) - before == (prompt // 16) * 16  # every full block of the first turn
    other = ask(("user", [card(2), TextPart("Read the card.")]))
    before = hits(on)
    await run(on, other)
    shared = hits(on) - before
    assert 0 < shared < (prompt // 16) * 16  # the system prompt, not the image's blocks
    assert again.tokens == (await run(off, follow)).tokens


async def test_qwen3_vl_deepstack_rows_answer_the_same_from_the_cache() -> None:
    """Qwen3-VL adds DeepStack features at the image's tokens: a row whose cached prefix ends
    before its image (the system prompt) gets them at the right places of what it computes."""
    plain, cached = backend_for("qwen3_vl"), backend_for("qwen3_vl", prefix_caching=True)
    try:
        turn = ("user", [card(3), TextPart("Read the card.")])
        follow = ask(turn, ("assistant", [TextPart("A card.")]), ("user", [TextPart("Name?")]))
        requests = [ask(("user", [card(seed), TextPart("Read the card.")])) for seed in (3, 4, 5)]
        every = [*requests, follow]
        got = [await run(cached, r) for r in every]
        assert hits(cached) > 0
        assert [g.tokens for g in got] == [(await run(plain, r)).tokens for r in every]
        assert len({tuple(g.tokens) for g in got}) > 1  # the images change the answers
    finally:
        plain.close()
        cached.close()


async def test_a_small_budget_reuses_idle_blocks_and_preempts_with_the_same_answers(
    tiny_dir: Path, off: HFChatBackend
) -> None:
    assert off.engine is not None
    requests = crowd()[:16]
    alone = [await run(off, r) for r in requests]
    tight = make_backend(
        tiny_dir,
        max_num_seqs=16,
        prefix_caching=True,
        kv_cache_bytes=40 * off.engine.kv.block_bytes,
    )
    try:
        assert tight.engine is not None
        got = await asyncio.gather(*(run(tight, r) for r in requests))
        again = await asyncio.gather(*(run(tight, r) for r in requests[:4]))
        engine = tight.engine
        assert engine.scheduler.preemptions > 0 and hits(tight) > 0
        assert [g.tokens for g in got] == [a.tokens for a in alone]
        assert [g.tokens for g in again] == [a.tokens for a in alone[:4]]
        assert len(engine.blocks.by_hash) <= engine.blocks.usable
        engine.blocks.check([])  # everyone left: every block free or idle, none lost
    finally:
        tight.close()
