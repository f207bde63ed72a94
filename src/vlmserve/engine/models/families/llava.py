"""LLaVA-1.5: a Llama (or Qwen2) decoder with 1-D RoPE; CLIP tower + MLP projector.

Every image is a fixed number of ``<image>`` tokens; each is encoded alone by the model's
own ``get_image_features`` (which picks ``vision_feature_layer`` and drops the CLS token
per ``vision_feature_select_strategy``). Positions are 0..T-1 as for text.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.models.families._common import decoder_ok, new_runner
from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.models.vision import MediaItem, PromptEmbedder
from vlmserve.engine.models.vision_cache import VisionCache

__all__ = ["MEDIA", "MODEL_TYPES", "LlavaEmbedder", "build", "supports"]

MODEL_TYPES = ("llava",)
MEDIA = MediaRules()  # frame rule and `detail` (families/_media.py)
_DECODERS = ("llama", "qwen2")  # Llama-like stacks the runner walks


def supports(model: Any) -> bool:
    text = model.config.get_text_config()
    return (
        text.model_type in _DECODERS
        and decoder_ok(text, rope_types=("default", "linear", "llama3"))
        and not getattr(text, "use_sliding_window", False)
    )


def build(model: Any, cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    runner = new_runner(model, model.model.language_model, None)
    return runner, LlavaEmbedder(model, runner, cache)


class LlavaEmbedder(PromptEmbedder):
    def items(self, inputs: dict[str, Any], kind: str) -> list[MediaItem]:
        pixels = inputs.get("pixel_values")  # [images, 3, H, W]
        if pixels is None:
            return []
        return [MediaItem(pixels[i : i + 1]) for i in range(pixels.shape[0])]

    def encode(self, kind: str, item: MediaItem) -> torch.Tensor:
        out = self.model.model.get_image_features(pixel_values=item.pixels, return_dict=True)
        return out.pooler_output[0]  # [tokens, hidden]
