"""Tiny random-weight checkpoints of each supported VLM family, one module per family.

``FAMILIES`` maps a family name to its builder; every builder is ``build(out_dir=None) ->
Path`` and returns a cached checkpoint directory that ``vlmserve.engine.hf.loading.load_model``
loads like the real model: transformers' own model, config and processor classes, the
family's official chat template (``vlmserve/testing/templates``), tiny dimensions.

    from vlmserve.testing.families import FAMILIES
    path = FAMILIES["llava"]()  # built on first use, then read from the tiny cache

Rerankers (jina-reranker-m0's and Qwen3-VL-Reranker's layouts, random or scripted to a known
ranking) are in ``rerankers.py`` (``RERANKERS``), apart: they score, they do not chat.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vlmserve.testing.families import (
    gemma3,
    idefics3,
    internvl,
    llava,
    llava_onevision,
    qwen2_5_vl,
    qwen3_vl,
    smolvlm,
)
from vlmserve.testing.tiny import build_qwen2_vl

__all__ = ["FAMILIES", "Builder", "build_family"]

Builder = Callable[..., Path]


def _qwen2_vl(out_dir: Path | None = None) -> Path:
    return build_qwen2_vl(out_dir=out_dir)


FAMILIES: dict[str, Builder] = {
    "qwen2_vl": _qwen2_vl,
    qwen2_5_vl.FAMILY: qwen2_5_vl.build,
    qwen3_vl.FAMILY: qwen3_vl.build,
    llava.FAMILY: llava.build,
    llava_onevision.FAMILY: llava_onevision.build,
    idefics3.FAMILY: idefics3.build,
    smolvlm.FAMILY: smolvlm.build,
    gemma3.FAMILY: gemma3.build,
    internvl.FAMILY: internvl.build,
}


def build_family(name: str, out_dir: Path | None = None) -> Path:
    """``FAMILIES[name](out_dir)``, with the known names in the error for an unknown one."""
    try:
        builder = FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise KeyError(f"unknown tiny family {name!r}; known: {known}") from None
    return builder(out_dir=out_dir)
