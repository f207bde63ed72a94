"""Tiny LLaVA-1.5 (``LlavaForConditionalGeneration``): CLIP tower, MLP projector, Llama decoder.

Like ``llava-hf/llava-1.5-7b-hf`` with every dimension tiny: one fixed-size
image -> ``(image_size / patch)**2`` ``<image>`` tokens. Images only: no video input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.testing.families._common import (
    SPEC,
    build_cached,
    family_tokenizer,
    hub_vision_names,
    read_template,
    save_checkpoint,
    text_config,
    token_ids,
    vit_config,
)

__all__ = ["FAMILY", "build"]

FAMILY = "llava"
IMAGE_SIZE = 56
PATCH = 14


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny LLaVA-1.5 checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir, version=2)


def _write(out: Path) -> None:
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = family_tokenizer(extra=("<image>",), eos="</s>", pad="<pad>", bos="<s>")
    bos, eos, pad, image = token_ids(tokenizer, "<s>", "</s>", "<pad>", "<image>")
    text = text_config(len(tokenizer), model_type="llama", hidden_act="silu")
    text.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)
    config = LlavaConfig(
        vision_config=_vision(),
        text_config=text,
        image_token_index=image,
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        ),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=LlavaForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos],
        pad_id=pad,
        bos_id=bos,
    )
    hub_vision_names(out)  # vLLM loads only the hub's weight names


def _vision() -> dict[str, Any]:
    return vit_config(
        IMAGE_SIZE,
        PATCH,
        model_type="clip_vision_model",
        projection_dim=SPEC.vision_embed_dim,
        hidden_act="quick_gelu",
    )
