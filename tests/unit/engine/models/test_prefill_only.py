"""Prefill-only rows (``last_hidden``): each packed row's last-token final hidden state equals
transformers' forward of that prompt alone, and no KV cache is needed, written or kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmserve.engine.models.architectures import build
from vlmserve.engine.models.prefill_only import last_hidden
from vlmserve.engine.models.vision_cache import VisionCache
from vlmserve.testing.media import gradient_image

TOL = 1e-4


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
    tiny_dir: Path,
) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_dir)
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


def test_an_allocated_cache_is_neither_read_nor_written(tiny_dir: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_dir)
    runner, embedder = build(model, VisionCache(0))
    cache = runner.allocate_cache(8, 16)
    cache.k.fill_(float("nan"))  # any read of it would turn the outputs into NaN
    cache.v.fill_(float("nan"))
    with torch.inference_mode():
        rows = [embedder.build(i).row for i in prompts(processor)]
        out = last_hidden(runner, rows)
    assert not out.isnan().any()
    assert cache.k.isnan().all() and cache.v.isnan().all()  # nothing written


def test_a_row_after_a_cached_prefix_is_refused(tiny_dir: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    runner, embedder = build(model, VisionCache(0))
    processor = AutoProcessor.from_pretrained(tiny_dir)
    row = embedder.build(prompts(processor)[0]).row
    row.cached = 4
    with pytest.raises(ValueError, match="cached prefix"):
        last_hidden(runner, [row])
