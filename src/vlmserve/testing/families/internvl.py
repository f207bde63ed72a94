"""Tiny InternVL3 (``InternVLForConditionalGeneration``): InternViT tower, Qwen2 decoder.

Like ``OpenGVLab/InternVL3-1B-hf`` with every dimension tiny: 56-px tiles, pixel-unshuffled
to ``image_seq_length`` ``<IMG_CONTEXT>`` tokens between ``<img>``/``</img>``; video frames
become ``FrameN:`` tiles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.testing.families._common import (
    build_cached,
    family_tokenizer,
    read_template,
    save_checkpoint,
    text_config,
    token_ids,
    vit_config,
)
from vlmserve.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN

__all__ = ["FAMILY", "build"]

FAMILY = "internvl"
IMAGE_SIZE = 56
PATCH = 14
SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // 4  # downsample_ratio 0.5 in each direction
NAMED = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny InternVL3 checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir)


def _write(out: Path) -> None:
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    tokenizer = family_tokenizer(named=NAMED, eos=EOS_TOKEN, pad=PAD_TOKEN)
    eos, pad, image = token_ids(tokenizer, EOS_TOKEN, PAD_TOKEN, NAMED["context_image_token"])
    text = text_config(len(tokenizer), model_type="qwen2", hidden_act="silu")
    text.update(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True)
    config = InternVLConfig(
        vision_config=_vision(),
        text_config=text,
        image_token_id=image,
        image_seq_length=SEQ_LEN,
        downsample_ratio=0.5,
        tie_word_embeddings=True,
    )
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=False),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size=size),
        image_seq_length=SEQ_LEN,
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=InternVLForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos, pad],
        pad_id=pad,
    )


def _vision() -> dict[str, Any]:
    return vit_config([IMAGE_SIZE, IMAGE_SIZE], [PATCH, PATCH])
