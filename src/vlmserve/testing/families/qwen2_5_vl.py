"""Tiny Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): images and video, M-RoPE.

Like ``Qwen/Qwen2.5-VL-7B-Instruct`` with every dimension tiny: windowed-attention ViT with
one full-attention block, 14-px patches merged 2x2, ``second_per_grid_ts`` for video.
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
from vlmserve.testing.tiny import mrope_section
from vlmserve.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN

__all__ = ["FAMILY", "build"]

FAMILY = "qwen2_5_vl"


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny Qwen2.5-VL checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir)


def _write(out: Path) -> None:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = family_tokenizer(eos=EOS_TOKEN, pad=PAD_TOKEN)
    ids = qwen_tokens(tokenizer, EOS_TOKEN, PAD_TOKEN)
    eos, pad = ids.pop("eos"), ids.pop("pad")
    config = Qwen2_5_VLConfig(
        text_config=_text(len(tokenizer), pad, eos),
        vision_config=_vision(),
        tie_word_embeddings=True,
        **ids,
    )
    size = {"shortest_edge": SPEC.min_pixels, "longest_edge": SPEC.max_pixels}
    common = {"size": size, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**common, cap_pixels_per_frame=True),
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=Qwen2_5_VLForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos, pad],
        pad_id=pad,
    )


def _text(vocab_size: int, pad: int, eos: int) -> dict[str, Any]:
    return text_config(
        vocab_size,
        max_window_layers=SPEC.num_hidden_layers,
        use_sliding_window=False,
        hidden_act="silu",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": mrope_section(SPEC.head_dim),
        },
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=True,
    )


def _vision() -> dict[str, Any]:
    return qwen_vision(
        14,
        "silu",
        window_size=112,
        fullatt_block_indexes=[SPEC.vision_depth - 1],
        tokens_per_second=2,
    )
