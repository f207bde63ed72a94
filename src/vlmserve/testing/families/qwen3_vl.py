"""Tiny Qwen3-VL (``Qwen3VLForConditionalGeneration``): images and video, interleaved M-RoPE.

Like ``Qwen/Qwen3-VL-2B-Thinking`` (a thinking model) with every dimension tiny: 16-px
patches merged 2x2, DeepStack features from the first vision block, q/k-normed decoder and
text timestamps (``<0.3 seconds>``) in front of each video frame group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.testing.families._common import (
    SPEC,
    build_cached,
    family_tokenizer,
    qwen_tokens,
    qwen_vision,
    read_template,
    save_checkpoint,
    text_config,
)
from vlmserve.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN

__all__ = ["FAMILY", "build"]

FAMILY = "qwen3_vl"
PATCH = 16
# Qwen3 chat/reasoning tokens the template writes (added tokens in the real tokenizer).
_EXTRA = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny Qwen3-VL checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir)


def interleaved_mrope_section(head_dim: int) -> list[int]:
    """(t, h, w) split of head_dim/2 rotary frequencies, 24:20:20 as in the real model."""
    half = head_dim // 2
    height = half * 20 // 64
    return [half - 2 * height, height, height]


def _write(out: Path) -> None:
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tokenizer = family_tokenizer(extra=_EXTRA, eos=EOS_TOKEN, pad=PAD_TOKEN)
    ids = qwen_tokens(tokenizer, EOS_TOKEN, PAD_TOKEN)
    eos, pad = ids.pop("eos"), ids.pop("pad")
    config = Qwen3VLConfig(
        text_config=_text(len(tokenizer), pad, eos),
        vision_config=_vision(),
        tie_word_embeddings=True,
        **ids,
    )
    unit = (PATCH * 2) ** 2  # one merged token
    size = {"shortest_edge": unit * 4, "longest_edge": unit * 64}
    common = {"size": size, "patch_size": PATCH, "temporal_patch_size": 2, "merge_size": 2}
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common, image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**common, cap_pixels_per_frame=True),
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=Qwen3VLForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos, pad],
        pad_id=pad,
    )


def _text(vocab_size: int, pad: int, eos: int) -> dict[str, Any]:
    return text_config(
        vocab_size,
        hidden_act="silu",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": interleaved_mrope_section(SPEC.head_dim),
            "mrope_interleaved": True,
        },
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=True,
    )


def _vision() -> dict[str, Any]:
    return qwen_vision(
        PATCH, "gelu_pytorch_tanh", num_position_embeddings=256, deepstack_visual_indexes=[0]
    )
