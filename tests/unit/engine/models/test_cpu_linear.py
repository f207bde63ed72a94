"""Decode rows' linear layers in bfloat16 on AVX512-BF16 (``cpu_linear.c`` through
``CpuPagedAttention.linear``, used by ``Linear`` for a step's decode rows).

Pinned on the kernel: its product equals the float32 one rounded to bf16 (within one bf16
unit), with and without bias, for 1 to 9 rows, output counts that are not a multiple of its
blocks and strided input rows; a row's result is bit-identical alone, in any batch and at
1 and 2 threads; a weight it cannot take is refused. On ``Linear``: a call's decode rows
are the kernel's product and its prompt rows the BLAS product; a weight whose packing
waited for the kernel is packed when no kernel takes it. On the tiny Qwen2-VL's bf16
runner: every linear is on the kernel, and a decode row's logits are the same in a step of
its own and in a step where a prompt is prefilled beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.unit.engine.models.test_attention_kernels import BLOCK, lengths_for, prefilled, prompts
from torch import nn
from transformers import AutoModelForImageTextToText

from vlmserve.engine.models.batch import DecodeRows, PrefillRow
from vlmserve.engine.models.cpu_attention import CpuPagedAttention
from vlmserve.engine.models.cpu_kernels import linears_of
from vlmserve.engine.models.linear import Linear, _Slice, can_pack, fuse
from vlmserve.engine.models.runner import Qwen2VLRunner


@pytest.fixture(scope="module")
def kernel() -> CpuPagedAttention:
    k = CpuPagedAttention()
    if not k.linears:
        pytest.skip("the bf16 linear kernel needs a build with AVX512-BF16")
    return k


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def _product(kernel: CpuPagedAttention, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    kernel.linear(x, w, b, out)
    return out


@pytest.mark.parametrize(("out", "width"), [(37, 64), (130, 96), (64, 2816), (1536, 1024)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_product_is_the_float32_one_rounded_to_bf16(
    kernel: CpuPagedAttention, out: int, width: int, bias: bool
) -> None:
    w = _bf16(out, width, seed=out + width)
    b = _bf16(out, seed=1) if bias else None
    for rows in (1, 2, 3, 4, 5, 9):
        x = _bf16(rows, width, seed=rows)
        want = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
        got = _product(kernel, x, w, b).float()
        # rounding to bf16 (half a unit, 2^-8 of the value's binade) after float32 sums in
        # another order than the reference's (a few float32 units of the terms' sizes)
        half = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 8)
        terms = x.float().abs() @ w.float().abs().T
        assert bool(((got - want).abs() <= half + 1e-6 * terms).all()), (rows, out, width)


@pytest.mark.usefixtures("threads")
def test_a_rows_result_is_the_same_alone_in_any_batch_and_at_any_thread_count(
    kernel: CpuPagedAttention,
) -> None:
    w, b = _bf16(150, 1024, seed=7), _bf16(150, seed=8)
    x = _bf16(18, 1024, seed=9)
    torch.set_num_threads(2)
    batch = _product(kernel, x, w, b)
    strided = _product(kernel, x[::2], w, b)  # rows 2 apart in memory
    torch.set_num_threads(1)
    for i in (0, 1, 4, 9, 17):
        alone = _product(kernel, x[i : i + 1], w, b)
        assert torch.equal(alone[0], batch[i]), f"row {i} alone vs 18"
        for size in (2, 5, 8):
            start = max(0, min(i - 1, 18 - size))
            some = _product(kernel, x[start : start + size], w, b)
            assert torch.equal(some[i - start], batch[i]), f"row {i} in {size}"
        if i % 2 == 0:
            assert torch.equal(strided[i // 2], batch[i])


def test_a_weight_it_cannot_take_is_refused(kernel: CpuPagedAttention) -> None:
    odd = _bf16(16, 40, seed=3)  # in not a multiple of 32
    assert not kernel.takes_weight(odd)
    assert not kernel.takes_weight(_bf16(16, 64, seed=3).float())
    assert not kernel.takes_weight(_bf16(64, 16, seed=3).T)  # not contiguous
    with pytest.raises(ValueError, match="takes no"):
        _product(kernel, _bf16(2, 40, seed=4), odd, None)
    with pytest.raises(ValueError, match="unit stride"):
        w = _bf16(16, 64, seed=5)
        kernel.linear(_bf16(2, 64, seed=6), w, None, torch.empty(16, 2, dtype=torch.bfloat16).T)


def test_decode_rows_take_the_kernel_and_prompt_rows_the_blas_product(
    kernel: CpuPagedAttention,
) -> None:
    w, b = _bf16(96, 128, seed=11), _bf16(96, seed=12)
    lin = Linear(w, b, False, 96)
    x = _bf16(7, 128, seed=13)
    blas = lin(x)
    assert lin.use_kernel(kernel)
    assert torch.equal(lin(x), blas)  # no decode rows: all BLAS
    mixed = lin(x, 3)
    assert torch.equal(mixed[:3], _product(kernel, x[:3], w, b))
    assert torch.equal(mixed[3:], blas[3:])
    assert torch.equal(lin(x, 7), _product(kernel, x, w, b))
    assert torch.equal(lin(x, 9), _product(kernel, x, w, b))  # more decode rows than rows


def test_a_weight_whose_packing_waited_is_packed_when_no_kernel_takes_it() -> None:
    owner = nn.Module()
    owner.a = nn.Linear(1024, 512, bias=False, dtype=torch.bfloat16)
    owner.b = nn.Linear(1024, 512, bias=False, dtype=torch.bfloat16)
    x = _bf16(5, 1024, seed=14)
    want = torch.cat([owner.a(x), owner.b(x)], dim=-1)
    lin = fuse(owner, ["a", "b"], later=True)
    if not can_pack(lin.weight):
        pytest.skip("oneDNN has no bf16 packing on this CPU")
    assert not lin.packed and lin.pending is not None
    assert owner.a.weight.data_ptr() == lin.weight.data_ptr()  # one copy, re-pointed
    lin.settle()
    assert lin.packed and lin.pending is None
    assert isinstance(owner.a, _Slice) and isinstance(owner.b, _Slice)
    torch.testing.assert_close(lin(x), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(owner.b(x), want[:, 512:], rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def runner(tiny_dir: Path, kernel: CpuPagedAttention) -> Qwen2VLRunner:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    r = Qwen2VLRunner(model)
    r.allocate_cache(num_blocks=40 * 12 + 1, block_size=BLOCK)
    how = r.use_compiled_attention()
    linears = linears_of(r)
    assert f"bf16 linears for decode rows ({len(linears)} weights)" in how, how
    assert all(lin.kernel is not None for lin in linears)
    return r


def test_a_decode_rows_logits_are_the_same_beside_a_prompt(runner: Qwen2VLRunner) -> None:
    step = prefilled(runner, prompts(runner, lengths_for(3)))
    gen = torch.Generator().manual_seed(5)
    newcomer = (torch.randn(37, runner.hidden, generator=gen) * 0.5).to(runner.dtype)
    first = 400  # blocks past the decode rows' own
    slots = [(first + i // BLOCK) * BLOCK + i % BLOCK for i in range(37)]
    rows = DecodeRows(step["tokens"], step["positions"], step["lengths"], step["tables"])
    with torch.inference_mode():
        alone = runner.decode(**step)
        mixed = runner.step([PrefillRow(newcomer, None, slots)], rows)
    assert mixed.shape[0] == 4
    assert torch.equal(mixed[:3], alone)
