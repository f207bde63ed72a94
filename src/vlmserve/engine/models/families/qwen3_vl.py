"""Qwen3-VL: the Qwen3 decoder (RMSNorm on q and k per head), interleaved M-RoPE, DeepStack.

Positions come from the model's own ``get_rope_index`` (video frames split by their text
timestamps). The vision tower returns, besides the merged features, one DeepStack feature
set per ``deepstack_visual_indexes`` entry; ``Qwen3VLTextModel`` adds set ``i`` to the
hidden states of the visual tokens after decoder layer ``i``. Both are cached as one tensor
``[tokens, hidden * (1 + sets)]``; the runner adds them at prefill (decode has no visual
tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmserve.engine.models.families._common import decoder_ok, new_runner
from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.models.families.qwen2_vl import QwenVLEmbedder
from vlmserve.engine.models.vision import MediaItem, PromptEmbedder
from vlmserve.engine.models.vision_cache import VisionCache
from vlmserve.media.sampling import VideoSampling

__all__ = ["MEDIA", "MODEL_TYPES", "Qwen3VLEmbedder", "build", "supports"]

MODEL_TYPES = ("qwen3_vl",)
MEDIA = MediaRules(
    VideoSampling("processor_fps", fps=2.0, min_frames=4, max_frames=768),
    detail="pixels",
    processor_sampling=True,
)  # frame rule and `detail` (families/_media.py)


def supports(model: Any) -> bool:
    return decoder_ok(model.config.get_text_config(), rope_types=("default",))


def build(model: Any, cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    lm = model.model.language_model
    runner = new_runner(model, lm, lm.rotary_emb.mrope_section, interleaved=True)
    return runner, Qwen3VLEmbedder(model, runner, cache)


class Qwen3VLEmbedder(QwenVLEmbedder):
    def __init__(self, model: Any, runner: Any, cache: VisionCache):
        super().__init__(model, runner, cache)
        self.deepstack = len(model.config.vision_config.deepstack_visual_indexes)

    def encode(self, kind: str, item: MediaItem) -> torch.Tensor:
        inner = self.model.model
        get = inner.get_image_features if kind == "image" else inner.get_video_features
        out = get(item.pixels, item.grid, return_dict=True)
        deep = [feats[0] for feats in out.deepstack_features]  # one [tokens, hidden] per set
        return torch.cat([out.pooler_output[0], *deep], dim=-1)
