"""Prompt embeddings for a prefill row: token embeddings with vision features scattered in.

Each image and video goes through the vision tower on its own (its features then do not
depend on what else was encoded with it) unless the ``VisionCache`` already holds it. The
features replace the image/video placeholder tokens in order, as ``Qwen2VLModel.forward``
does with ``masked_scatter``; positions come from the model's own ``get_rope_index``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.engine.hf.batching.runner import PrefillRow, Qwen2VLRunner
from vlmserve.engine.hf.batching.vision_cache import VisionCache, content_key

__all__ = ["PromptEmbedder", "RowInputs"]

_TEXT, _IMAGE, _VIDEO = 0, 1, 2  # mm_token_type_ids values


@dataclass(slots=True)
class RowInputs:
    row: PrefillRow
    rope_delta: int  # decode position of cache index i is i + rope_delta


class PromptEmbedder:
    def __init__(self, model: Any, runner: Qwen2VLRunner, cache: VisionCache):
        self.model = model
        self.runner = runner
        self.cache = cache
        self.image_token = int(model.config.image_token_id)
        self.video_token = int(model.config.video_token_id)
        self.merge = int(model.config.vision_config.spatial_merge_size)

    def build(self, inputs: dict[str, torch.Tensor], slot: int = -1) -> RowInputs:
        """``slot`` (the row's place in the batch) is not needed by a paged cache; kept
        for callers."""
        device = self.runner.device
        ids = inputs["input_ids"][0].to(device)  # [T]
        embeds = self.runner.embed(ids)  # [T, hidden]
        images = self._features(inputs, "image", "pixel_values", "image_grid_thw")
        videos = self._features(inputs, "video", "pixel_values_videos", "video_grid_thw")
        for token, feats, kind in (
            (self.image_token, images, "image"),
            (self.video_token, videos, "video"),
        ):
            if feats is None:
                continue
            where = ids == token
            if int(where.sum()) != feats.shape[0]:
                raise ValueError(
                    f"{int(where.sum())} {kind} placeholder tokens in the prompt "
                    f"but {feats.shape[0]} {kind} features"
                )
            embeds[where] = feats.to(embeds.dtype)
        if images is None and videos is None:
            return RowInputs(PrefillRow(embeds, None), 0)
        positions, delta = self._positions(inputs, ids)
        return RowInputs(PrefillRow(embeds, positions), delta)

    def _positions(
        self, inputs: dict[str, torch.Tensor], ids: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        types = inputs.get("mm_token_type_ids")
        if types is None:
            types = torch.zeros_like(ids)
            types[ids == self.image_token] = _IMAGE
            types[ids == self.video_token] = _VIDEO
        else:
            types = types[0].to(ids.device)
        grids = {
            k: inputs[k].to(ids.device) for k in ("image_grid_thw", "video_grid_thw") if k in inputs
        }
        positions, delta = self.model.model.get_rope_index(ids[None], types[None], **grids)
        return positions[:, 0], int(delta.reshape(-1)[0])  # [3, T]

    def _features(
        self, inputs: dict[str, torch.Tensor], kind: str, pixels_key: str, grid_key: str
    ) -> torch.Tensor | None:
        """All features of one kind, in prompt order: [tokens, hidden] (None: none)."""
        if inputs.get(pixels_key) is None or inputs.get(grid_key) is None:
            return None
        pixels, grids = inputs[pixels_key], inputs[grid_key]
        sizes = grids.prod(dim=-1).tolist()  # patches per item
        keys = inputs.get(f"{kind}_keys")  # from the processor cache: no need to hash again
        if keys is None or len(keys) != len(sizes):
            keys = [None] * len(sizes)
        out, start = [], 0
        for i, size in enumerate(sizes):
            item, grid = pixels[start : start + size], grids[i : i + 1]
            start += size
            out.append(self._encode(kind, item, grid, keys[i]))
        return torch.cat(out)

    def _encode(
        self, kind: str, pixels: torch.Tensor, grid: torch.Tensor, key: bytes | None = None
    ) -> torch.Tensor:
        if not self.cache.enabled:
            key = None
        elif key is None:
            key = content_key(kind, pixels, grid)
        if key is not None and (hit := self.cache.get(key)) is not None:
            return hit
        if key is None:
            self.cache.misses += 1
        device = self.runner.device
        pixels, grid = pixels.to(device), grid.to(device)
        if kind == "image":
            result = self.model.model.get_image_features(pixels, grid, return_dict=True)
        else:
            result = self.model.model.get_video_features(pixels, grid, return_dict=True)
        features = result.pooler_output[0]  # [t * h * w / merge^2, hidden]
        if key is not None:
            self.cache.put(key, features)
        return features
