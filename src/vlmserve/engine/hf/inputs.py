"""Chat messages -> model inputs, through the model's own chat template and processor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, TextPart, VideoPart
from vlmserve.errors import InvalidRequest

__all__ = [
    "Prepared",
    "build_inputs",
    "fit_image",
    "patch_factor",
    "render_prompt",
    "run_processor",
]

_MAX_ASPECT = 150  # Qwen2-VL's smart_resize refuses aspect ratios over 200


@dataclass(slots=True)
class Prepared:
    """A request whose inputs are tokenised and preprocessed, ready for the model."""

    request: GenerateRequest
    inputs: dict[str, torch.Tensor]
    prompt_tokens: int  # prompt length including any continued prefix
    grammar: Any = None  # engine.hf.grammar.CompiledGrammar when response_format is set


def fit_image(image: Image.Image, factor: int) -> Image.Image:
    """Upscale images smaller than one vision patch; refuse extreme aspect ratios with a 400.

    A 1x1 or 1xN image is legal input (vLLM crashed on them, CVE-2026-22773), so it is
    resized to the smallest size the vision tower accepts instead of reaching the processor.
    """
    w, h = image.size
    if max(w, h) / min(w, h) > _MAX_ASPECT:
        raise InvalidRequest(
            f"image is {w}x{h} pixels: aspect ratio over {_MAX_ASPECT}:1 is not supported; "
            "crop or pad it first"
        )
    if min(w, h) >= factor:
        return image
    scale = factor / min(w, h)
    return image.resize((max(factor, round(w * scale)), max(factor, round(h * scale))))


def _template_messages(
    messages: list[ChatMessage], factor: int
) -> tuple[list[dict[str, Any]], list[Image.Image], list[list[Image.Image]]]:
    rendered: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    videos: list[list[Image.Image]] = []
    for message in messages:
        content: list[dict[str, Any]] = []
        for part in message.content:
            if isinstance(part, TextPart):
                content.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                images.append(fit_image(part.image, factor))
                content.append({"type": "image"})
            elif isinstance(part, VideoPart):
                videos.append([fit_image(f, factor) for f in part.frames])
                content.append({"type": "video"})
        rendered.append({"role": message.role, "content": content})
    return rendered, images, videos


def patch_factor(processor: Any) -> int:
    ip = getattr(processor, "image_processor", None)
    return int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2))


def render_prompt(processor: Any, messages: list[ChatMessage]) -> str:
    """The prompt text exactly as the model sees it (vision placeholders not yet expanded)."""
    rendered, _, _ = _template_messages(messages, patch_factor(processor))
    return processor.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)


def run_processor(
    processor: Any,
    texts: list[str],
    images: list[Image.Image],
    videos: list[list[Image.Image]],
    **extra: Any,
) -> dict[str, torch.Tensor]:
    """The model's processor on prompts + media; its input errors become a 400."""
    kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt", **extra}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
        kwargs["do_sample_frames"] = False  # frames were sampled (and bounded) by vlmserve.media
    try:
        out = dict(processor(**kwargs))
    except ValueError as exc:  # the processor's own input checks
        raise InvalidRequest(f"the model's processor rejected the input: {exc}") from exc
    take_keys = getattr(getattr(processor, "image_processor", None), "take_keys", None)
    if images and take_keys is not None and (keys := take_keys()) is not None:
        out["image_keys"] = keys  # processor_cache: the vision cache's keys, already hashed
    return out


def build_inputs(processor: Any, request: GenerateRequest) -> Prepared:
    rendered, images, videos = _template_messages(request.messages, patch_factor(processor))
    text = processor.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    inputs = run_processor(processor, [text], images, videos)
    if request.prefix_token_ids:
        inputs = _append_prefix(inputs, request.prefix_token_ids)
    return Prepared(request=request, inputs=inputs, prompt_tokens=int(inputs["input_ids"].shape[1]))


def _append_prefix(inputs: dict[str, torch.Tensor], prefix: list[int]) -> dict[str, torch.Tensor]:
    """Continue after already-generated tokens: append them to the prompt (ids, not text)."""
    extra = torch.tensor([prefix], dtype=inputs["input_ids"].dtype)
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    out["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(extra)], dim=1)
    if "mm_token_type_ids" in inputs:
        mm = inputs["mm_token_type_ids"]
        out["mm_token_type_ids"] = torch.cat([mm, torch.zeros_like(extra, dtype=mm.dtype)], dim=1)
    return out
