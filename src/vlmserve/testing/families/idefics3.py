"""Tiny Idefics3 (``Idefics3ForConditionalGeneration``): images only, Llama-3 decoder.

Like ``HuggingFaceM4/Idefics3-8B-Llama3`` with every dimension tiny. It takes no video: the
processor has no video processor and the template has no video part.
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

FAMILY = "idefics3"
BOS, EOS, PAD = "<|begin_of_text|>", "<end_of_utterance>", "<|end_of_text|>"


def build(out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the tiny Idefics3 checkpoint and return its directory."""
    return build_cached(FAMILY, _write, out_dir)


def _write(out: Path) -> None:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tokenizer = _idefics.tokenizer(bos=BOS, eos=EOS, pad=PAD)
    bos, eos, pad, image = token_ids(tokenizer, BOS, EOS, PAD, "<image>")
    ids = {"bos": bos, "eos": eos, "pad": pad, "image": image}
    config = Idefics3Config(**_idefics.config_parts(len(tokenizer), ids))
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(**_idefics.tiles()),
        tokenizer=tokenizer,
        image_seq_len=_idefics.SEQ_LEN,
        chat_template=read_template(FAMILY),
    )
    save_checkpoint(
        out,
        model_class=Idefics3ForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos],
        pad_id=pad,
        bos_id=bos,
    )
