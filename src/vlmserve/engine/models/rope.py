"""Rotary positions from lookup tables: 1-D RoPE, Qwen2-VL M-RoPE, Qwen3-VL interleaved M-RoPE.

Every rotary half-dimension takes its angle from one of three position axes (temporal 0,
height 1, width 2); ``rotary_axes`` says which:

- 1-D RoPE (Llama, Qwen2, ...): all from axis 0 (``sections=[D/2]``);
- Qwen2-VL / Qwen2.5-VL M-RoPE: contiguous sections (``mrope_section``, e.g. [16, 24, 24]),
  section ``i`` from axis ``i % 3`` (``Qwen2VLRotaryEmbedding`` 's ``split`` + ``cat``);
- Qwen3-VL interleaved M-RoPE: dims 1, 4, 7, ... (below ``3 * sections[1]``) from the height,
  2, 5, 8, ... (below ``3 * sections[2]``) from the width, the rest from the temporal axis
  (``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``).

Text tokens have the same position on all three axes, which is ordinary RoPE. All cases are
served by gathering from one table of ``cos(p * inv_freq)`` so the angle of a position is
bit-identical whichever batch the token sits in (an elementwise ``cos`` over a packed batch
takes a scalar path for the last elements, whose rounding can differ from the vector path).
"""

from __future__ import annotations

import torch

__all__ = ["RotaryTables", "rotary_axes"]


def rotary_axes(sections: list[int], half: int, *, interleaved: bool = False) -> list[int]:
    """The position axis (0 = t, 1 = h, 2 = w) each of the ``half`` rotary dims rotates by."""
    if interleaved:
        axes = [0] * half
        for axis in (1, 2):
            for i in range(axis, min(3 * sections[axis], half), 3):
                axes[i] = axis
        return axes
    axes = [i % 3 for i, n in enumerate(sections) for _ in range(n)]
    if len(axes) != half:
        raise ValueError(f"mrope_section {sections} does not cover {half} rotary dims")
    return axes


class RotaryTables:
    def __init__(
        self,
        inv_freq: torch.Tensor,
        sections: list[int],
        scaling: float,
        dtype: torch.dtype,
        device: torch.device,
        *,
        interleaved: bool = False,
    ):
        """``sections``: M-RoPE sections ([D/2] for 1-D RoPE); ``interleaved``: Qwen3-VL's
        layout of them (see ``rotary_axes``)."""
        self.inv_freq = inv_freq.float().to(device)  # [D/2]
        self.scaling = scaling
        self.dtype, self.device = dtype, device
        half = int(self.inv_freq.numel())
        axis = rotary_axes(sections, half, interleaved=interleaved)
        self.axis = torch.tensor(axis, device=device)  # [D/2]
        self.cos_half = torch.empty(0, half, device=device)  # [P, D/2] float32
        self.sin_half = torch.empty(0, half, device=device)
        self.cos_full = torch.empty(0, 1, 2 * half, dtype=dtype, device=device)  # [P, 1, D]
        self.sin_full = torch.empty(0, 1, 2 * half, dtype=dtype, device=device)  # signed
        self._grow(4096)

    def _grow(self, positions: int) -> None:
        size = max(positions, 2 * self.cos_half.shape[0])
        p = torch.arange(size, dtype=torch.float32, device=self.device)
        freqs = p[:, None] * self.inv_freq[None, :]  # [P, D/2]
        self.cos_half = freqs.cos() * self.scaling
        self.sin_half = freqs.sin() * self.scaling
        cos, sin = self._full(self.cos_half, self.sin_half)
        self.cos_full, self.sin_full = cos, sin  # the text path: one lookup each

    def _full(self, cos_h: torch.Tensor, sin_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half tables [N, D/2] -> (cos [N, 1, D], signed sin [N, 1, D]) in the model dtype.

        ``rotate_half(x) * sin == swap_halves(x) * cat(-sin, sin)``: see ``apply``."""
        cos = torch.cat((cos_h, cos_h), dim=-1).to(self.dtype)
        sin = torch.cat((-sin_h, sin_h), dim=-1).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    def text(self, positions: torch.Tensor, highest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N], same on all three axes, at most ``highest`` -> cos, sin: [N, 1, D]."""
        if highest >= self.cos_full.shape[0]:
            self._grow(highest + 1)
        return self.cos_full[positions], self.sin_full[positions]

    def multimodal(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, N] (t, h, w) -> cos, sin: [N, 1, D]."""
        need = int(positions.max()) + 1
        if need > self.cos_half.shape[0]:
            self._grow(need)
        per_dim = positions.t()[:, self.axis]  # [N, D/2]: the position each dim rotates by
        return self._full(self.cos_half.gather(0, per_dim), self.sin_half.gather(0, per_dim))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, D]; cos, sin: [N, 1, D] from ``text``/``multimodal``.

        ``x * cos + swapped * sin`` with two buffers of x's size instead of four: on a packed
        prefill (thousands of rows) each buffer is megabytes, which the allocator maps and
        the kernel faults in afresh, costing more than the arithmetic. The same products and
        sum in the same order, so the result is bit-identical."""
        n, heads, d = x.shape
        swapped = x.reshape(n, heads, 2, d // 2).flip(2).reshape(n, heads, d)  # a new buffer
        out = x * cos
        out += swapped.mul_(sin)
        return out
