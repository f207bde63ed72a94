"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder (q/k/v bias) with M-RoPE.

Both language models are Qwen2's; positions come from the model's own ``get_rope_index``
(Qwen2.5-VL's spaces video frames by ``second_per_grid_ts``). Images and videos are patch
rows plus a ``grid_thw`` each, encoded one at a time by ``get_image_features`` /
``get_video_features`` (Qwen2.5-VL's windowed ViT included).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.models.families._common import decoder_ok, new_runner
from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.models.vision import MediaItem, PromptEmbedder
from vlmserve.engine.models.vision_cache import VisionCache
from vlmserve.media.sampling import QWEN_VL_UTILS

__all__ = ["MEDIA", "MODEL_TYPES", "QwenVLEmbedder", "build", "supports"]

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
MEDIA = MediaRules(QWEN_VL_UTILS, detail="pixels")  # frame rule and `detail` (families/_media.py)
_TEXT, _IMAGE, _VIDEO = 0, 1, 2  # mm_token_type_ids values
_GRID = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}


def supports(model: Any) -> bool:
    text = model.config.get_text_config()
    return decoder_ok(text, rope_types=("default",)) and not getattr(
        text, "use_sliding_window", False
    )


def build(model: Any, cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    lm = model.model.language_model
    runner = new_runner(model, lm, lm.rotary_emb.mrope_section)
    return runner, QwenVLEmbedder(model, runner, cache)


class QwenVLEmbedder(PromptEmbedder):
    kinds = ("image", "video")

    def placeholder_tokens(self) -> dict[str, int]:
        config = self.model.config
        return {"image": int(config.image_token_id), "video": int(config.video_token_id)}

    def items(self, inputs: dict[str, Any], kind: str) -> list[MediaItem]:
        pixels_key, grid_key = _GRID[kind]
        pixels, grids = inputs.get(pixels_key), inputs.get(grid_key)
        if pixels is None or grids is None:
            return []
        sizes = grids.prod(dim=-1).tolist()  # patch rows per item
        keys = inputs.get(f"{kind}_keys")  # from the processor cache: no need to hash again
        if keys is None or len(keys) != len(sizes):
            keys = [None] * len(sizes)
        out, start = [], 0
        for i, size in enumerate(sizes):
            out.append(MediaItem(pixels[start : start + size], grids[i : i + 1], keys[i]))
            start += size
        return out

    def encode(self, kind: str, item: MediaItem) -> torch.Tensor:
        inner = self.model.model
        get = inner.get_image_features if kind == "image" else inner.get_video_features
        return get(item.pixels, item.grid, return_dict=True).pooler_output[0]  # [tokens, hidden]

    def positions(self, inputs: dict[str, Any], ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        types = inputs.get("mm_token_type_ids")
        if types is None:
            types = torch.zeros_like(ids)
            types[ids == self.tokens["image"]] = _IMAGE
            types[ids == self.tokens["video"]] = _VIDEO
        else:
            types = types[0].to(ids.device)
        extra = {
            k: inputs[k].to(ids.device)
            for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
            if inputs.get(k) is not None
        }
        positions, delta = self.model.model.get_rope_index(ids[None], types[None], **extra)
        return positions[:, 0], int(delta.reshape(-1)[0])  # [3, T]
