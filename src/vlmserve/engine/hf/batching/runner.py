"""The Qwen2-VL language model as two batched steps: prefill (packed prompts) and decode.

Calling ``model.model.language_model`` per step costs milliseconds of mask building, output
capturing and cache bookkeeping for a few microseconds of maths, so the runner walks the
same weights itself (nano-vllm's ``model_runner``), with:

- **packed tokens** (no padding): prefill rows are concatenated, ``x: [N, hidden]``; the
  matmuls see every row, attention runs per row over exactly that row's keys;
- **fused projections**: q/k/v and gate/up are one matmul each. The fused weights are new
  storage and the HF parameters are re-pointed at views of it, so no memory is duplicated
  and ``model.generate`` keeps working on the same weights;
- **batch invariance on CPU**: a row's result does not depend on its companions. Matmuls
  with fewer than 4 rows take another BLAS path (different rounding), so smaller batches
  are padded to 4; attention never sees padding; rotary angles come from tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vlmserve.engine.hf.batching.kv_cache import SlotKVCache
from vlmserve.engine.hf.batching.rope import RotaryTables

__all__ = ["PrefillRow", "Qwen2VLRunner", "supports"]

_MIN_ROWS = 4  # below this oneDNN/MKL switch to a GEMV path whose rounding differs


def supports(model: Any) -> bool:
    """Whether the batched runner can serve this model (else one request at a time)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "qwen2_vl":
        return False
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or {}
    return (
        rope.get("rope_type", "default") == "default"
        and not getattr(text, "use_sliding_window", False)
        and text.hidden_act == "silu"
    )


@dataclass(slots=True)
class PrefillRow:
    embeds: torch.Tensor  # [T, hidden]: token embeddings, vision features scattered in
    positions: torch.Tensor | None  # [3, T] M-RoPE positions; None: text only (0..T-1)
    slot: int


@dataclass(slots=True)
class _Layer:
    ln1: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    bqkv: torch.Tensor  # [(H + 2 * KVH) * D]
    wo: torch.Tensor  # [hidden, H * D]
    ln2: torch.Tensor  # [hidden]
    wgu: torch.Tensor  # [2 * intermediate, hidden]
    wdown: torch.Tensor  # [hidden, intermediate]


def _fuse(*linears: Any, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights of ``linears`` and re-point each one at its slice."""
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)
    b = torch.cat([lin.bias.data for lin in linears], dim=0) if bias else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if b is not None:
            lin.bias.data = b[start : start + rows]
        start += rows
    return weight, b


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    if rows >= _MIN_ROWS:
        return F.linear(x, w, b)
    padded = torch.cat([x, x.new_zeros(_MIN_ROWS - rows, x.shape[1])])
    return F.linear(padded, w, b)[:rows]


class Qwen2VLRunner:
    def __init__(self, model: Any):
        lm = model.model.language_model
        cfg = lm.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.dtype = lm.embed_tokens.weight.dtype
        self.device = lm.embed_tokens.weight.device
        self.embed_weight = lm.embed_tokens.weight
        self.norm = lm.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [self._layer(layer) for layer in lm.layers]
        rotary = lm.rotary_emb
        self.rope = RotaryTables(
            rotary.inv_freq,
            list(rotary.mrope_section),
            float(rotary.attention_scaling),
            self.dtype,
            self.device,
        )
        self.cache = SlotKVCache(
            len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device
        )

    def _layer(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        wqkv, bqkv = _fuse(attn.q_proj, attn.k_proj, attn.v_proj, bias=True)
        wgu, _ = _fuse(mlp.gate_proj, mlp.up_proj, bias=False)
        assert bqkv is not None
        return _Layer(
            layer.input_layernorm.weight,
            wqkv,
            bqkv,
            attn.o_proj.weight,
            layer.post_attention_layernorm.weight,
            wgu,
            mlp.down_proj.weight,
        )

    # --- pieces ---------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as Qwen2VLRMSNorm: statistics in float32, scale in the model dtype
        if self.dtype == torch.float32:
            return weight * F.rms_norm(x, (self.hidden,), None, self.eps)
        y = F.rms_norm(x.float(), (self.hidden,), None, self.eps)
        return weight * y.to(self.dtype)

    def _qkv(
        self, x: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> q [N, H, D], k [N, KVH, D] (both rotated), v [N, KVH, D]."""
        n, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = _linear(self._norm(x, layer.ln1), layer.wqkv, layer.bqkv)
        qk = RotaryTables.apply(qkv[:, : (h + kvh) * d].view(n, h + kvh, d), cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * d :].view(n, kvh, d)

    def _mlp(self, x: torch.Tensor, attn: torch.Tensor, layer: _Layer) -> torch.Tensor:
        x = x + _linear(attn, layer.wo)
        gate, up = _linear(self._norm(x, layer.ln2), layer.wgu).chunk(2, dim=-1)
        return x + _linear(F.silu(gate) * up, layer.wdown)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self._norm(x, self.norm), self.lm_head).float()  # [rows, V]

    # --- steps ----------------------------------------------------------------------------
    def prefill(self, rows: list[PrefillRow]) -> torch.Tensor:
        """Run whole prompts; fill their KV slots; return each row's last-token logits [n, V]."""
        lengths = [row.embeds.shape[0] for row in rows]
        self.cache.reserve(max(row.slot for row in rows) + 1, max(lengths))
        x = torch.cat([row.embeds for row in rows])  # [N, hidden], rows packed
        cos, sin = self._prefill_rope(rows)
        starts = [sum(lengths[:i]) for i in range(len(rows))]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            outs = []
            for row, start, t in zip(rows, starts, lengths, strict=True):
                kr, vr = k[start : start + t].transpose(0, 1), v[start : start + t].transpose(0, 1)
                self.cache.write_prompt(li, row.slot, kr, vr)
                o = F.scaled_dot_product_attention(
                    q[start : start + t].transpose(0, 1)[None],
                    kr[None],
                    vr[None],
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=True,
                )  # [1, H, T, D]
                outs.append(o[0].transpose(0, 1).reshape(t, -1))
            x = self._mlp(x, torch.cat(outs), layer)
        last = torch.tensor(
            [s + t - 1 for s, t in zip(starts, lengths, strict=True)], device=self.device
        )
        return self._logits(x[last])

    def _prefill_rope(self, rows: list[PrefillRow]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for row in rows:
            t = row.embeds.shape[0]
            if row.positions is None:
                parts.append(torch.arange(t, device=self.device).expand(3, t))
            else:
                parts.append(row.positions.to(self.device))
        return self.rope.multimodal(torch.cat(parts, dim=1))

    def decode(
        self, tokens: list[int], positions: list[int], slots: list[int], lengths: list[int]
    ) -> torch.Tensor:
        """One token per row b: feed tokens[b] at rotary position positions[b], write cache
        column lengths[b] of slot slots[b], attend to columns 0..lengths[b]. -> logits [B, V]."""
        b, kvh, d = len(tokens), self.kv_heads, self.head_dim
        rep = self.heads // kvh
        self.cache.reserve(max(slots) + 1, max(lengths) + 1)
        host = torch.tensor([tokens, positions, slots, lengths])  # one host->device copy
        if self.device.type != "cpu":
            host = host.to(self.device)
        ids, pos, slot_t, col_t = host.unbind(0)
        x = self.embed(ids)  # [B, hidden]
        cos, sin = self.rope.text(pos, max(positions))
        spans = [(s, n + 1) for s, n in zip(slots, lengths, strict=True)]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            self.cache.write_step(li, slot_t, col_t, k, v)
            keys, values = self.cache.k[li], self.cache.v[li]  # [slots, KVH, capacity, D]
            # GQA without repeating K/V: the `rep` query heads of a KV head are its queries
            qg = q.reshape(b, kvh, rep, d)
            outs = [
                F.scaled_dot_product_attention(
                    qg[i : i + 1],
                    keys[s : s + 1, :, :n],
                    values[s : s + 1, :, :n],
                    scale=self.scale,
                )  # [1, KVH, rep, D]: each row over exactly its own keys
                for i, (s, n) in enumerate(spans)
            ]
            x = self._mlp(x, torch.cat(outs).reshape(b, -1), layer)
        return self._logits(x)
