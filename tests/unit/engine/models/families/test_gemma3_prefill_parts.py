"""Gemma 3's prompt computed in parts: chunked prefill and prefix caching.

Gemma 3's attention has masks of its own (sliding layers see the last ``sliding_window``
positions; an image's tokens attend to each other both ways), so a part of a prompt computed
after earlier parts must get the rows of the whole prompt's masks, and no part may end inside
an image block (its later tokens would be missing from the earlier ones' attention). Pinned
here: the chunk boundary rule, the masks of a part equal the whole prompt's rows, and on the
real tiny checkpoint the answers with chunks or a cached prefix are the whole prefill's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tests.unit.engine.core.test_chunked_prefill import Forwards
from tests.unit.engine.models.families.test_families_batched import backend_for, request, run

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.core.paging import whole_blocks
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.inputs import build_inputs
from vlmserve.engine.hf.loading import LoadOptions, load_model
from vlmserve.engine.models.architectures import build
from vlmserve.engine.models.runner import PrefillRow
from vlmserve.engine.models.vision_cache import VisionCache
from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, SamplingParams, TextPart
from vlmserve.testing import FAMILIES
from vlmserve.testing.media import gradient_image


@pytest.fixture(scope="module")
def whole() -> Iterator[HFChatBackend]:
    b = backend_for("gemma3")
    yield b
    b.close()


def test_a_chunk_ends_before_an_image_block_or_after_one_it_starts_in() -> None:
    #                        0   1  2  3  4  5   6  7  8  9 10  11
    blocks = torch.tensor([-1, -1, 0, 0, 0, 0, -1, 1, 1, 1, 1, -1])
    assert whole_blocks(blocks, 0, 2) == 2  # ends on text
    assert whole_blocks(blocks, 0, 4) == 2  # inside image 0: back to its start
    assert whole_blocks(blocks, 0, 6) == 6  # right after image 0
    assert whole_blocks(blocks, 2, 4) == 6  # starts at image 0: the whole image
    assert whole_blocks(blocks, 3, 5) == 6  # starts inside it (a cached prefix): its rest
    assert whole_blocks(blocks, 6, 8) == 7  # inside image 1, which starts after 6
    assert whole_blocks(blocks, 0, 12) == 12  # the prompt's end
    assert whole_blocks(None, 0, 5) == 5  # no images


def test_the_masks_of_a_part_are_the_rows_of_the_whole_prompts_masks() -> None:
    """80 tokens (sliding window 64) with images at 10..13 and 70..73: a part starting at
    16, 64 or 72 (inside the second image) and running to the end sees exactly what those
    queries see in the whole prompt, and nothing of the gathered blocks' padding."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    model = load_model(LoadOptions(source=str(FAMILIES["gemma3"]()), device="cpu")).model
    runner, _ = build(model, VisionCache(0))
    hidden, t = model.config.get_text_config().hidden_size, 80
    assert runner.window == 64
    types = torch.zeros(1, t, dtype=torch.long)
    types[0, 10:14] = types[0, 70:74] = 1
    blocks = get_block_sequence_ids_for_mask(types)[0]
    full = runner._prefill_masks(PrefillRow(torch.zeros(t, hidden), None, blocks=blocks))
    for start in (16, 64, 72):
        part = PrefillRow(torch.zeros(t - start, hidden), None, cached=start, blocks=blocks)
        masks = runner._cached_masks(part, 96)  # 6 blocks of 16 keys gathered
        assert set(masks) == set(full)
        for kind, mask in masks.items():
            assert torch.equal(mask[:, :t], full[kind][start:]), (kind, start)
            assert not mask[:, t:].any()  # padding


def _chunks(blocks: torch.Tensor, size: int) -> list[int]:
    """The sizes of a prompt's chunks of at most ``size`` tokens, no image split."""
    sizes, start = [], 0
    while start < blocks.numel():
        end = whole_blocks(blocks, start, min(blocks.numel(), start + size))
        sizes.append(end - start)
        start = end
    return sizes


async def test_a_chunked_image_prompt_answers_as_the_whole_prefill(
    whole: HFChatBackend,
) -> None:
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    req = request(
        "Compare the three pictures. " * 3,
        max_tokens=12,
        images=[(64, 48, 0), (40, 70, 1), (50, 50, 2)],
    )
    prepared = await whole.prepare(req)
    await whole.discard(prepared)
    blocks = get_block_sequence_ids_for_mask(prepared.inputs["token_type_ids"])[0]
    # the first chunk size from 12 on at which a chunk would end inside an image
    size = next(n for n in range(12, 40) if any(c < n for c in _chunks(blocks, n)[:-1]))
    chunked = backend_for("gemma3", max_num_batched_tokens=size)
    try:
        forwards = Forwards(chunked)
        got = await run(chunked, req)
        assert [n for kind, n in forwards.log if kind == "prefill"] == _chunks(blocks, size)
        assert got.tokens == (await run(whole, req)).tokens
    finally:
        chunked.close()


def _turns(words: int, *more: tuple[str, str]) -> GenerateRequest:
    """A user turn of ``words`` words then an image, and ``more`` (role, text) turns."""
    image = ImagePart(gradient_image(64, 48, seed=3))
    messages = [ChatMessage("user", [TextPart("Read the card " * words), image])]
    messages += [ChatMessage(role, [TextPart(text)]) for role, text in more]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return GenerateRequest("test", messages, params)


async def _cut_inside_the_image(backend: HFChatBackend) -> tuple[int, int]:
    """(words, cached tokens) for a first turn whose full prompt blocks end inside its
    image: a second turn's cached prefix then ends in the middle of an image block."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    for words in range(1, 40):
        prepared = await backend.prepare(_turns(words))
        await backend.discard(prepared)
        blocks = get_block_sequence_ids_for_mask(prepared.inputs["token_type_ids"])[0]
        cut = (prepared.prompt_tokens // 16) * 16
        if cut > 0 and int(blocks[cut - 1]) >= 0 and int(blocks[cut]) == int(blocks[cut - 1]):
            return words, cut
    raise AssertionError("no layout puts a block boundary inside the image")


async def test_a_cached_prefix_ending_inside_an_image_gives_the_uncached_answer(
    whole: HFChatBackend,
) -> None:
    cached = backend_for("gemma3", prefix_caching=True)
    try:
        assert cached.engine is not None
        words, cut = await _cut_inside_the_image(cached)
        first = _turns(words)
        answer = await run(cached, first)
        follow = _turns(words, ("assistant", answer.text), ("user", "And the name?"))
        before = cached.engine.scheduler.prefix_hits
        got = await run(cached, follow)
        assert cached.engine.scheduler.prefix_hits - before == cut
        assert got.tokens == (await run(whole, follow)).tokens
        assert answer.tokens == (await run(whole, first)).tokens
    finally:
        cached.close()


def test_parts_that_keep_images_whole_write_the_whole_prefills_kv() -> None:
    """On the runner: a prompt with two images computed whole, in two parts split at an
    image's start, and from the middle of an image on after the whole prompt's K/V (a cached
    prefix) writes the same second-layer values; split inside an image it would not."""
    loaded = load_model(LoadOptions(source=str(FAMILIES["gemma3"]()), device="cpu"))
    req = request("Two pictures.", images=[(64, 48, 0), (40, 70, 1)], max_tokens=1)
    inputs = {
        k: v
        for k, v in build_inputs(loaded.processor, req).inputs.items()
        if isinstance(v, torch.Tensor)
    }
    with torch.inference_mode():
        runner, embedder = build(loaded.model, VisionCache(0))
        cache = runner.allocate_cache(num_blocks=16, block_size=16)
        row = embedder.build(inputs).row
        assert row.blocks is not None
        t = row.embeds.shape[0]
        positions = torch.arange(t).expand(3, t)
        books, table = BlockManager(16, 16), []
        books.allocate(table, t)
        cache.clear(table)  # as the engine does for fresh blocks: the cache is torch.empty,
        # and the masked tail of the last block must not hold NaN (0 * NaN is NaN)
        slots = [books.slot(table, i) for i in range(t)]

        def compute(start: int, end: int) -> None:
            part = PrefillRow(
                row.embeds[start:end],
                positions[:, start:end],
                cached=start,
                table=table if start else None,
                blocks=row.blocks[:end],
            )
            part.slots = slots[start:end]
            runner.prefill([part])

        def values() -> torch.Tensor:
            return cache.v[1].reshape(-1, *cache.v.shape[-2:])[torch.tensor(slots)].clone()

        compute(0, t)
        whole = values()
        image = (row.blocks == 0).nonzero()[:, 0].tolist()  # the first image's tokens
        inside = image[len(image) // 2]
        compute(inside, t)  # after a cached prefix that ends inside the image
        torch.testing.assert_close(values(), whole, rtol=0, atol=1e-5)
        compute(0, image[0])
        compute(image[0], t)
        torch.testing.assert_close(values(), whole, rtol=0, atol=1e-5)
        compute(0, inside)  # the image's first half never sees its second half
        compute(inside, t)
        assert not torch.allclose(values(), whole, rtol=0, atol=1e-5)
