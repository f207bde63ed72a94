"""InternVL: a Qwen2 (or Llama) decoder with 1-D RoPE; InternViT tiles + pixel shuffle.

An image is its dynamic tiles (plus a thumbnail), a video its frames, all rows of
``pixel_values [tiles, 3, H, W]`` and each a fixed number of ``<IMG_CONTEXT>`` tokens; the
model's own ``get_image_features`` encodes tiles independently, so each tile is one
``MediaItem``, encoded alone. Positions are 0..T-1 as for text.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.models.families._common import new_runner, qwen2_or_llama_ok
from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.models.vision import MediaItem, PromptEmbedder
from vlmserve.engine.models.vision_cache import VisionCache

__all__ = ["MEDIA", "MODEL_TYPES", "InternVLEmbedder", "build", "supports"]

MODEL_TYPES = ("internvl",)
MEDIA = MediaRules(detail="crop")  # frame rule and `detail` (families/_media.py)


def supports(model: Any) -> bool:
    return qwen2_or_llama_ok(model)


def build(model: Any, cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    runner = new_runner(model, model.model.language_model, None)
    return runner, InternVLEmbedder(model, runner, cache)


class InternVLEmbedder(PromptEmbedder):
    def items(self, inputs: dict[str, Any], kind: str) -> list[MediaItem]:
        pixels = inputs.get("pixel_values")  # [tiles, 3, H, W]: images' tiles, videos' frames
        if pixels is None:
            return []
        return [MediaItem(pixels[i : i + 1]) for i in range(pixels.shape[0])]

    def encode(self, kind: str, item: MediaItem) -> torch.Tensor:
        out = self.model.model.get_image_features(pixel_values=item.pixels, return_dict=True)
        return out.pooler_output[0]  # [tokens per tile, hidden]
