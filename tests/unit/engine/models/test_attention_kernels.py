"""Decode attention over the paged cache: one kernel per layer, batch invariant, exact.

Pinned on the tiny real Qwen2-VL's runner: one decode step calls
``aten::scaled_dot_product_attention`` exactly once per layer whatever the batch size (1, 8,
32; it was once per row per layer); a row's logits are bit-identical alone and inside a
batch of rows of other lengths (the padded, masked batch does not change its rounding);
and they match attention over exactly that row's keys within float32 tolerance. The
attention layout alone is also pinned at the head ratios of the medium checkpoint and of
real Qwen2-VL-2B/7B.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForImageTextToText

from vlmserve.engine.core.block_manager import BlockManager
from vlmserve.engine.models.runner import PrefillRow, Qwen2VLRunner

BLOCK = 16
SDPA = "aten::scaled_dot_product_attention"


@pytest.fixture(scope="module")
def runner(tiny_dir: Path) -> Iterator[Qwen2VLRunner]:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    r = Qwen2VLRunner(model)
    r.allocate_cache(num_blocks=40 * 12 + 1, block_size=BLOCK)
    yield r


def prompts(runner: Qwen2VLRunner, lengths: list[int]) -> list[tuple[torch.Tensor, int]]:
    """Random prompt embeddings [n, hidden] of ``lengths`` tokens and a next token each."""
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(n, runner.hidden, generator=gen) * 0.5, int(torch.randint(0, 1000, ())))
        for n in lengths
    ]


def prefilled(runner: Qwen2VLRunner, rows: list[tuple[torch.Tensor, int]]) -> dict[str, Any]:
    """Prefill ``rows`` into fresh blocks; -> the arguments of their next decode step."""
    assert runner.cache is not None
    blocks = BlockManager(runner.cache.num_blocks, BLOCK)
    prefill, tables = [], []
    for embeds, _ in rows:
        n, table = embeds.shape[0], []
        blocks.allocate(table, n + 1)  # the prompt and the decoded token
        runner.cache.clear(blocks.take_fresh())
        prefill.append(PrefillRow(embeds, None, [blocks.slot(table, i) for i in range(n)]))
        tables.append(table)
    with torch.inference_mode():
        runner.prefill(prefill)
    lengths = [embeds.shape[0] for embeds, _ in rows]
    tokens = [token for _, token in rows]
    return {"tokens": tokens, "positions": lengths, "lengths": lengths, "tables": tables}


def lengths_for(batch: int) -> list[int]:
    return [17 + (37 * i) % 160 for i in range(batch)]


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_one_decode_step_runs_one_attention_kernel_per_layer(
    runner: Qwen2VLRunner, batch: int
) -> None:
    step = prefilled(runner, prompts(runner, lengths_for(batch)))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.decode(**step)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get(SDPA) == len(runner.layers) == 2
    # nothing else computes attention on the side (no per-row loop, no math fallback)
    assert calls.get("aten::_scaled_dot_product_flash_attention_for_cpu") == len(runner.layers)
    assert "aten::_softmax" not in calls


@pytest.fixture
def one_thread() -> Iterator[None]:
    """As the engine runs a model this small (multi-threaded GEMMs split rows by count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_a_rows_logits_are_bit_identical_alone_and_in_a_batch(runner: Qwen2VLRunner) -> None:
    rows = prompts(runner, lengths_for(32))
    with torch.inference_mode():
        batch = runner.decode(**prefilled(runner, rows))
        for i in (0, 5, 17, 31):  # short and long rows, padded by up to 10 blocks in the batch
            alone = runner.decode(**prefilled(runner, [rows[i]]))
            assert torch.equal(alone[0], batch[i]), f"row {i}"


def test_paged_attention_matches_attention_over_each_rows_own_keys(
    runner: Qwen2VLRunner,
) -> None:
    """The masked batched kernel vs SDPA per row over exactly its keys (no padding)."""
    assert runner.cache is not None
    step = prefilled(runner, prompts(runner, lengths_for(8)))
    gen = torch.Generator().manual_seed(1)
    b, h, d = 8, runner.heads, runner.head_dim
    q = torch.randn(b, h, d, generator=gen)
    width = max(len(t) for t in step["tables"])
    tables = torch.tensor([t + [0] * (width - len(t)) for t in step["tables"]])
    lengths = torch.tensor(step["lengths"]) - 1  # attend to tokens 0..n-1 (all prefilled)
    seen = torch.arange(width * BLOCK)[None] <= lengths[:, None]
    mask = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))[:, None, None]
    with torch.inference_mode():  # as the engine runs
        keys, values = runner.cache.gather(0, tables)  # [B, KVH, L, D]
        got = runner._decode_attention(q, keys, values, mask).view(b, h, d)
        for i, n in enumerate(step["lengths"]):
            want = torch.nn.functional.scaled_dot_product_attention(
                q[i : i + 1, :, None],
                keys[i : i + 1, :, :n],
                values[i : i + 1, :, :n],
                scale=runner.scale,
                enable_gqa=True,
            )[0, :, 0]
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("kv_heads", "rep", "head_dim"), [(4, 4, 64), (2, 6, 128), (4, 7, 128)])
def test_the_decode_layout_is_batch_invariant_at_real_head_ratios(
    kv_heads: int, rep: int, head_dim: int
) -> None:
    """Medium (16/4 heads), Qwen2-VL-2B (12/2), -7B (28/4): grouping a KV head's ``rep``
    query heads as ``rep`` queries rounds differently as the padding changes (rep >= 4);
    one query per head does not."""
    gen = torch.Generator().manual_seed(0)
    lengths = [23, 160, 47, 300, 95, 17, 211, 128]
    width = -(-max(lengths) // BLOCK) * BLOCK
    q = torch.randn(len(lengths), kv_heads * rep, head_dim, generator=gen)
    keys = torch.randn(len(lengths), kv_heads, width, head_dim, generator=gen)
    values = torch.randn(len(lengths), kv_heads, width, head_dim, generator=gen)
    stub = SimpleNamespace(scale=head_dim**-0.5)

    def attend(rows: list[int], padded: int) -> torch.Tensor:
        n = torch.tensor([lengths[i] for i in rows])
        seen = torch.arange(padded)[None] < n[:, None]
        mask = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))[:, None, None]
        k = keys[rows, :, :padded] * seen[:, None, :, None]  # zeros past each row's length
        v = values[rows, :, :padded] * seen[:, None, :, None]
        return Qwen2VLRunner._decode_attention(stub, q[rows], k, v, mask)  # type: ignore[arg-type]

    batch = attend(list(range(len(lengths))), width)
    for i, n in enumerate(lengths):
        alone = attend([i], -(-n // BLOCK) * BLOCK)
        assert torch.equal(alone[0], batch[i]), f"row {i} ({n} tokens)"
