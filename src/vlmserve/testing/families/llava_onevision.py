"""Tiny LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): SigLIP tower, Qwen2 decoder.

Like ``llava-hf/llava-onevision-qwen2-0.5b-ov-hf`` with every dimension tiny: any-resolution
image tiles (one grid pinpoint), and video frames pooled 2x2 per frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.testing.families._common import (
    build_cached,
    family_tokenizer,
    hub_vision_names,
    read_template,
    save_checkpoint,
    text_config,
    token_ids,
    vit_config,
)
from vlmserve.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN

__all__ = ["FAMILY", "build"]

FAMILY = "llava_onevision"
IMAGE_SIZE = 28
PATCH = 14


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny LLaVA-OneVision checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir, version=2)


def _write(out: Path) -> None:
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = family_tokenizer(extra=("<image>", "<video>"), eos=EOS_TOKEN, pad=PAD_TOKEN)
    eos, pad, image, video = token_ids(tokenizer, EOS_TOKEN, PAD_TOKEN, "<image>", "<video>")
    text = text_config(len(tokenizer), model_type="qwen2", hidden_act="silu")
    text.update(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True)
    side, double = IMAGE_SIZE, 2 * IMAGE_SIZE
    pinpoints = [[side, side], [side, double], [double, side]]
    config = LlavaOnevisionConfig(
        vision_config=_vision(),
        text_config=text,
        image_token_index=image,
        video_token_index=video,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=pinpoints,
        tie_word_embeddings=True,
    )
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        num_image_tokens=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_select_strategy="full",
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=LlavaOnevisionForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos, pad],
        pad_id=pad,
    )
    hub_vision_names(out)  # vLLM loads only the hub's weight names


def _vision() -> dict[str, Any]:
    return vit_config(IMAGE_SIZE, PATCH, model_type="siglip_vision_model", vision_use_head=False)
