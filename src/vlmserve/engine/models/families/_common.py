"""Checks and runner construction the family adapters share."""

from __future__ import annotations

from typing import Any

from vlmserve.engine.models.runner import DecoderRunner

__all__ = ["decoder_ok", "new_runner", "qwen2_or_llama_ok"]


def decoder_ok(text: Any, *, rope_types: tuple[str, ...]) -> bool:
    """A decoder the runner computes exactly as transformers does: SiLU gated MLP and a
    rotary embedding whose frequencies do not change with the sequence length."""
    rope = getattr(text, "rope_parameters", None) or {}
    return rope.get("rope_type", "default") in rope_types and text.hidden_act == "silu"


def qwen2_or_llama_ok(model: Any) -> bool:
    """A Qwen2 or Llama decoder with plain RoPE and no sliding window (LLaVA-OneVision,
    InternVL)."""
    text = model.config.get_text_config()
    return (
        text.model_type in ("qwen2", "llama")
        and decoder_ok(text, rope_types=("default",))
        and not getattr(text, "use_sliding_window", False)
    )


def new_runner(
    model: Any, lm: Any, sections: list[int] | None, *, interleaved: bool = False
) -> DecoderRunner:
    """The batched runner over decoder stack ``lm`` of ``model`` (whose ``lm_head`` gives
    the logits); ``sections``: M-RoPE sections (None: 1-D RoPE); ``interleaved``: Qwen3-VL's
    layout of them."""
    if sections is None:
        sections = [int(lm.rotary_emb.inv_freq.numel())]  # one section: every dim 1-D
    return DecoderRunner(model, lm, sections=list(sections), interleaved=interleaved)
