"""Tiny Gemma 3 (``Gemma3ForConditionalGeneration``): SigLIP tower, sliding + global layers.

Like ``google/gemma-3-4b-it`` with every dimension tiny: a fixed-size image pooled to
``mm_tokens_per_image`` soft tokens between ``<start_of_image>``/``<end_of_image>``, attended
bidirectionally; one sliding-window and one global layer. Images only: no video input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.testing.families._common import (
    SPEC,
    build_cached,
    family_tokenizer,
    read_template,
    save_checkpoint,
    text_config,
    token_ids,
    vit_config,
)

__all__ = ["FAMILY", "build"]

FAMILY = "gemma3"
IMAGE_SIZE = 56
PATCH = 14
MM_TOKENS = 4  # (56 / 14)**2 = 16 patches pooled 2x2
VERSION = 1  # 1: the projector drawn at random (Gemma 3 initialises it to zeros)
NAMED = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
BOS, EOS, EOT, PAD = "<bos>", "<eos>", "<end_of_turn>", "<pad>"


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny Gemma 3 checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir, version=VERSION)


def _write(out: Path) -> None:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    tokenizer = family_tokenizer(
        named=NAMED, extra=("<start_of_turn>", EOT), eos=EOS, pad=PAD, bos=BOS
    )
    bos, eos, eot, pad = token_ids(tokenizer, BOS, EOS, EOT, PAD)
    boi, image, eoi = token_ids(tokenizer, *NAMED.values())
    config = Gemma3Config(
        text_config=_text(len(tokenizer), bos=bos, eos=eos, pad=pad),
        vision_config=_vision(),
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
        tie_word_embeddings=False,  # tied, greedy decoding of random weights only repeats "\n"
    )
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer,
        image_seq_length=MM_TOKENS,
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=Gemma3ForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos, eot],
        pad_id=pad,
        bos_id=bos,
        randomize=["model.multi_modal_projector.mm_input_projection_weight"],
    )


def _text(vocab_size: int, *, bos: int, eos: int, pad: int) -> dict[str, Any]:
    return text_config(
        vocab_size,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=SPEC.head_dim,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"][: SPEC.num_hidden_layers],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )


def _vision() -> dict[str, Any]:
    return vit_config(IMAGE_SIZE, PATCH, model_type="siglip_vision_model", vision_use_head=False)
