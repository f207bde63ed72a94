"""Embedding inputs -> VLM2Vec-style prompts, and a whole batch -> one left-padded model input.

Every item becomes one user message rendered by the model's own chat template: the media
(if any) followed by an instruction. Left padding puts every row's last real token at the
last position, which is where the embedding is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.engine.hf.inputs import fit_image, patch_factor, run_processor
from vlmserve.engine.types import EmbedInput
from vlmserve.errors import ConfigError, InvalidRequest

__all__ = ["EmbedInput", "EmbedPrompts", "build_batch", "check_input", "render", "text_positions"]


@dataclass(slots=True, frozen=True)
class EmbedPrompts:
    """The GPU worker's instructions (VLM2Vec's); ``text`` must contain ``{text}``."""

    video: str = "Represent the given video clip."
    image: str = "Represent the given image."
    text: str = "Represent the given query for retrieving relevant video clips: {text}"

    def __post_init__(self) -> None:
        if "{text}" not in self.text:
            raise ConfigError(
                f"the text embedding prompt {self.text!r} has no '{{text}}' placeholder; "
                "add one where the query goes"
            )


def check_input(item: EmbedInput, index: int = 0) -> None:
    """Raise ``InvalidRequest`` (naming ``input[index]``) unless the item is embeddable."""
    where = f"input[{index}]"
    if item.image is not None and item.frames is not None:
        raise InvalidRequest(
            f"{where} has both an image and video frames; send them as two inputs", param="input"
        )
    if item.frames is not None and not item.frames:
        raise InvalidRequest(
            f"{where} has an empty frames list; send at least one frame", param="input"
        )
    if item.text is not None and not item.text.strip():
        raise InvalidRequest(f"{where} has empty text; send text or leave it out", param="input")
    if item.text is None and item.image is None and item.frames is None:
        raise InvalidRequest(
            f"{where} is empty; send text, an image or video frames", param="input"
        )


def _content(item: EmbedInput, prompts: EmbedPrompts) -> list[dict[str, Any]]:
    """The user message's parts: media first, then the instruction (or the caller's text)."""
    if item.frames is not None:
        return [{"type": "video"}, {"type": "text", "text": item.text or prompts.video}]
    if item.image is not None:
        return [{"type": "image"}, {"type": "text", "text": item.text or prompts.image}]
    return [{"type": "text", "text": prompts.text.format(text=item.text)}]


def render(processor: Any, item: EmbedInput, prompts: EmbedPrompts) -> str:
    """The prompt text exactly as the model sees it (vision placeholders not yet expanded)."""
    messages = [{"role": "user", "content": _content(item, prompts)}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_batch(
    processor: Any, items: list[EmbedInput], prompts: EmbedPrompts
) -> dict[str, torch.Tensor]:
    """Tokenise and preprocess ``items`` as one left-padded batch (input_ids: [B, L])."""
    factor = patch_factor(processor)
    texts = [render(processor, item, prompts) for item in items]
    images = [fit_image(it.image, factor) for it in items if it.image is not None]
    videos = [[fit_image(f, factor) for f in it.frames] for it in items if it.frames is not None]
    return run_processor(processor, texts, images, videos, padding=True, padding_side="left")


def text_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (left padding): [B, L]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
