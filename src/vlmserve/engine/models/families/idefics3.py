"""Idefics3 and SmolVLM: a Llama decoder with 1-D RoPE; SigLIP tower + pixel-shuffle connector.

An image is a global view plus tiles, each tile ``image_seq_len`` ``<image>`` tokens; the
model's own ``get_image_features`` encodes tiles independently (all-zero padding tiles
skipped), so each tile is one ``MediaItem``, encoded alone with its ``pixel_attention_mask``.
Positions are 0..T-1 as for text.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.models.families._common import decoder_ok, new_runner
from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.models.vision import MediaItem, PromptEmbedder
from vlmserve.engine.models.vision_cache import VisionCache

__all__ = ["MEDIA", "MODEL_TYPES", "TileEmbedder", "build", "supports"]

MODEL_TYPES = ("idefics3", "smolvlm")
MEDIA = MediaRules(detail="tiles")  # frame rule and `detail` (families/_media.py)


def supports(model: Any) -> bool:
    text = model.config.get_text_config()
    return text.model_type == "llama" and decoder_ok(
        text, rope_types=("default", "linear", "llama3")
    )


def build(model: Any, cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    runner = new_runner(model, model.model.text_model, None)
    return runner, TileEmbedder(model, runner, cache)


class TileEmbedder(PromptEmbedder):
    def items(self, inputs: dict[str, Any], kind: str) -> list[MediaItem]:
        pixels = inputs.get("pixel_values")  # [1, tiles, 3, H, W]
        if pixels is None:
            return []
        masks = inputs.get("pixel_attention_mask")  # [1, tiles, H, W]
        out = []
        for i in range(pixels.shape[1]):
            tile = pixels[:, i : i + 1]
            if not bool(tile.ne(0).any()):  # a padding tile: no tokens (as the model skips it)
                continue
            mask = None if masks is None else masks[:, i : i + 1]
            out.append(MediaItem(tile, mask))
        return out

    def encode(self, kind: str, item: MediaItem) -> torch.Tensor:
        out = self.model.model.get_image_features(item.pixels, item.grid, return_dict=True)
        return out.pooler_output[0]  # [image_seq_len, hidden]
