"""LLaVA-OneVision: a Qwen2 decoder with 1-D RoPE; SigLIP tower, anyres image tiles, video.

Each image is encoded alone by the model's own ``get_image_features`` (its tiles, unpadding
and ``image_newline`` packing by ``image_sizes``; ``batch_num_images`` as the processor gave
it, which decides whether the image is tiled); each video alone by ``get_video_features``
(frames pooled 2x2, one newline after the last frame). Positions are 0..T-1 as for text.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.models.families._common import new_runner, qwen2_or_llama_ok
from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.models.vision import MediaItem, PromptEmbedder
from vlmserve.engine.models.vision_cache import VisionCache

__all__ = ["MEDIA", "MODEL_TYPES", "OnevisionEmbedder", "build", "supports"]

MODEL_TYPES = ("llava_onevision",)
MEDIA = MediaRules()  # frame rule and `detail` (families/_media.py)


def supports(model: Any) -> bool:
    return qwen2_or_llama_ok(model)


def build(model: Any, cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    runner = new_runner(model, model.model.language_model, None)
    return runner, OnevisionEmbedder(model, runner, cache)


class OnevisionEmbedder(PromptEmbedder):
    kinds = ("image", "video")

    def placeholder_tokens(self) -> dict[str, int]:
        config = self.model.config
        return {"image": int(config.image_token_id), "video": int(config.video_token_id)}

    def items(self, inputs: dict[str, Any], kind: str) -> list[MediaItem]:
        if kind == "video":
            videos = inputs.get("pixel_values_videos")  # [videos, frames, 3, H, W]
            return [] if videos is None else [MediaItem(v[None]) for v in videos]
        pixels, sizes = inputs.get("pixel_values"), inputs.get("image_sizes")
        if pixels is None or sizes is None:
            return []
        groups = inputs.get("batch_num_images")
        group_of = [int(n) for n in groups for _ in range(int(n))] if groups is not None else []
        out = []
        for i in range(pixels.shape[0]):
            group = group_of[i] if i < len(group_of) else 1
            # grid: (height, width, images in its group) -- all the tower reads besides pixels
            grid = torch.tensor([[int(sizes[i][0]), int(sizes[i][1]), group]])
            out.append(MediaItem(pixels[i : i + 1], grid))
        return out

    def encode(self, kind: str, item: MediaItem) -> torch.Tensor:
        inner = self.model.model
        if kind == "video":
            out = inner.get_video_features(item.pixels, return_dict=True)
            return out.pooler_output[0]  # [frames * pooled + 1, hidden]
        assert item.grid is not None
        sizes, group = item.grid[:, :2], item.grid[:, 2]
        out = inner.get_image_features(item.pixels, sizes, batch_num_images=group, return_dict=True)
        return out.pooler_output[0]  # [tokens, hidden]
