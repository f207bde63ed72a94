"""Prompt embeddings for a prefill row: token embeddings with vision features scattered in.

``PromptEmbedder`` is the part every family shares; a family's adapter (``families/``) says
where its images and videos are in the processor output (``items``), how its own vision
tower and projector encode one of them (``encode``, through the model's own
``get_image_features`` / ``get_video_features``) and the row's rotary positions
(``positions``: 0..T-1 by default, M-RoPE from the model's own ``get_rope_index``).

Each image and video goes through the vision tower on its own (its features then do not
depend on what else was encoded with it) unless the ``VisionCache`` already holds it. The
features replace the placeholder tokens in order, as the models' ``forward`` does with
``masked_scatter``. DeepStack features (Qwen3-VL) travel with the main features in one
cached tensor ``[tokens, hidden * (1 + deepstack)]`` and are handed to the runner as
``PrefillRow.visual`` / ``PrefillRow.deepstack``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.engine.models.runner import PrefillRow
from vlmserve.engine.models.vision_cache import VisionCache, content_key

__all__ = ["MediaItem", "PromptEmbedder", "RowInputs"]

_SMALL_GRID = 16  # a grid up to this many numbers is hashed as numbers, a larger one as bytes


@dataclass(slots=True)
class RowInputs:
    row: PrefillRow
    rope_delta: int  # decode position of cache index i is i + rope_delta


@dataclass(slots=True)
class MediaItem:
    """One image or one video, as the vision tower takes it alone."""

    pixels: torch.Tensor  # its rows of pixel_values (Qwen: patches; LLaVA: [1, 3, H, W])
    grid: torch.Tensor | None = None  # what else the tower reads: Qwen's [1, 3] grid_thw, ...
    key: bytes | None = None  # the processor cache's content key, when it gave one


class PromptEmbedder:
    """Token embeddings + vision features for one prompt (one batch row)."""

    kinds: tuple[str, ...] = ("image",)  # media kinds the family takes, in scatter order
    deepstack = 0  # DeepStack feature sets per token after the main features (Qwen3-VL)

    def __init__(self, model: Any, runner: Any, cache: VisionCache):
        self.model = model
        self.runner = runner  # embed(ids), device, hidden
        self.cache = cache
        self.tokens = self.placeholder_tokens()  # {kind: placeholder token id}

    # --- what a family adapter provides ---------------------------------------------------
    def placeholder_tokens(self) -> dict[str, int]:
        return {"image": int(self.model.config.image_token_id)}

    def items(self, inputs: dict[str, Any], kind: str) -> list[MediaItem]:
        """The prompt's images (or videos) in prompt order, one ``MediaItem`` each."""
        raise NotImplementedError

    def encode(self, kind: str, item: MediaItem) -> torch.Tensor:
        """One item through the model's own vision tower + projector -> [tokens, width]."""
        raise NotImplementedError

    def positions(
        self, inputs: dict[str, Any], ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, int]:
        """A row with media: ([3, T] rotary positions or None for 0..T-1, rope delta)."""
        return None, 0

    # --- shared ---------------------------------------------------------------------------
    def media_signature(self, inputs: dict[str, Any]) -> tuple[int, bytes] | None:
        """(index of the first placeholder token, a digest of every image and video in
        prompt order) for the prefix cache (``prefix.block_hashes``); None: a text prompt."""
        ids = inputs["input_ids"][0]
        digest, first = hashlib.sha256(), None
        for kind in self.kinds:
            where = (ids == self.tokens[kind]).nonzero()
            if where.numel():
                at = int(where[0, 0])
                first = at if first is None else min(first, at)
            for item in self.items(inputs, kind):
                digest.update(item.key or _key(kind, item))
        return None if first is None else (first, digest.digest())

    def build(self, inputs: dict[str, Any], slot: int = -1) -> RowInputs:
        """``slot`` (the row's place in the batch) is not needed by a paged cache; kept
        for callers."""
        ids = inputs["input_ids"][0].to(self.runner.device)  # [T]
        embeds = self.runner.embed(ids)  # [T, hidden]
        hidden = embeds.shape[-1]
        found: list[tuple[torch.Tensor, torch.Tensor]] = []  # (where [T], features)
        for kind in self.kinds:
            items = self.items(inputs, kind)
            if not items:
                continue
            feats = torch.cat([self._cached(kind, item) for item in items])
            where = ids == self.tokens[kind]
            if int(where.sum()) != feats.shape[0]:
                raise ValueError(
                    f"{int(where.sum())} {kind} placeholder tokens in the prompt "
                    f"but {feats.shape[0]} {kind} features"
                )
            embeds[where] = feats[:, :hidden].to(embeds.dtype)
            found.append((where, feats))
        if not found:
            return RowInputs(PrefillRow(embeds, None), 0)
        positions, delta = self.positions(inputs, ids)
        row = PrefillRow(embeds, positions)
        if self.deepstack:
            row.visual, row.deepstack = self._deepstack(found, embeds)
        return RowInputs(row, delta)

    def _deepstack(
        self, found: list[tuple[torch.Tensor, torch.Tensor]], embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (visual token indices [M] in prompt order, features [deepstack, M, hidden]),
        as ``Qwen3VLModel.forward`` joins the image and video DeepStack features."""
        t, hidden = embeds.shape
        per_token = embeds.new_zeros(t, self.deepstack * hidden)
        visual = torch.zeros(t, dtype=torch.bool, device=embeds.device)
        for where, feats in found:
            per_token[where] = feats[:, hidden:].to(embeds.dtype)
            visual |= where
        index = visual.nonzero().squeeze(1)  # [M]
        deep = per_token[index].view(-1, self.deepstack, hidden).transpose(0, 1)
        return index, deep.contiguous()

    def _cached(self, kind: str, item: MediaItem) -> torch.Tensor:
        key = item.key
        if not self.cache.enabled:
            key = None
        elif key is None:
            key = _key(kind, item)
        if key is not None and (hit := self.cache.get(key)) is not None:
            return hit
        if key is None:
            self.cache.misses += 1
        device = self.runner.device
        item = MediaItem(
            item.pixels.to(device), None if item.grid is None else item.grid.to(device), key
        )
        features = self.encode(kind, item)
        if key is not None:
            self.cache.put(key, features)
        return features


def _key(kind: str, item: MediaItem) -> bytes:
    """The vision cache's key of an item: its pixels and everything else the tower reads."""
    shape = torch.tensor(item.pixels.shape)
    if item.grid is None:
        return content_key(kind, item.pixels, shape)
    if item.grid.numel() <= _SMALL_GRID:
        return content_key(kind, item.pixels, item.grid)
    return content_key(kind, item.pixels, shape) + content_key("grid", item.grid, shape)
