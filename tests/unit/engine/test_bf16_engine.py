"""The batched engine on a bfloat16 model on CPU (what ``--dtype auto`` serves on a CPU with
native bf16, and ``--dtype bfloat16`` anywhere).

Pinned on the tiny Qwen2-VL saved in bfloat16: decode attention runs in float32 (torch's CPU
kernel for one bf16 query per head is ~8x slower than float32's), and a request's greedy
output is the same alone and inside a busy batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_batching import mixed_batch, request, run, wait_for

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.testing.tiny import TinySpec, build_qwen2_vl


@pytest.fixture(scope="module")
def bf16() -> Iterator[HFChatBackend]:
    path = build_qwen2_vl(TinySpec(torch_dtype="bfloat16"))
    options = LoadOptions(source=str(path), device="cpu", dtype="bfloat16")
    backend = HFChatBackend("tiny-bf16", options, max_model_len=4096, max_queued=64,
                            vision_cache_bytes=0, processor_cache_bytes=0)  # fmt: skip
    backend.load()
    assert backend.engine is not None
    yield backend
    backend.close()


def test_decode_attention_of_a_bf16_model_is_computed_in_float32(bf16: HFChatBackend) -> None:
    assert bf16.engine is not None
    runner = bf16.engine.runner
    assert runner.dtype is torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    b, length = 6, 80
    q = torch.randn(b, runner.heads, runner.head_dim, generator=gen).bfloat16()
    keys = torch.randn(b, runner.kv_heads, length, runner.head_dim, generator=gen).bfloat16()
    values = torch.randn(b, runner.kv_heads, length, runner.head_dim, generator=gen).bfloat16()
    seen = torch.arange(length)[None] <= torch.tensor([79, 10, 40, 0, 63, 79])[:, None]
    mask = runner._additive(seen)  # [B, 1, 1, L] in bf16
    with torch.inference_mode():
        ours = runner._decode_attention(q, keys, values, mask)
        exact = F.scaled_dot_product_attention(
            q.float()[:, :, None], keys.float(), values.float(), attn_mask=mask.float(),
            scale=runner.scale, enable_gqa=True,
        ).reshape(b, -1)  # fmt: skip
        in_bf16 = F.scaled_dot_product_attention(
            q[:, :, None], keys, values, attn_mask=mask, scale=runner.scale, enable_gqa=True
        ).reshape(b, -1)
    assert ours.dtype is torch.bfloat16
    assert torch.equal(ours, exact.bfloat16())
    assert not torch.equal(in_bf16, ours)  # the bf16 kernel rounds otherwise: not what runs


async def test_bf16_greedy_output_is_the_same_alone_and_in_a_busy_batch(
    bf16: HFChatBackend,
) -> None:
    engine = bf16.engine
    assert engine is not None
    others = mixed_batch()
    probe = request("Probe with a picture", image=(64, 48), max_tokens=24)
    alone = [await run(bf16, r) for r in [*others, probe]]
    tasks = [asyncio.create_task(run(bf16, r)) for r in others]
    await wait_for(lambda: engine.running == len(others))
    started = engine.steps
    await wait_for(lambda: engine.steps >= started + 3)
    joined = await run(bf16, probe)
    together = [*await asyncio.gather(*tasks), joined]
    assert [o.tokens for o in together] == [o.tokens for o in alone]
