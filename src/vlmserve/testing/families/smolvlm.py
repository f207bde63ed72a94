"""Tiny SmolVLM2 (``SmolVLMForConditionalGeneration``): images and video, Llama-style decoder.

Like ``HuggingFaceTB/SmolVLM2-256M-Video-Instruct`` with every dimension tiny. Video frames
become image tiles with ``Frame from MM:SS:`` timestamps, so the processor needs the clip's fps.
"""

from __future__ import annotations

from pathlib import Path

from vlmserve.testing.families import _idefics
from vlmserve.testing.families._common import (
    build_cached,
    read_template,
    save_checkpoint,
    token_ids,
)

__all__ = ["FAMILY", "build"]

FAMILY = "smolvlm"
BOS, EOS, PAD = "<|im_start|>", "<end_of_utterance>", "<|im_end|>"


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny SmolVLM2 checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir)


def _write(out: Path) -> None:
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    tokenizer = _idefics.tokenizer(bos=BOS, eos=EOS, pad=PAD, extra=("<video>",))
    bos, eos, pad, image = token_ids(tokenizer, BOS, EOS, PAD, "<image>")
    ids = {"bos": bos, "eos": eos, "pad": pad, "image": image}
    config = SmolVLMConfig(**_idefics.config_parts(len(tokenizer), ids))
    tiles = _idefics.tiles()
    processor = SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(**tiles),
        tokenizer=tokenizer,
        video_processor=SmolVLMVideoProcessor(
            size=tiles["max_image_size"], max_image_size=tiles["max_image_size"]
        ),
        image_seq_len=_idefics.SEQ_LEN,
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=SmolVLMForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos],
        pad_id=pad,
        bos_id=bos,
    )
