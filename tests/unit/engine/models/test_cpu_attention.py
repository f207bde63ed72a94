"""CPU decode attention read in place from the paged cache (``cpu_attention.py``, the C
kernel ``cpu_decode.c``).

Pinned on the tiny real Qwen2-VL's runner, in float32 and bfloat16: a decode step never
gathers the rows' blocks (``PagedKVCache.gather`` raises); a row's logits are bit-identical
alone, in a batch of 8 and of 32 rows of other lengths, and at 1 and 2 threads; the logits
match the gathered path's within float rounding (bf16 with AVX512-BF16: within a stated
bound, the same greedy token wherever the top two are further apart). On the kernel alone:
it equals the float32 reference at real head layouts, block sizes and dtypes, past 4,096
keys and across block boundaries; a NaN in one row's keys poisons that row only; a table or
length out of the cache's range is refused before anything is read. Without a C compiler
decode gathers as before and says why; a built kernel is cached and found again.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.unit.engine.models.test_attention_kernels import BLOCK, lengths_for, prefilled, prompts
from transformers import AutoModelForImageTextToText

from vlmserve.engine.core.kv_cache import PagedKVCache
from vlmserve.engine.models import cpu_attention
from vlmserve.engine.models.cpu_attention import CpuPagedAttention, paged_decode
from vlmserve.engine.models.runner import Qwen2VLRunner

BF16_LOGITS = 0.1  # bf16 decode on AVX512-BF16 against float32 attention (docs/engine.md)


def _runner(tiny_dir: Path, dtype: torch.dtype) -> Qwen2VLRunner:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=dtype).eval()
    r = Qwen2VLRunner(model)
    r.allocate_cache(num_blocks=40 * 12 + 1, block_size=BLOCK)
    return r


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def compiled(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[Qwen2VLRunner]:
    r = _runner(tiny_dir, request.param)
    how = r.use_compiled_attention()
    assert how.startswith("paged attention, CPU kernel"), how
    yield r


@pytest.fixture(scope="module")
def kernel() -> CpuPagedAttention:
    return CpuPagedAttention()


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    def gather(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode gathered the rows' blocks")

    monkeypatch.setattr(PagedKVCache, "gather", gather)


@pytest.mark.usefixtures("threads")
def test_a_rows_logits_are_bit_identical_alone_in_8_and_in_32_rows_at_any_thread_count(
    compiled: Qwen2VLRunner, no_gather: None
) -> None:
    rows = prompts(compiled, lengths_for(32))
    with torch.inference_mode():
        torch.set_num_threads(2)
        batch = compiled.decode(**prefilled(compiled, rows))
        torch.set_num_threads(1)
        eight = compiled.decode(**prefilled(compiled, rows[:8]))
        for i in (0, 5, 7, 17, 31):  # short and long rows, tables padded by up to 10 blocks
            alone = compiled.decode(**prefilled(compiled, [rows[i]]))
            assert torch.equal(alone[0], batch[i]), f"row {i} alone vs 32"
            if i < 8:
                assert torch.equal(eight[i], batch[i]), f"row {i} in 8 vs 32"


def test_kernel_logits_match_the_gathered_path(compiled: Qwen2VLRunner) -> None:
    """float32: equal to float rounding. bf16: where the build has AVX512-BF16 the kernel
    rounds the probabilities to bf16 for the value sums (as torch's and transformers' bf16
    attention do) and the gathered path sums them in float32, so the logits are within
    ``BF16_LOGITS`` (about three bf16 units at these magnitudes; 0.06 at most was seen) and
    the greedy token is the same wherever the gathered path's top two are more than twice
    that apart (neither of two logits moving by more than the bound can swap them)."""
    torch.manual_seed(0)  # ``prompts`` draws each row's next token from the global generator
    step = prefilled(compiled, prompts(compiled, lengths_for(8)))
    attend = compiled.compiled
    with torch.inference_mode():
        got = compiled.decode(**step)
        compiled.compiled = None
        try:
            want = compiled.decode(**step)  # writes the same token's K/V again
        finally:
            compiled.compiled = attend
    if compiled.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        return
    assert float((got.float() - want.float()).abs().max()) <= BF16_LOGITS
    top = want.float().topk(2, dim=-1).values
    clear = top[:, 0] - top[:, 1] > 2 * BF16_LOGITS
    assert clear.sum() >= 2  # rows decided by more than the bound: the check is not vacuous
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def _paged(
    lengths: list[int], kv_heads: int, rep: int, dim: int, block: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """A cache holding each row's keys in shuffled blocks, tables padded with the null
    block to the widest row, and one query per head."""
    gen = torch.Generator().manual_seed(len(lengths) * 131 + dim + block)
    need = [-(-n // block) for n in lengths]
    blocks = 1 + sum(need)
    k, v = (torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    k[0], v[0] = 0, 0  # the null block
    ids = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lengths), max(need), dtype=torch.long)
    for row, n in enumerate(need):
        tables[row, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    q = torch.randn(len(lengths), kv_heads * rep, dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lengths)


@pytest.mark.parametrize(
    ("kv_heads", "rep", "dim", "block"),
    [
        (4, 4, 64, 16),
        (2, 6, 128, 16),
        (4, 7, 128, 16),
        (8, 1, 80, 32),
        (2, 8, 32, 8),
        (16, 8, 128, 16),  # more query heads x dim than one work unit holds
        (2, 3, 256, 32),  # bf16 dot products: widest head, an odd head count
        (1, 5, 96, 16),  # dim a multiple of 32 but not of 64
        (2, 2, 36, 12),  # dim and block not multiples of 8: the untiled loops
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_equals_the_float32_reference(
    kernel: CpuPagedAttention, kv_heads: int, rep: int, dim: int, block: int, dtype: torch.dtype
) -> None:
    if not kernel.supports(dtype):
        pytest.skip(f"the C compiler has no {dtype}")
    # one key, a block boundary either side, past 4,096 keys
    lengths = [1, block, block + 1, 3 * block - 1, 4100]
    q, k, v, tables, lens = _paged(lengths, kv_heads, rep, dim, block, dtype)
    got = kernel(q, k, v, tables, lens, dim**-0.5)
    want = paged_decode(q, k, v, tables, lens, dim**-0.5)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # both round one float32 result to 8 or 11 bits: one unit apart at most
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_a_nan_in_one_rows_keys_poisons_that_row_only(kernel: CpuPagedAttention) -> None:
    q, k, v, tables, lens = _paged([40, 40, 40], 2, 4, 64, 16, torch.bfloat16)
    k[tables[1, 1], 3, 0, 5] = float("nan")  # row 1's 20th key, KV head 0
    out = kernel(q, k, v, tables, lens, 0.125)
    assert torch.isnan(out[1, :4]).all()  # KV head 0's query heads
    assert torch.isfinite(out[1, 4:]).all() and torch.isfinite(out[[0, 2]]).all()


def test_a_table_or_length_out_of_the_caches_range_is_refused(
    kernel: CpuPagedAttention,
) -> None:
    q, k, v, tables, lens = _paged([20, 9], 2, 2, 32, 16, torch.float32)
    for bad_tables, bad_lens in (
        (tables, torch.tensor([20, 33])),  # past the row's two-block table
        (tables, torch.tensor([20, 0])),
        (tables.clone().fill_(k.shape[0]), lens),  # a block the cache does not have
    ):
        with pytest.raises(ValueError, match="out of the cache's range"):
            kernel(q, k, v, bad_tables, bad_lens, 0.125)


def test_a_built_kernel_is_cached_and_loaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLMSERVE_KERNEL_CACHE", str(tmp_path))
    first = cpu_attention.build_library()
    assert first.parent == tmp_path and first.exists()
    built = first.stat().st_mtime_ns
    assert cpu_attention.build_library() == first
    assert first.stat().st_mtime_ns == built  # found, not built again
    if platform.machine() == "x86_64":  # another target ISA: another library
        other = "default" if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2" else "avx2"
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", other)
        assert cpu_attention.build_library() != first


def test_without_a_c_compiler_decode_gathers_and_says_why(
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("VLMSERVE_KERNEL_CACHE", str(tmp_path))  # nothing built before
    monkeypatch.setenv("CC", "/nonexistent/cc")
    r = _runner(tiny_dir, torch.float32)
    how = r.use_compiled_attention()
    assert how.startswith("gathered attention (building the CPU kernel failed"), how
    assert r.compiled is None
    assert "no working C compiler (/nonexistent/cc; set CC)" in caplog.text
    with torch.inference_mode():
        logits = r.decode(**prefilled(r, prompts(r, lengths_for(2))))
    assert torch.isfinite(logits).all()
