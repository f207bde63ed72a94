"""The batched engine on a bfloat16 model on CPU (what ``--dtype auto`` serves on a CPU with
native bf16, and ``--dtype bfloat16`` anywhere).

Pinned on the tiny Qwen2-VL saved in bfloat16: the engine's decode attention reads the bf16
cache in place (a C kernel, ``cpu_attention.py``); its gathered fallback runs in float32
(torch's CPU kernel for one bf16 query per head is ~8x slower than float32's); and a
request's greedy output is the same alone and inside a busy batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from tests.unit.engine.core.test_batching import mixed_batch, request, run, start_all, wait_for
from tests.unit.engine.models.families.test_families_batched import backend_for, mixed
from tests.unit.engine.models.families.test_families_batched import request as request_for
from tests.unit.engine.models.test_attention_kernels import prefilled, prompts

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.testing.tiny import TinySpec, build_qwen2_vl


@pytest.fixture(scope="module")
def bf16() -> Iterator[HFChatBackend]:
    path = build_qwen2_vl(TinySpec(torch_dtype="bfloat16"))
    options = LoadOptions(source=str(path), device="cpu", dtype="bfloat16")
    backend = HFChatBackend(
        "tiny-bf16",
        options,
        max_model_len=4096,
        max_queued=64,
        vision_cache_bytes=0,
        processor_cache_bytes=0,
    )
    backend.load()
    assert backend.engine is not None
    yield backend
    backend.close()


def test_the_engine_decodes_a_bf16_model_with_attention_in_place(bf16: HFChatBackend) -> None:
    assert bf16.engine is not None
    assert bf16.engine.decode_mode.startswith("paged attention, CPU kernel")
    assert bf16.engine.runner.compiled is not None


def test_gathered_decode_attention_of_a_bf16_model_is_computed_in_float32(
    bf16: HFChatBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback (no C++ compiler, ``--enforce-eager``): a real decode step of the bf16
    model calls attention on float32 keys, values and mask, and the result is the float32
    attention's, rounded to bf16 once."""
    assert bf16.engine is not None
    runner = bf16.engine.runner
    monkeypatch.setattr(runner, "compiled", None)
    assert runner.dtype is torch.bfloat16 and runner._attention_dtype() is torch.float32
    seen: list[tuple[torch.dtype, ...]] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> object:
        mask = kw.get("attn_mask")
        seen.append((q.dtype, k.dtype, v.dtype, getattr(mask, "dtype", None)))
        return sdpa(q, k, v, **kw)  # type: ignore[arg-type]

    step = prefilled(runner, prompts(runner, [20, 45, 33]))
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.inference_mode():
        logits = runner.decode(**step)
    assert seen == [(torch.float32,) * 4] * len(runner.layers)
    assert logits.shape[0] == 3

    gen = torch.Generator().manual_seed(0)
    b, length = 6, 80
    q = torch.randn(b, runner.heads, runner.head_dim, generator=gen).bfloat16()
    keys = torch.randn(b, runner.kv_heads, length, runner.head_dim, generator=gen).bfloat16()
    values = torch.randn(b, runner.kv_heads, length, runner.head_dim, generator=gen).bfloat16()
    seen_keys = torch.arange(length)[None] <= torch.tensor([79, 10, 40, 0, 63, 79])[:, None]
    mask = runner._additive(seen_keys).float()
    with torch.inference_mode():
        ours = runner._decode_attention(q, keys.float(), values.float(), mask)
        exact = sdpa(
            q.float()[:, :, None],
            keys.float(),
            values.float(),
            attn_mask=mask,
            scale=runner.scale,
            enable_gqa=True,
        ).reshape(b, -1)
        in_bf16 = sdpa(
            q[:, :, None],
            keys,
            values,
            attn_mask=mask.bfloat16(),
            scale=runner.scale,
            enable_gqa=True,
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
    tasks = await start_all(bf16, others)
    await wait_for(lambda: engine.gauges.running == len(others))
    started = engine.steps
    await wait_for(lambda: engine.steps >= started + 3)
    joined = await run(bf16, probe)
    together = [*await asyncio.gather(*tasks), joined]
    assert [o.tokens for o in together] == [o.tokens for o in alone]


@pytest.mark.parametrize("family", ["gemma3", "qwen3_vl"])
async def test_other_families_in_bf16_answer_the_same_alone_and_in_a_busy_batch(
    family: str,
) -> None:
    """Gemma 3 (its sliding-window decode masks go to float32 with the keys) and Qwen3-VL
    (q/k norms, DeepStack) on the bf16 path."""
    backend = backend_for(family, dtype="bfloat16")
    try:
        engine = backend.engine
        assert engine is not None and engine.runner.dtype is torch.bfloat16
        others = mixed(family)
        probe = request_for(
            "Probe with two pictures", images=[(80, 80, 9), (50, 70, 3)], max_tokens=20
        )
        alone = [await run(backend, r) for r in [*others, probe]]
        tasks = await start_all(backend, others)
        await wait_for(lambda: engine.gauges.running == len(others))
        joined = await run(backend, probe)
        together = [*await asyncio.gather(*tasks), joined]
        assert [o.tokens for o in together] == [o.tokens for o in alone]
    finally:
        backend.close()
