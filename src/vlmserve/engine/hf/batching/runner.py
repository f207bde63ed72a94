"""The Qwen2-VL language model as two batched steps: prefill (packed prompts) and decode.

Calling ``model.model.language_model`` per step costs milliseconds of mask building, output
capturing and cache bookkeeping for a few microseconds of maths, so the runner walks the
same weights itself (nano-vllm's ``model_runner``), with:

- **packed tokens** (no padding): prefill rows are concatenated, ``x: [N, hidden]``; the
  matmuls see every row; prefill attention runs per row over exactly that row's keys;
- **a paged KV cache** (``PagedKVCache``): prefill and decode scatter K/V by slot; decode
  attention is one ``scaled_dot_product_attention`` per layer for the whole batch over the
  rows' gathered blocks (padded with the zero null block, masked), one query per head and
  ``enable_gqa`` (see ``_decode_attention`` for why that layout is batch invariant);
- **fused projections**: q/k/v and gate/up are one matmul each. The fused weights are new
  storage and the HF parameters are re-pointed at views of it, so no memory is duplicated
  and ``model.generate`` keeps working on the same weights;
- **batch invariance on CPU**: a row's result does not depend on its companions. Matmuls
  with fewer than 4 rows take another BLAS path (different rounding), so smaller batches
  are padded to 4; attention never sees padding; rotary angles come from tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vlmserve.engine.hf.batching.kv_cache import PagedKVCache, block_bytes
from vlmserve.engine.hf.batching.linear import Linear, fuse
from vlmserve.engine.hf.batching.rope import RotaryTables

__all__ = ["PrefillRow", "Qwen2VLRunner", "supports"]


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
    slots: list[int] = field(default_factory=list)  # [T] cache slot of each token


@dataclass(slots=True)
class _Layer:
    ln1: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D, with bias
    o: Linear  # H * D -> hidden
    ln2: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


def _lm_head(model: Any) -> Linear:
    """The output projection; tied to the embeddings (Qwen2-VL-2B) it stays plain: packing
    would hold a second copy of the vocabulary matrix."""
    head = model.lm_head
    if head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr():
        return Linear(head.weight, None, False, head.weight.shape[0])
    return fuse(model, ["lm_head"])


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
        self.lm_head = _lm_head(model)
        self.layers = [self._layer(layer) for layer in lm.layers]
        rotary = lm.rotary_emb
        self.rope = RotaryTables(
            rotary.inv_freq,
            list(rotary.mrope_section),
            float(rotary.attention_scaling),
            self.dtype,
            self.device,
        )
        self.cache: PagedKVCache | None = None  # allocate_cache(), once the budget is known

    def block_bytes(self, block_size: int) -> int:
        return block_bytes(len(self.layers), self.kv_heads, self.head_dim, block_size, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        self.cache = PagedKVCache(
            len(self.layers),
            self.kv_heads,
            self.head_dim,
            num_blocks,
            block_size,
            self.dtype,
            self.device,
        )
        return self.cache

    def _layer(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(
            layer.input_layernorm.weight,
            fuse(attn, ["q_proj", "k_proj", "v_proj"]),
            fuse(attn, ["o_proj"]),
            layer.post_attention_layernorm.weight,
            fuse(mlp, ["gate_proj", "up_proj"]),
            fuse(mlp, ["down_proj"]),
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
        qkv = layer.qkv(self._norm(x, layer.ln1))
        qk = RotaryTables.apply(qkv[:, : (h + kvh) * d].view(n, h + kvh, d), cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * d :].view(n, kvh, d)

    def _mlp(self, x: torch.Tensor, attn: torch.Tensor, layer: _Layer) -> torch.Tensor:
        x = x + layer.o(attn)
        gate, up = layer.gate_up(self._norm(x, layer.ln2)).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(x, self.norm)).float()  # [rows, V]

    # --- steps ----------------------------------------------------------------------------
    def _kv(self) -> PagedKVCache:
        if self.cache is None:
            raise RuntimeError("the KV cache is not allocated")
        return self.cache

    def _host(self, *rows: list[int]) -> list[torch.Tensor]:
        """Equal-length int lists -> tensors on the device (one host->device copy)."""
        host = torch.tensor(rows)
        if self.device.type != "cpu":
            host = host.to(self.device)
        return list(host.unbind(0))

    def prefill(self, rows: list[PrefillRow]) -> torch.Tensor:
        """Run whole prompts; write their K/V at each row's ``slots``; return each row's
        last-token logits [n, V]."""
        cache = self._kv()
        lengths = [row.embeds.shape[0] for row in rows]
        (slots,) = self._host([s for row in rows for s in row.slots])  # [N]
        x = torch.cat([row.embeds for row in rows])  # [N, hidden], rows packed
        cos, sin = self._prefill_rope(rows)
        starts = [sum(lengths[:i]) for i in range(len(rows))]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)  # q [N, H, D], k/v [N, KVH, D]
            cache.write(li, slots, k, v)
            outs = []
            for start, t in zip(starts, lengths, strict=True):
                o = F.scaled_dot_product_attention(
                    q[start : start + t].transpose(0, 1)[None],
                    k[start : start + t].transpose(0, 1)[None],
                    v[start : start + t].transpose(0, 1)[None],
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=True,
                )  # [1, H, T, D]: each row over exactly its own keys
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
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """One token per row b: feed tokens[b] at rotary position positions[b], write it as
        token lengths[b] of the row whose blocks are tables[b] (room already made), attend
        to its tokens 0..lengths[b]. -> logits [B, V]."""
        cache = self._kv()
        bs = cache.block_size
        width = max(len(t) for t in tables)
        slots = [t[n // bs] * bs + n % bs for t, n in zip(tables, lengths, strict=True)]
        ids, pos, slot_t, len_t = self._host(tokens, positions, slots, lengths)
        table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [B, MB]
        table_t = table_t.to(self.device)
        # [B, 1, 1, L] additive mask: row b sees its tokens 0..lengths[b], not the padding
        seen = torch.arange(width * bs, device=self.device)[None] <= len_t[:, None]
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~seen, float("-inf"))[:, None, None]
        x = self.embed(ids)  # [B, hidden]
        cos, sin = self.rope.text(pos, max(positions))
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)  # q [B, H, D], k/v [B, KVH, D]
            cache.write(li, slot_t, k, v)
            keys, values = cache.gather(li, table_t)  # [B, KVH, L, D]
            x = self._mlp(x, self._decode_attention(q, keys, values, mask), layer)
        return self._logits(x)

    def _decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [B, H, D], keys/values [B, KVH, L, D], mask [B, 1, 1, L] -> [B, H * D].

        One query per head with ``enable_gqa`` (not the ``rep`` query heads of a KV head as
        ``rep`` queries): with 4 or more queries per (row, KV head) the CPU flash kernel's
        GEMMs round differently as the padded length L changes, so a row's output would
        depend on its companions' lengths; with one query it is bit-identical (measured
        for rep 1-8, head_dim 32/64, L up to 1,100)."""
        b = q.shape[0]
        o = F.scaled_dot_product_attention(
            q[:, :, None], keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # [B, H, 1, D]
        return o.reshape(b, -1)
