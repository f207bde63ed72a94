"""A Llama-like decoder as two batched steps: prefill (packed prompts) and decode.

One runner serves the decoders of every batched family (``families/``): Qwen2 (q/k/v bias:
Qwen2-VL, Qwen2.5-VL, LLaVA-OneVision), Qwen3 (RMSNorm on q and k per head: Qwen3-VL) and
Llama (LLaVA-1.5, Idefics3, SmolVLM). What differs is read off the checkpoint's modules
(biases, ``q_norm``/``k_norm``) or given by the family adapter: the rotary layout (1-D,
M-RoPE, interleaved M-RoPE; ``rope.py``) and DeepStack features added to the visual tokens
after the first layers (Qwen3-VL; ``PrefillRow.deepstack``). Gemma 3 subclasses it
(``families/gemma3.py``) through the hooks ``_layer``, ``_rotary``, ``embed``, ``_norm``,
``_mlp``, ``_prefill_masks`` and ``_decode_masks``: a layer's ``kind`` picks its rotary table
and mask (sliding or global).

Calling the HF language model per step costs milliseconds of mask building, output
capturing and cache bookkeeping for a few microseconds of maths, so the runner walks the
same weights itself (nano-vllm's ``model_runner``), with:

- **packed tokens** (no padding): prefill rows are concatenated, ``x: [N, hidden]``; the
  matmuls see every row; prefill attention runs per row over exactly that row's keys (on
  CPU, for bfloat16 models where the CPU has AVX512-BF16, in the same C library's prefill
  kernel, ``cpu_prefill.c``: twice torch's speed);
- **a paged KV cache** (``PagedKVCache``): prefill and decode scatter K/V by slot; decode
  attention is one ``scaled_dot_product_attention`` per layer for the whole batch over the
  rows' gathered blocks (padded with the zero null block, masked), one query per head and
  ``enable_gqa`` (see ``_decode_attention`` for why that layout is batch invariant); on
  CPU, for half-precision models a C kernel reads each row's blocks in place instead
  (``use_compiled_attention``, ``cpu_attention.py``);
- **fused projections**: q/k/v and gate/up are one matmul each. The fused weights are new
  storage and the HF parameters are re-pointed at views of it, so no memory is duplicated
  and ``model.generate`` keeps working on the same weights;
- **decode rows' linears on a C kernel** for bfloat16 on CPUs with AVX512-BF16
  (``cpu_linear.c``): the first ``lead`` rows of a step are its streams, and their
  products read the plain weights at memory speed (``Linear.__call__``); prompt tokens
  keep the BLAS product;
- **batch invariance on CPU**: a row's result does not depend on its companions. Matmuls
  with fewer than 4 rows take another BLAS path (different rounding), so smaller batches
  are padded to 4; attention never sees padding; rotary angles come from tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vlmserve.engine.core.kv_cache import PagedKVCache, block_bytes
from vlmserve.engine.models.batch import (
    DecodeInputs,
    DecodeRows,
    PrefillInputs,
    PrefillRow,
    decode_inputs,
    prefill_inputs,
)
from vlmserve.engine.models.cpu_attention import CpuPagedAttention
from vlmserve.engine.models.cpu_kernels import use_cpu_kernels
from vlmserve.engine.models.graphs import (
    PagedDecode,
    graphs_unsupported,
    paged_supported,
)
from vlmserve.engine.models.linear import Linear, fuse
from vlmserve.engine.models.prefill_attention import prefill_attention
from vlmserve.engine.models.rope import RotaryTables

__all__ = ["DecodeRows", "DecoderRunner", "PrefillRow", "Qwen2VLRunner"]


@dataclass(slots=True)
class _Layer:
    ln1: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D (with bias where the checkpoint has one)
    o: Linear  # H * D -> hidden
    ln2: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    q_norm: torch.Tensor | None = None  # [D] Qwen3: RMSNorm of each query head
    k_norm: torch.Tensor | None = None  # [D] and of each key head
    kind: str = ""  # its rotary table and attention mask (Gemma 3: sliding or full)


def _joined(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])


def _lm_head(model: Any, later: bool) -> Linear:
    """The output projection; tied to the embeddings (Qwen2-VL-2B) it stays plain: packing
    would hold a second copy of the vocabulary matrix."""
    head = model.lm_head
    if head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr():
        return Linear(head.weight, None, False, head.weight.shape[0])
    return fuse(model, ["lm_head"], later=later)


class DecoderRunner:
    def __init__(
        self,
        model: Any,
        lm: Any = None,
        *,
        sections: list[int] | None = None,
        interleaved: bool = False,
    ):
        """``lm``: the decoder stack (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``;
        default ``model.model.language_model``), ``model.lm_head`` the output projection.
        ``sections``: M-RoPE sections (default the rotary module's ``mrope_section``; none:
        1-D RoPE); ``interleaved``: Qwen3-VL's layout of them."""
        self.model = model  # its vision tower may take the CPU prefill kernel
        lm = model.model.language_model if lm is None else lm
        cfg = lm.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = lm.layers[0].self_attn.q_proj.weight.shape[0] // self.heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.dtype = lm.embed_tokens.weight.dtype
        self.device = lm.embed_tokens.weight.device
        self.embed_weight = lm.embed_tokens.weight
        self.norm = lm.norm.weight
        # CPU bf16: weights stay plain until ``cpu_kernels.settle_linears`` knows whether the C
        # library's product takes them (``cpu_linear.c`` reads plain weights; oneDNN's packed)
        self.pack_later = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.lm_head = _lm_head(model, self.pack_later)
        self.layers = [self._layer(layer) for layer in lm.layers]
        self.ropes = self._rotary(lm.rotary_emb, sections, interleaved)  # by layer kind
        self.cache: PagedKVCache | None = None  # allocate_cache(), once the budget is known
        self.paged: PagedDecode | None = None  # use_paged_decode(): CUDA's decode step
        self.compiled: CpuPagedAttention | None = None  # use_compiled_attention(): CPU's

    def _rotary(
        self, rotary: Any, sections: list[int] | None, interleaved: bool
    ) -> dict[str, RotaryTables]:
        if sections is None:
            sections = getattr(rotary, "mrope_section", None) or [rotary.inv_freq.numel()]
        tables = RotaryTables(
            rotary.inv_freq,
            list(sections),
            float(rotary.attention_scaling),
            self.dtype,
            self.device,
            interleaved=interleaved,
        )
        return {"": tables}

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
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _Layer(
            layer.input_layernorm.weight,
            fuse(attn, ["q_proj", "k_proj", "v_proj"], later=self.pack_later),
            fuse(attn, ["o_proj"], later=self.pack_later),
            layer.post_attention_layernorm.weight,
            fuse(mlp, ["gate_proj", "up_proj"], later=self.pack_later),
            fuse(mlp, ["down_proj"], later=self.pack_later),
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
        )

    # --- pieces ---------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as Qwen2/Qwen3/Llama RMSNorm over the last dim: statistics in float32, scale in
        # the model dtype
        if self.dtype == torch.float32:
            return weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return weight * y.to(self.dtype)

    def _qkv(
        self, x: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor, lead: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> q [N, H, D], k [N, KVH, D] (both rotated), v [N, KVH, D]. The
        first ``lead`` rows are decode rows (``Linear.__call__``)."""
        n, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(self._norm(x, layer.ln1), lead)
        qk = qkv[:, : (h + kvh) * d].view(n, h + kvh, d)
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: per head, pre-RoPE
            qk = torch.cat(
                [self._norm(qk[:, :h], layer.q_norm), self._norm(qk[:, h:], layer.k_norm)], 1
            )
        qk = RotaryTables.apply(qk, cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * d :].view(n, kvh, d)

    def _mlp(
        self, x: torch.Tensor, attn: torch.Tensor, layer: _Layer, lead: int = 0
    ) -> torch.Tensor:
        x = x + layer.o(attn, lead)
        gate, up = layer.gate_up(self._norm(x, layer.ln2), lead).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up, lead)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, V]: every row (a step's decode rows and its prompts' last tokens) is one
        the small-batch product takes, so a prompt's first token does not depend on its
        companions either."""
        return self.lm_head(self._norm(x, self.norm), x.shape[0]).float()

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
        """Run whole prompts (or chunks of them); write their K/V at each row's ``slots``;
        return each row's last-token logits [n, V]."""
        return self.step(rows, None)

    def step(self, rows: list[PrefillRow], decode: DecodeRows | None) -> torch.Tensor:
        """One forward of ``decode``'s rows (a token each) and ``rows`` (prompts or chunks),
        packed: the weights are read once for both, and a running stream's next token does
        not wait for a separate pass after the newcomers' prefill. -> logits [B + n, V]: the
        decode rows' first, then each prefill row's last token."""
        cache = self._kv()
        d = decode_inputs(self, decode) if decode is not None else None
        p = prefill_inputs(self, rows) if rows else None
        parts = [part for part in (d, p) if part is not None]
        x = parts[0].x if len(parts) == 1 else torch.cat([part.x for part in parts])
        slots = parts[0].slots if len(parts) == 1 else torch.cat([part.slots for part in parts])
        ropes = parts[0].ropes
        if len(parts) > 1:  # decode rows' cos/sin, then the prefill rows'
            ropes = {kind: _joined(d.ropes[kind], p.ropes[kind]) for kind in self.ropes}  # type: ignore[union-attr]
        b = 0 if d is None else d.count
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, *ropes[layer.kind], b)  # q [N, H, D], k/v [N, KVH, D]
            cache.write(li, slots, k, v)
            outs = [] if d is None else [self._decode_attend(li, layer, q[:b], d)]
            if p is not None:
                outs.append(self._prefill_attend(li, layer, q[b:], k[b:], v[b:], p))
            x = self._mlp(x, outs[0] if len(outs) == 1 else torch.cat(outs), layer, b)
            if p is not None and p.deep is not None and li < p.deep.shape[0]:
                # as Qwen3VLTextModel._deepstack_process
                visual = p.visual if b == 0 else p.visual + b  # type: ignore[operator]
                x[visual] = x[visual] + p.deep[li]
        if p is None:
            return self._logits(x)
        last = p.last if b == 0 else torch.cat([torch.arange(b, device=self.device), p.last + b])
        return self._logits(x[last])

    def _prefill_attend(
        self,
        li: int,
        layer: _Layer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: PrefillInputs,
    ) -> torch.Tensor:
        """Each prefill row's attention over exactly its own keys -> [N, H * D]
        (``prefill_attention.py``)."""
        return prefill_attention(self, li, layer.kind, q, k, v, p)

    def _cached_masks(self, row: PrefillRow, width: int) -> dict[str, torch.Tensor]:
        """Masks [t, L] by layer kind for a row after its cached prefix c, where a kind's is
        not plain causal (query i, token c + i, sees keys 0..c+i; never the padding of the
        gathered blocks past them): none here."""
        return {}

    def _causal(self, first: int, t: int, width: int) -> torch.Tensor:
        """[t, width] boolean: query i (token first + i) sees keys 0..first+i."""
        i = torch.arange(first, first + t, device=self.device)[:, None]
        return torch.arange(width, device=self.device)[None] <= i

    def _deepstack(
        self, rows: list[PrefillRow], starts: list[int]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Packed visual token indices [M] and DeepStack features [k, M, hidden] of the rows
        that have them (None, None: no row has)."""
        have = [(row, s) for row, s in zip(rows, starts, strict=True) if row.deepstack is not None]
        if not have:
            return None, None
        index = torch.cat([row.visual.to(self.device) + s for row, s in have])  # type: ignore[union-attr]
        deep = torch.cat([row.deepstack.to(self.device) for row, _ in have], dim=1)  # type: ignore[union-attr]
        return index, deep

    def _prefill_masks(self, row: PrefillRow) -> dict[str, torch.Tensor]:
        """A row's prefill attention masks ([T, T] boolean) by layer kind; a kind without
        one is plain causal."""
        return {}

    def _prefill_rope(self, rows: list[PrefillRow]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        parts = []
        for row in rows:
            t = row.embeds.shape[0]
            if row.positions is None:
                parts.append(torch.arange(t, device=self.device).expand(3, t))
            else:
                parts.append(row.positions.to(self.device))
        positions = torch.cat(parts, dim=1)
        return {kind: tables.multimodal(positions) for kind, tables in self.ropes.items()}

    def use_paged_decode(self, max_rows: int, max_len: int = 0, *, graphs: bool) -> str:
        """Decode through ``PagedDecode`` where it applies (CUDA with Triton, the base
        runner's attention): attention reads the cache in place, and with ``graphs`` each
        batch-size bucket's step is a CUDA graph. -> how decode runs, for the log."""
        if not paged_supported(self):
            return "gathered attention"
        why = graphs_unsupported(self) if graphs else "--enforce-eager"
        self.paged = PagedDecode(self, max_rows, max_len, graphs=why is None)
        if why is None:
            seconds = self.paged.capture_all()
            if self.paged.use_graphs:
                return f"paged attention, CUDA graphs ({seconds:.1f} s to capture)"
            why = "capturing failed"
        return f"paged attention, eager ({why})"

    def use_compiled_attention(self) -> str:
        """CPU: decode attention reads the cache in place, and the C library's other kernels
        take what they can (``cpu_kernels.use_cpu_kernels``). -> how decode runs, for the
        log."""
        return use_cpu_kernels(self)

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
        if self.paged is not None:
            return self.paged.run(tokens, positions, lengths, tables)
        return self.step([], DecodeRows(tokens, positions, lengths, tables))

    @property
    def mixes(self) -> bool:
        """Whether decode rows can ride in a prefill forward (``step``): not where decode
        has its own step (CUDA's paged decode and its graphs)."""
        return self.paged is None

    def _decode_attend(
        self, li: int, layer: _Layer, q: torch.Tensor, d: DecodeInputs
    ) -> torch.Tensor:
        """The decode rows' attention, one query each over its row's blocks -> [B, H * D]."""
        cache = self._kv()
        if self.compiled is not None:  # reads each row's blocks in place
            assert d.attend is not None  # decode_inputs checked them for the kernel
            o = self.compiled(
                q, cache.k[li], cache.v[li], d.table, d.attend, self.scale, checked=True
            )
            return o.view(d.count, -1)
        assert d.masks is not None
        keys, values = cache.gather(li, d.table, self._attention_dtype())  # [B, KVH, L, D]
        return self._decode_attention(q, keys, values, d.masks[layer.kind])

    def _decode_masks(self, lengths: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        """[B, 1, 1, L] additive masks by layer kind: row b sees its tokens 0..lengths[b],
        not the padding."""
        return {
            "": self._additive(torch.arange(width, device=self.device)[None] <= lengths[:, None])
        }

    def _additive(self, seen: torch.Tensor) -> torch.Tensor:
        """[B, L] boolean -> [B, 1, 1, L] additive mask (0 seen, -inf not), in the dtype
        decode attention runs in (``_attention_dtype``)."""
        dtype = self._attention_dtype() or self.dtype
        mask = torch.zeros(seen.shape, dtype=dtype, device=self.device)
        return mask.masked_fill_(~seen, float("-inf"))[:, None, None]

    def _decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [B, H, D], keys/values [B, KVH, L, D], mask [B, 1, 1, L] -> [B, H * D].

        One query per head with ``enable_gqa`` (not the ``rep`` query heads of a KV head as
        ``rep`` queries): with 4 or more queries per (row, KV head) the CPU flash kernel's
        GEMMs round differently as the padded length L changes, so a row's output would
        depend on its companions' lengths; with one query it is bit-identical (measured
        for rep 1-8, head_dim 32/64, L up to 1,100).

        On CPU a bfloat16 model's decode attention runs in float32 (keys, values and mask
        come upcast, ``_attention_dtype``): torch's CPU kernel for one bf16 query per head is
        ~8x slower than for float32 (medium checkpoint, 8 rows of ~250 keys, 1 thread: 3.4
        ms against 0.43 ms per layer, 62% of the step); the upcast costs a fraction."""
        b = q.shape[0]
        o = F.scaled_dot_product_attention(
            q[:, :, None].to(keys.dtype),
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )  # [B, H, 1, D]
        return o.reshape(b, -1).to(q.dtype)

    def _attention_dtype(self) -> torch.dtype | None:
        """The dtype decode attention runs in when not the model's (``_decode_attention``):
        float32 for a bf16 model on CPU."""
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            return torch.float32
        return None


Qwen2VLRunner = DecoderRunner  # the name callers used before the families
