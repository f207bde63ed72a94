"""CPU decode attention read in place from the paged cache (``cpu_attention.py``).

Pinned on the tiny real Qwen2-VL's runner, in float32 and bfloat16: once compiled, a decode
step never gathers the rows' blocks (``PagedKVCache.gather`` raises); a row's logits are
bit-identical alone, in a batch of 8 and in a batch of 32 rows of other lengths; one kernel
serves every batch size and table width (nothing compiles again); the logits match the
gathered path's within float rounding; and where compiling is impossible (no C++ compiler)
decode gathers as before and says why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.unit.engine.models.test_attention_kernels import BLOCK, lengths_for, prefilled, prompts
from torch._dynamo.utils import counters
from transformers import AutoModelForImageTextToText

from vlmserve.engine.core.kv_cache import PagedKVCache
from vlmserve.engine.models.runner import Qwen2VLRunner


def _runner(tiny_dir: Path, dtype: torch.dtype) -> Qwen2VLRunner:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=dtype).eval()
    r = Qwen2VLRunner(model)
    r.allocate_cache(num_blocks=40 * 12 + 1, block_size=BLOCK)
    return r


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def compiled(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[Qwen2VLRunner]:
    r = _runner(tiny_dir, request.param)
    how = r.use_compiled_attention()
    assert how.startswith("paged attention, compiled for CPU"), how
    yield r


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    def gather(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode gathered the rows' blocks")

    monkeypatch.setattr(PagedKVCache, "gather", gather)


@pytest.mark.usefixtures("one_thread")
def test_a_rows_logits_are_bit_identical_alone_in_8_and_in_32_rows(
    compiled: Qwen2VLRunner, no_gather: None
) -> None:
    rows = prompts(compiled, lengths_for(32))
    with torch.inference_mode():
        batch = compiled.decode(**prefilled(compiled, rows))
        eight = compiled.decode(**prefilled(compiled, rows[:8]))
        for i in (0, 5, 7, 17, 31):  # short and long rows, padded by up to 10 blocks
            alone = compiled.decode(**prefilled(compiled, [rows[i]]))
            assert torch.equal(alone[0], batch[i]), f"row {i} alone vs 32"
            if i < 8:
                assert torch.equal(eight[i], batch[i]), f"row {i} in 8 vs 32"


def test_every_batch_size_and_width_runs_the_kernel_compiled_at_start(
    compiled: Qwen2VLRunner, no_gather: None
) -> None:
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for batch in (1, 2, 8, 32):
            compiled.decode(**prefilled(compiled, prompts(compiled, lengths_for(batch))))
        compiled.decode(**prefilled(compiled, prompts(compiled, [5])))  # a one-block table
        # past 4,096 keys (inductor would chunk long float sums: another kernel)
        compiled.decode(**prefilled(compiled, prompts(compiled, [4200, 30])))
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.compiled is not None and not compiled.compiled.broken


def test_compiled_logits_match_the_gathered_path(compiled: Qwen2VLRunner) -> None:
    step = prefilled(compiled, prompts(compiled, lengths_for(8)))
    attend = compiled.compiled
    with torch.inference_mode():
        got = compiled.decode(**step)
        compiled.compiled = None
        try:
            want = compiled.decode(**step)  # writes the same token's K/V again
        finally:
            compiled.compiled = attend
    tol = 1e-4 if compiled.dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_without_a_cpp_compiler_decode_gathers_and_says_why(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/g++",))
    monkeypatch.setattr(inductor, "fx_graph_cache", False)
    torch._dynamo.reset()  # nothing compiled in this process is reused
    try:
        r = _runner(tiny_dir, torch.float32)
        how = r.use_compiled_attention()
        assert how.startswith("gathered attention (compiling failed"), how
        assert r.compiled is None
        assert "compiling failed" in caplog.text
        with torch.inference_mode():
            logits = r.decode(**prefilled(r, prompts(r, lengths_for(2))))
        assert torch.isfinite(logits).all()
    finally:
        torch._dynamo.reset()
