"""Prefill attention on CPU for bfloat16 models (``cpu_prefill.c``, in the library that
``cpu_attention.py`` builds): causal, on the CPU's bfloat16 dot products (AVX512-BF16).

Pinned on the kernel alone: it equals a float32 reference within bfloat16 rounding at real
head layouts, for prompts from one token to past 2,000, alone and after a prefix (a cached
prefix or earlier chunks) across tile boundaries; a prompt attended in chunks is
bit-identical to the same prompt whole (a query's result depends on nothing but the keys
before it); too few keys are refused. On the tiny bfloat16 Qwen2-VL's runner: prefill runs
no torch attention, and its logits match torch's attention within bfloat16 rounding with
the same greedy token, whole and in two chunks; its vision tower's attention (an image and
a video, each bidirectional) runs the kernel too, within bfloat16 rounding of torch's.
Where the build has no AVX512-BF16 (the ISA capped to AVX2, an older CPU) the kernel says so
and prefill keeps torch's attention.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForImageTextToText

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.models.batch import PrefillRow
from vlmserve.engine.models.cpu_attention import CpuPagedAttention
from vlmserve.engine.models.prefill_only import last_hidden, shared_prefix
from vlmserve.engine.models.runner import Qwen2VLRunner
from vlmserve.testing.tiny import TinySpec, build_qwen2_vl

BLOCK = 16


@pytest.fixture(scope="module")
def kernel() -> CpuPagedAttention:
    k = CpuPagedAttention()
    if not k.prefills:
        pytest.skip("this build has no AVX512-BF16: prefill keeps torch's attention")
    return k


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int) -> torch.Tensor:
    """Float32 attention of queries at first.. over keys 0..(their position)."""
    t = q.shape[0]
    seen = torch.arange(first + t)[None] <= torch.arange(first, first + t)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(),
        k[: first + t].transpose(0, 1)[None].float(),
        v[: first + t].transpose(0, 1)[None].float(),
        attn_mask=seen,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def _qkv(
    first: int, t: int, kv_heads: int, rep: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, kv_heads * rep, dim, generator=gen).bfloat16()
    k, v = (torch.randn(first + t + 5, kv_heads, dim, generator=gen).bfloat16() for _ in "kv")
    return q, k, v


@pytest.mark.parametrize(
    ("kv_heads", "rep", "dim"),
    [(4, 4, 64), (2, 6, 128), (4, 7, 128), (8, 1, 80), (2, 2, 32)],
    ids=["medium", "qwen2-vl-2b", "qwen2.5-vl-7b", "mha-80", "tiny"],
)
@pytest.mark.parametrize(
    ("first", "t"),
    [(0, 1), (0, 17), (0, 300), (15, 1), (16, 33), (31, 70), (1000, 48)],
)
def test_the_prefill_kernel_equals_the_float32_reference(
    kernel: CpuPagedAttention, kv_heads: int, rep: int, dim: int, first: int, t: int
) -> None:
    q, k, v = _qkv(first, t, kv_heads, rep, dim, seed=first * 7 + t + dim)
    got = kernel.prefill(q, k, v, dim**-0.5, first)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == q.shape
    want = reference(q, k, v, first)
    # scores and sums in float32; p and the output rounded to bfloat16, as torch's kernel
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_a_long_prompt_is_bit_identical_in_chunks_and_whole(kernel: CpuPagedAttention) -> None:
    q, k, v = _qkv(0, 2100, 4, 4, 64, seed=3)
    whole = kernel.prefill(q, k, v, 0.125)
    parts = [kernel.prefill(q[a:b], k, v, 0.125, a) for a, b in ((0, 1000), (1000, 2100))]
    assert whole is not None and all(p is not None for p in parts)
    assert torch.equal(torch.cat(parts), whole)  # type: ignore[arg-type]
    torch.testing.assert_close(whole.float(), reference(q, k, v, 0), rtol=2e-2, atol=2e-2)


def test_too_few_keys_or_another_dtype_is_refused(kernel: CpuPagedAttention) -> None:
    q, k, v = _qkv(10, 20, 2, 2, 32, seed=1)
    with pytest.raises(ValueError, match="need 130 keys"):
        kernel.prefill(q, k, v, 0.1, first=110)
    with pytest.raises(ValueError, match="not the query's"):
        kernel.prefill(q, k.float(), v, 0.1)
    assert kernel.prefill(q.float(), k.float(), v.float(), 0.1) is None  # torch's attention


@pytest.fixture(scope="module")
def bf16_runner(kernel: CpuPagedAttention) -> Qwen2VLRunner:
    path = build_qwen2_vl(TinySpec(torch_dtype="bfloat16"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    r = Qwen2VLRunner(model)
    r.allocate_cache(num_blocks=64, block_size=BLOCK)
    how = r.use_compiled_attention()
    assert how.startswith("paged attention, CPU kernel"), how
    return r


def _prefill(runner: Qwen2VLRunner, embeds: torch.Tensor, cut: int | None) -> torch.Tensor:
    """The prompt's last-token logits: prefilled whole, or in two chunks split at ``cut``
    (the second after the first's K/V, as the engine runs chunked prefill)."""
    assert runner.cache is not None
    blocks = BlockManager(runner.cache.num_blocks, BLOCK)
    n, table = embeds.shape[0], []
    blocks.allocate(table, n)
    runner.cache.clear(blocks.take_fresh())
    slots = [blocks.slot(table, i) for i in range(n)]
    with torch.inference_mode():
        if cut is None:
            return runner.prefill([PrefillRow(embeds, None, slots)])[0]
        runner.prefill([PrefillRow(embeds[:cut], None, slots[:cut])])
        pos = torch.arange(cut, n).expand(3, n - cut)
        rest = PrefillRow(embeds[cut:], pos, slots[cut:], cached=cut, table=table)
        return runner.prefill([rest])[0]


def test_the_runners_prefill_runs_the_kernel_and_matches_torchs_attention(
    bf16_runner: Qwen2VLRunner, kernel: CpuPagedAttention
) -> None:
    gen = torch.Generator().manual_seed(5)
    embeds = (torch.randn(300, bf16_runner.hidden, generator=gen) * 0.5).bfloat16()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        whole = _prefill(bf16_runner, embeds, None)
        chunked = _prefill(bf16_runner, embeds, 177)
    assert "aten::scaled_dot_product_attention" not in {e.key for e in prof.key_averages()}
    bf16_runner.compiled = None  # torch's attention (and gathered decode) instead
    try:
        want = _prefill(bf16_runner, embeds, None)
        want_chunked = _prefill(bf16_runner, embeds, 177)
    finally:
        bf16_runner.compiled = kernel
    for got, torchs in ((whole, want), (chunked, want_chunked), (chunked, whole)):
        torch.testing.assert_close(got.float(), torchs.float(), rtol=5e-2, atol=5e-2)
        assert int(got.argmax()) == int(torchs.argmax())


def test_without_avx512_bf16_prefill_keeps_torchs_attention(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Built for AVX2 (what ``ATEN_CPU_CAPABILITY=avx2`` builds), the library has no prefill
    kernel and says so."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("not an x86 CPU")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("VLMSERVE_KERNEL_CACHE", str(tmp_path))
    capped = CpuPagedAttention()
    assert not capped.prefills
    q, k, v = _qkv(0, 20, 2, 2, 32, seed=2)
    assert capped.prefill(q, k, v, 0.1) is None


def test_a_bf16_vision_tower_runs_the_kernel_and_matches_torchs_attention(
    kernel: CpuPagedAttention,
) -> None:
    """The tower's per-image bidirectional attention goes through the kernel (no torch
    attention runs) once the runner takes the kernel, within bf16 rounding of torch's."""
    path = build_qwen2_vl(TinySpec(torch_dtype="bfloat16"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    inner = model.model
    gen = torch.Generator().manual_seed(9)
    grid = torch.tensor([[1, 8, 12], [2, 4, 4]])  # an image, then a 2-frame video's grid
    width = inner.visual.config.in_channels * inner.visual.config.temporal_patch_size * 14 * 14
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=gen).bfloat16()
    with torch.inference_mode():
        want = inner.get_image_features(pixels, grid, return_dict=True).pooler_output
        runner = Qwen2VLRunner(model)
        assert "(and in the vision tower)" in runner.use_compiled_attention()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = inner.get_image_features(pixels, grid, return_dict=True).pooler_output
    assert "aten::scaled_dot_product_attention" not in {e.key for e in prof.key_averages()}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)


def test_rows_that_begin_alike_share_it_on_the_kernel(
    bf16_runner: Qwen2VLRunner, kernel: CpuPagedAttention
) -> None:
    """Prefill-only rows sharing a beginning attend over its keys with the kernel's ``first``
    offset, and give each row what it gets alone."""
    gen = torch.Generator().manual_seed(9)
    begin = (torch.randn(40, bf16_runner.hidden, generator=gen) * 0.5).bfloat16()
    ends = [(torch.randn(n, bf16_runner.hidden, generator=gen) * 0.5).bfloat16() for n in (7, 19)]
    rows = [PrefillRow(torch.cat([begin, end]), None) for end in ends]
    with torch.inference_mode():
        assert shared_prefix(bf16_runner, rows) == 40
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            together = last_hidden(bf16_runner, rows)
        alone = torch.cat([last_hidden(bf16_runner, [row]) for row in rows])
    assert "aten::scaled_dot_product_attention" not in {e.key for e in prof.key_averages()}
    torch.testing.assert_close(together.float(), alone.float(), rtol=3e-2, atol=3e-2)
