"""The medium checkpoint: a random-weight Qwen2-VL big enough for the maths to matter on CPU.

Hidden 1024, 8 layers, 16 heads (4 KV heads, head_dim 64), ~100M parameters, saved in
bfloat16 as every real Qwen2-VL is. Its processor has Qwen2-VL's real bounds, so media cost
the tokens they cost on the real model: images between 56x56 and 1280x28x28 pixels (the
bounds Qwen2-VL's model card and ``qwen-vl-utils`` use; a 1280x960 photo becomes ~1,200
visual tokens), video frames between 128x28x28 and 768x28x28 pixels (transformers'
``Qwen2VLVideoProcessor`` defaults, as ``qwen-vl-utils``; a 448x448 frame pair is 256
tokens, so 16 frames are ~2,000). 8,192 positions hold the 1k-4k prompts of the benchmarks
with room for their outputs.
"""

from __future__ import annotations

from pathlib import Path

from vlmserve.testing.tiny import TinySpec, build_qwen2_vl

__all__ = [
    "IMAGE_MAX_PIXELS",
    "IMAGE_MIN_PIXELS",
    "VIDEO_MAX_PIXELS",
    "VIDEO_MIN_PIXELS",
    "build_medium",
    "medium_spec",
]

IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 1280
VIDEO_MIN_PIXELS = 28 * 28 * 128
VIDEO_MAX_PIXELS = 28 * 28 * 768


def medium_spec() -> TinySpec:
    return TinySpec(
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=8,
        intermediate_size=2816,
        vision_depth=4,
        vision_embed_dim=256,
        vision_num_heads=4,
        max_position_embeddings=8192,
        min_pixels=IMAGE_MIN_PIXELS,
        max_pixels=IMAGE_MAX_PIXELS,
        video_min_pixels=VIDEO_MIN_PIXELS,
        video_max_pixels=VIDEO_MAX_PIXELS,
        torch_dtype="bfloat16",
    )


def build_medium(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the medium checkpoint directory and return it."""
    return build_qwen2_vl(medium_spec(), out_dir)
