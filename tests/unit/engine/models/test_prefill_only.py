"""Prefill-only rows (``last_hidden``): each packed row's last-token final hidden state equals
transformers' forward of that prompt alone, and no KV cache is needed, written or kept; rows
that begin alike run that beginning once and still give each prompt's own state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmserve.engine.models import prefill_only
from vlmserve.engine.models.architectures import build
from vlmserve.engine.models.batch import PrefillRow
from vlmserve.engine.models.prefill_only import SHARED_MIN, last_hidden, shared_prefix
from vlmserve.engine.models.vision_cache import VisionCache
from vlmserve.testing.media import gradient_image

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> tuple[Any, Any]:
    """The tiny Qwen2-VL in float32 (eval) and its processor, loaded once for the module."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(tiny_dir)


def prompts(processor: Any) -> list[dict[str, Any]]:
    """A text prompt, an image prompt and a longer text prompt, each processed alone."""
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    return [
        dict(processor(text=["a cat sits on the mat"], return_tensors="pt")),
        dict(
            processor(
                text=[f"{image}what is in the picture?"],
                images=[gradient_image(64, 48, seed=2)],
                return_tensors="pt",
            )
        ),
        dict(processor(text=["the sun is red and the car is fast " * 4], return_tensors="pt")),
    ]


def reference(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    return out.hidden_states[-1][0, -1]  # final norm applied: the last entry


def test_packed_rows_give_each_prompts_own_last_hidden_state_without_a_cache(
    tiny: tuple[Any, Any],
) -> None:
    model, processor = tiny
    inputs = prompts(processor)
    expected = torch.stack([reference(model, i) for i in inputs])
    runner, embedder = build(model, VisionCache(1 << 20))
    with torch.inference_mode():
        rows = [embedder.build(i).row for i in inputs]
        packed = last_hidden(runner, rows)
        alone = torch.cat([last_hidden(runner, [row]) for row in rows])
    assert runner.cache is None  # nothing was allocated for it
    assert packed.shape == (3, runner.hidden)
    assert (packed - expected).abs().max() < TOL
    assert (alone - expected).abs().max() < TOL


def test_an_allocated_cache_is_neither_read_nor_written(tiny: tuple[Any, Any]) -> None:
    model, processor = tiny
    runner, embedder = build(model, VisionCache(0))
    cache = runner.allocate_cache(8, 16)
    cache.k.fill_(float("nan"))  # any read of it would turn the outputs into NaN
    cache.v.fill_(float("nan"))
    with torch.inference_mode():
        rows = [embedder.build(i).row for i in prompts(processor)]
        out = last_hidden(runner, rows)
    assert not out.isnan().any()
    assert cache.k.isnan().all() and cache.v.isnan().all()  # nothing written


def test_a_row_after_a_cached_prefix_is_refused(tiny: tuple[Any, Any]) -> None:
    model, processor = tiny
    runner, embedder = build(model, VisionCache(0))
    row = embedder.build(prompts(processor)[0]).row
    row.cached = 4
    with pytest.raises(ValueError, match="cached prefix"):
        last_hidden(runner, [row])


def alike(processor: Any) -> list[dict[str, Any]]:
    """Prompts that begin alike (an image, then an instruction) and end apart, as a
    reranker's pairs of one query do; the last is the second with more after it."""
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    picture = gradient_image(64, 48, seed=3)
    begin = f"{image}judge whether the document fits the query about the red car: "
    ends = ["the dog runs", "a blue sky over the city at night", "a blue sky over the river"]
    return [
        dict(processor(text=[begin + end], images=[picture], return_tensors="pt")) for end in ends
    ]


def test_rows_that_begin_alike_share_it_and_each_gets_its_own_state(tiny: tuple[Any, Any]) -> None:
    model, processor = tiny
    inputs = alike(processor)
    ids = [i["input_ids"][0] for i in inputs]
    common = next(j for j in range(ids[0].shape[0]) if len({int(x[j]) for x in ids}) > 1)
    expected = torch.stack([reference(model, i) for i in inputs])
    runner, embedder = build(model, VisionCache(1 << 20))
    with torch.inference_mode():
        rows = [embedder.build(i).row for i in inputs]
        assert shared_prefix(runner, rows) == common > SHARED_MIN  # the image and instruction
        assert shared_prefix(runner, rows[1:]) > common  # those two go on alike for longer
        packed = last_hidden(runner, rows)
        pair = last_hidden(runner, rows[1:])
        alone = torch.cat([last_hidden(runner, [row]) for row in rows])
    assert (packed - expected).abs().max() < TOL
    assert (pair - expected[1:]).abs().max() < TOL
    assert (alone - expected).abs().max() < TOL


def test_the_shared_beginning_is_computed_once(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, processor = tiny
    runner, embedder = build(model, VisionCache(1 << 20))
    seen: list[int] = []
    qkv = runner._qkv

    def counting(x: torch.Tensor, *args: Any) -> Any:
        seen.append(x.shape[0])
        return qkv(x, *args)

    monkeypatch.setattr(runner, "_qkv", counting)
    with torch.inference_mode():
        rows = [embedder.build(i).row for i in alike(processor)]
        shared = shared_prefix(runner, rows)
        last_hidden(runner, rows)
    lengths = [row.embeds.shape[0] for row in rows]
    assert seen[0] == shared + sum(n - shared for n in lengths) < sum(lengths)


def test_short_or_absent_common_beginnings_are_not_shared(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, processor = tiny
    runner, embedder = build(model, VisionCache(1 << 20))
    with torch.inference_mode():
        rows = [embedder.build(i).row for i in alike(processor)]
        different = [embedder.build(i).row for i in prompts(processor)]
        assert shared_prefix(runner, rows[:1]) == 0  # one row: nothing to share with
        assert shared_prefix(runner, different) == 0
        same = [rows[0], rows[0]]  # identical rows keep their last token each
        assert shared_prefix(runner, same) == rows[0].embeds.shape[0] - 1
        common = shared_prefix(runner, rows)
        monkeypatch.setattr(prefill_only, "SHARED_MIN", common + 1)
        assert shared_prefix(runner, rows) == 0


def _rows_alike(runner: Any, common: int, ends: tuple[int, ...]) -> list[PrefillRow]:
    """Random rows with their first ``common`` embeddings equal and the rest apart."""
    gen = torch.Generator().manual_seed(common)
    begin = torch.randn(common, runner.hidden, generator=gen)
    return [
        PrefillRow(torch.cat([begin, torch.randn(n, runner.hidden, generator=gen)]), None)
        for n in ends
    ]


def test_the_common_length_is_shared_from_the_threshold_on(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    runner, _ = build(model, VisionCache(0))
    assert shared_prefix(runner, _rows_alike(runner, SHARED_MIN, (3, 5))) == SHARED_MIN
    assert shared_prefix(runner, _rows_alike(runner, SHARED_MIN - 1, (3, 5))) == 0


def test_equal_embeddings_at_other_positions_are_not_shared(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    runner, _ = build(model, VisionCache(0))
    rows = _rows_alike(runner, 40, (3, 5))
    t = rows[1].embeds.shape[0]
    moved = torch.arange(t).expand(3, t).clone()
    moved[:, 30:] += 7  # as if a picture before token 30 took more positions in this row
    rows[1].positions = moved
    assert shared_prefix(runner, rows) == 30
    with torch.inference_mode():
        together = last_hidden(runner, rows)
        alone = torch.cat([last_hidden(runner, [row]) for row in rows])
    assert (together - alone).abs().max() < TOL


def test_rows_with_a_family_mask_are_not_shared(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = tiny
    runner, _ = build(model, VisionCache(0))
    rows = _rows_alike(runner, 40, (3, 5))
    masked = rows[1]
    monkeypatch.setattr(
        runner, "_prefill_masks", lambda row: {"sliding": torch.ones(1)} if row is masked else {}
    )
    assert shared_prefix(runner, rows) == 0
