"""Gemma 3: sliding and global layers, ``(1 + w)`` RMSNorms, bidirectional image attention.

The decoder differs from the Llama shape in ways ``Gemma3Runner`` overrides, each as
``modeling_gemma3`` does it: embeddings scaled by ``sqrt(hidden)`` (an image placeholder
outside the vocabulary embeds as id 0); RMSNorm in float32 times ``1 + w`` (q/k norms
included); norms after attention and after the MLP as well as before; GELU (tanh); scores
scaled by ``query_pre_attn_scalar``; per layer type its own rotary base and mask -- sliding
layers see the last ``sliding_window`` positions; at prefill the tokens of one image attend
to each other both ways (``token_type_ids`` blocks, ``get_block_sequence_ids_for_mask``).
Each image is encoded alone by ``get_image_features`` (SigLIP + pooling projector).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.models.families.llava import LlavaEmbedder
from vlmserve.engine.models.linear import fuse
from vlmserve.engine.models.rope import RotaryTables
from vlmserve.engine.models.runner import DecoderRunner, PrefillRow, _Layer
from vlmserve.engine.models.vision import PromptEmbedder, RowInputs
from vlmserve.engine.models.vision_cache import VisionCache

__all__ = ["MEDIA", "MODEL_TYPES", "Gemma3Embedder", "Gemma3Runner", "build", "supports"]

MODEL_TYPES = ("gemma3",)
MEDIA = MediaRules()  # frame rule and `detail` (families/_media.py)
_SLIDING = "sliding_attention"
_STATIC_ROPE = ("default", "linear")  # frequencies fixed at load (Gemma 3 4B+: linear, x8)


def supports(model: Any) -> bool:
    text = model.config.get_text_config()
    ropes = getattr(text, "rope_parameters", None) or {}
    kinds = set(text.layer_types)
    return (
        getattr(text, "hidden_activation", None) == "gelu_pytorch_tanh"
        and all((ropes.get(kind) or {}).get("rope_type") in _STATIC_ROPE for kind in kinds)
        and text.final_logit_softcapping is None
        and text.attn_logit_softcapping is None
        and not getattr(text, "use_bidirectional_attention", False)
    )


def build(model: Any, cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    runner = Gemma3Runner(model)
    return runner, Gemma3Embedder(model, runner, cache)


@dataclass(slots=True)
class _GemmaLayer(_Layer):
    post_attn: torch.Tensor | None = None  # [hidden] 1 + w, after attention
    post_mlp: torch.Tensor | None = None  # [hidden] 1 + w, after the MLP


def _scale(norm: Any) -> torch.Tensor:
    return 1.0 + norm.weight.float()  # Gemma3RMSNorm multiplies by (1 + w) in float32


class Gemma3Runner(DecoderRunner):
    def __init__(self, model: Any):
        lm = model.model.language_model
        super().__init__(model, lm)
        cfg = lm.config
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = int(cfg.sliding_window)
        self.vocab = int(cfg.vocab_size)
        self.embed_scale = lm.embed_tokens.embed_scale.to(self.dtype)
        self.norm = _scale(lm.norm)

    def _rotary(self, rotary: Any, sections: Any, interleaved: bool) -> dict[str, RotaryTables]:
        tables = {}
        for kind in rotary.layer_types:
            inv_freq = getattr(rotary, f"{kind}_inv_freq")
            scaling = float(getattr(rotary, f"{kind}_attention_scaling"))
            tables[kind] = RotaryTables(
                inv_freq, [inv_freq.numel()], scaling, self.dtype, self.device
            )
        return tables

    def _layer(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _GemmaLayer(
            _scale(layer.input_layernorm),
            fuse(attn, ["q_proj", "k_proj", "v_proj"], later=self.pack_later),
            fuse(attn, ["o_proj"], later=self.pack_later),
            _scale(layer.pre_feedforward_layernorm),
            fuse(mlp, ["gate_proj", "up_proj"], later=self.pack_later),
            fuse(mlp, ["down_proj"], later=self.pack_later),
            _scale(attn.q_norm),
            _scale(attn.k_norm),
            attn.layer_type,
            _scale(layer.post_attention_layernorm),
            _scale(layer.post_feedforward_layernorm),
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        known = torch.where(ids < self.vocab, ids, torch.zeros_like(ids))
        return F.embedding(known, self.embed_weight) * self.embed_scale

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (y * weight).to(self.dtype)

    def _mlp(
        self, x: torch.Tensor, attn: torch.Tensor, layer: _Layer, lead: int = 0
    ) -> torch.Tensor:
        assert isinstance(layer, _GemmaLayer)
        x = x + self._norm(layer.o(attn, lead), layer.post_attn)  # type: ignore[arg-type]
        gate, up = layer.gate_up(self._norm(x, layer.ln2), lead).chunk(2, dim=-1)
        h = layer.down(F.gelu(gate, approximate="tanh") * up, lead)
        return x + self._norm(h, layer.post_mlp)  # type: ignore[arg-type]

    def _prefill_masks(self, row: PrefillRow) -> dict[str, torch.Tensor]:
        """Global layers: causal OR same image block; sliding layers: that AND within the
        window (``create_masks_for_vision_model``). [T, T] boolean, True = attend; a kind
        left out is plain causal."""
        t = row.embeds.shape[0]
        if row.blocks is None and t <= self.window:
            return {}
        masks = self._masks(0, t, t, row.blocks)
        if row.blocks is None:
            del masks["full_attention"]
        return masks

    def _cached_masks(self, row: PrefillRow, width: int) -> dict[str, torch.Tensor]:
        """The same rules for the tokens after a cached prefix (or earlier chunks): [t, L]."""
        return self._masks(row.cached, row.embeds.shape[0], width, row.blocks)

    def _masks(
        self, first: int, t: int, width: int, blocks: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Queries ``first``..``first + t - 1`` over keys 0..``width - 1``; ``blocks``: the
        image block of keys 0.. (-1 text; keys past it are padding)."""
        allowed = self._causal(first, t, width)  # [query, key]
        if blocks is not None:
            b = torch.full((width,), -1, dtype=torch.long, device=self.device)
            b[: blocks.numel()] = blocks.to(self.device)
            mine = b[first : first + t, None]
            allowed = allowed | ((mine == b[None, :]) & (mine >= 0))
        i = torch.arange(first, first + t, device=self.device)[:, None]
        recent = torch.arange(width, device=self.device)[None] > i - self.window
        return {"full_attention": allowed, _SLIDING: allowed & recent}

    def _decode_masks(self, lengths: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        j = torch.arange(width, device=self.device)[None]
        seen = j <= lengths[:, None]
        recent = seen & (j > lengths[:, None] - self.window)
        return {"full_attention": self._additive(seen), _SLIDING: self._additive(recent)}


class Gemma3Embedder(LlavaEmbedder):
    """One image at a time through the model's own ``get_image_features`` (as LLaVA), plus
    the image blocks that attend both ways at prefill."""

    def build(self, inputs: dict[str, Any], slot: int = -1) -> RowInputs:
        from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

        built = super().build(inputs, slot)
        types = inputs.get("token_type_ids")
        if types is not None and bool((types == 1).any()):
            built.row.blocks = get_block_sequence_ids_for_mask(types)[0]
        return built
