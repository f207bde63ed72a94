"""The batched-family contract (``test_families_batched.py``) on Gemma 3, plus what only
Gemma 3 has: sliding-window layers and image tokens that attend to each other both ways."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tests.unit.engine.models.families.test_families_batched import (
    backend_for,
    generate_alone,
    request,
    run,
    test_batched_greedy_matches_transformers_generate,
    test_eight_concurrent_requests_decode_together,
    test_greedy_output_is_identical_alone_and_joining_a_busy_batch,
)

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.inputs import build_inputs
from vlmserve.engine.hf.loading import LoadOptions, load_model
from vlmserve.engine.models.architectures import build
from vlmserve.engine.models.runner import PrefillRow
from vlmserve.engine.models.vision_cache import VisionCache
from vlmserve.testing import FAMILIES

__all__ = [
    "test_batched_greedy_matches_transformers_generate",
    "test_eight_concurrent_requests_decode_together",
    "test_greedy_output_is_identical_alone_and_joining_a_busy_batch",
]


@pytest.fixture(scope="module", params=["gemma3"])
def family(request: pytest.FixtureRequest) -> Iterator[tuple[str, HFChatBackend]]:
    backend = backend_for(request.param)
    yield request.param, backend
    backend.close()


async def test_a_prompt_longer_than_the_sliding_window_matches_generate(
    family: tuple[str, HFChatBackend],
) -> None:
    _, backend = family
    window = backend._require().model.config.get_text_config().sliding_window
    req = request("A longer text-only prompt " * 14, max_tokens=30)
    assert (await backend.prepare(req)).prompt_tokens > window  # sliding layers cut keys
    assert (await run(backend, req)).tokens == await generate_alone(backend, req)


def _values(out: Any, layer: int) -> torch.Tensor:
    cache = getattr(out, "past_key_values", None) or out.cache
    return cache.layers[layer].values[0].transpose(0, 1)  # [T, KVH, D]


def test_prefill_of_an_image_prompt_equals_the_models_forward() -> None:
    """The second layer's values (from the first layer's output, where an image's tokens
    attend to each other both ways) equal the model's own forward with ``token_type_ids``."""
    loaded = load_model(LoadOptions(source=str(FAMILIES["gemma3"]()), device="cpu"))
    model = loaded.model
    req = request("Two pictures.", images=[(64, 48, 0), (40, 70, 1)], max_tokens=1)
    inputs = {
        k: v
        for k, v in build_inputs(loaded.processor, req).inputs.items()
        if isinstance(v, torch.Tensor)
    }
    with torch.inference_mode():
        hf = _values(model(**inputs, use_cache=True), 1)
        runner, embedder = build(model, VisionCache(0))
        cache = runner.allocate_cache(num_blocks=16, block_size=16)
        blocks = BlockManager(16, 16)
        row = embedder.build(inputs).row
        table: list[int] = []
        blocks.allocate(table, row.embeds.shape[0])
        cache.clear(blocks.take_fresh())
        row.slots = [blocks.slot(table, i) for i in range(row.embeds.shape[0])]
        runner.prefill([row])
        ours = cache.v[1].view(-1, *hf.shape[1:])[torch.tensor(row.slots)]
    assert row.blocks is not None and int((row.blocks >= 0).sum()) == 8  # 2 images x 4
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-5)


def test_prefill_masks_are_the_models_own() -> None:
    """Image blocks both ways, sliding window on local layers: ``Gemma3Runner``'s masks
    equal ``create_masks_for_vision_model``'s for an 80-token prompt (window 64) with an
    image near the start and one at the end."""
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    model = load_model(LoadOptions(source=str(FAMILIES["gemma3"]()), device="cpu")).model
    runner, _ = build(model, VisionCache(0))
    config, t = model.config.get_text_config(), 80
    types = torch.zeros(1, t, dtype=torch.long)
    types[0, 10:14] = types[0, 70:74] = 1
    block_ids = get_block_sequence_ids_for_mask(types)
    theirs = create_masks_for_vision_model(
        config=config,
        inputs_embeds=torch.zeros(1, t, config.hidden_size),
        attention_mask=None,
        cache=None,
        position_ids=torch.arange(t)[None],
        block_sequence_ids=block_ids,
    )
    row = PrefillRow(torch.zeros(t, config.hidden_size), None, blocks=block_ids[0])
    ours = runner._prefill_masks(row)
    assert set(ours) == set(theirs) == {"full_attention", "sliding_attention"}
    for kind in ours:
        assert torch.equal(ours[kind], theirs[kind][0, 0]), kind
