"""Chat messages -> model inputs, through the model's own chat template and processor.

Media the model cannot take (a video for LLaVA-1.5, Idefics3 or Gemma 3) is refused with a
400 naming the architecture (``capabilities``), never dropped by the template. Video frames
were chosen where the clip was decoded, by the family's rule (``families/_media.py``; for
Qwen3-VL the same frames its video processor's own 2-fps sampling picks), and reach the
processor with their timing (``VideoMetadata``: the clip's fps, frame count and each frame's
source index), so the processor neither samples them again (``do_sample_frames`` is off: it
would index the whole clip) nor guesses an fps for its timestamps.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmserve.engine.hf.capabilities import Capabilities, processor_capabilities
from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, TextPart, VideoPart
from vlmserve.errors import InvalidRequest
from vlmserve.media.workers.shared import LentImage

__all__ = [
    "Prepared",
    "build_inputs",
    "check_media",
    "fit_image",
    "frames_array",
    "metadata_for",
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
    prompt_text: str = ""  # the rendered prompt (placeholders not expanded)
    parsers: Any = None  # engine.outputs.OutputParsers when the answer is parsed


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


@dataclass(slots=True)
class _Rendered:
    """Messages in the template's shape, and their media in order."""

    messages: list[dict[str, Any]]
    images: list[Image.Image]
    videos: list[list[Image.Image]]
    metadata: list[Any]  # one transformers VideoMetadata per video


def _template_messages(messages: list[ChatMessage], factor: int) -> _Rendered:
    out = _Rendered(messages=[], images=[], videos=[], metadata=[])
    for message in messages:
        content: list[dict[str, Any]] = []
        for part in message.content:
            if isinstance(part, TextPart):
                content.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                out.images.append(fit_image(part.image, factor))
                content.append({"type": "image"})
            elif isinstance(part, VideoPart):
                frames = [fit_image(f, factor) for f in part.frames]
                out.videos.append(frames)
                out.metadata.append(metadata_for(part, frames))
                content.append({"type": "video"})
        out.messages.append(_with_history(message, {"role": message.role, "content": content}))
    return out


def _with_history(message: ChatMessage, shaped: dict[str, Any]) -> dict[str, Any]:
    """An agent's history fields, the way chat templates read them (vLLM does the same):
    ``tool_calls`` with their arguments as objects, ``tool_call_id``, ``reasoning_content``."""
    if message.tool_calls:
        shaped["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        shaped["tool_call_id"] = message.tool_call_id
    if message.reasoning:
        shaped["reasoning_content"] = message.reasoning
    return shaped


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else the template gets the text as sent
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def _template_kwargs(request: GenerateRequest) -> dict[str, Any]:
    """``chat_template_kwargs`` (e.g. ``enable_thinking``) and the request's tools."""
    kwargs = dict(request.output.chat_template_kwargs)
    if request.output.tools and request.output.tool_choice != "none":
        kwargs["tools"] = request.output.tools
    return kwargs


def metadata_for(part: VideoPart, frames: list[Image.Image] | None = None) -> Any:
    """The part's timing as transformers' ``VideoMetadata`` (what a processor that samples a
    file itself would record): source fps, frame count, duration and sampled indices."""
    from transformers.video_utils import VideoMetadata

    frames = part.frames if frames is None else frames
    indices = list(range(len(frames)))
    if part.frame_indices is not None and len(part.frame_indices) == len(frames):
        indices = [int(i) for i in part.frame_indices]
    total = max(part.total_frames or 0, indices[-1] + 1 if indices else 0, len(frames))
    fps = float(part.fps) if part.fps is not None and part.fps > 0 else None
    width, height = frames[0].size if frames else (None, None)
    return VideoMetadata(
        total_num_frames=total,
        fps=fps,
        width=width,
        height=height,
        duration=total / fps if fps else None,
        frames_indices=indices,
    )


def check_media(caps: Capabilities, messages: list[ChatMessage]) -> None:
    """400 for an image or video part the model cannot take (never a silent drop)."""
    parts = [p for m in messages for p in m.content]
    if not caps.video and any(isinstance(p, VideoPart) for p in parts):
        instead = "send images (frames) instead" if caps.image else "send text only"
        raise InvalidRequest(
            f"this model ({caps.architecture}) does not take video input; {instead}",
            param="messages",
        )
    if not caps.image and any(isinstance(p, ImagePart) for p in parts):
        raise InvalidRequest(
            f"this model ({caps.architecture}) does not take image input; send text only",
            param="messages",
        )


def patch_factor(processor: Any) -> int:
    ip = getattr(processor, "image_processor", None)
    return int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2))


def render_prompt(processor: Any, messages: list[ChatMessage], **kwargs: Any) -> str:
    """The prompt text exactly as the model sees it (vision placeholders not yet expanded).

    A part the model cannot take is a 400 here too: the template would drop it silently.
    """
    check_media(processor_capabilities(processor), messages)
    rendered = _template_messages(messages, patch_factor(processor))
    return _apply_template(processor, rendered.messages, kwargs)


def _apply_template(processor: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    try:
        return processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except (TypeError, ValueError, KeyError) as exc:  # jinja errors raised by the template
        raise InvalidRequest(
            f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from exc


def run_processor(
    processor: Any,
    texts: list[str],
    images: list[Image.Image],
    videos: list[list[Image.Image]],
    *,
    video_metadata: list[Any] | None = None,
    **extra: Any,
) -> dict[str, torch.Tensor]:
    """The model's processor on prompts + media; its input errors become a 400.

    ``video_metadata`` (one ``VideoMetadata`` per video) carries the frames' timing; without
    it the processor assumes consecutive frames and, where it timestamps them, 24 fps.
    """
    kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt", **extra}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = [frames_array(frames) for frames in videos]
        kwargs["do_sample_frames"] = False  # frames were sampled (and bounded) by vlmserve.media
        if video_metadata is not None:
            kwargs["video_metadata"] = video_metadata
    try:
        out = dict(processor(**kwargs))
    except ValueError as exc:  # the processor's own input checks
        raise InvalidRequest(f"the model's processor rejected the input: {exc}") from exc
    take_keys = getattr(getattr(processor, "image_processor", None), "take_keys", None)
    if images and take_keys is not None and (keys := take_keys()) is not None:
        out["image_keys"] = keys  # processor_cache: the vision cache's keys, already hashed
    return out


def frames_array(frames: list[Image.Image]) -> np.ndarray | list[Image.Image]:
    """One video's frames as the [frames, height, width, 3] uint8 array transformers makes of
    them (``convert_pil_frames_to_video``: ``np.stack`` of each frame's ``np.array``), made
    once here: given the frames, a processor makes it three times (its input check, its
    video step and the video processor's own), packing each frame out of PIL every time. A
    frame in a shared block is copied into it from a mapping of the block. Frames that are
    not all RGB of one size are passed as they are."""
    if not frames or any(f.mode != "RGB" or f.size != frames[0].size for f in frames):
        return frames
    width, height = frames[0].size
    out = np.empty((len(frames), height, width, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        out[i] = frame.rgb() if isinstance(frame, LentImage) else np.asarray(frame)
    return out


def build_inputs(
    processor: Any,
    request: GenerateRequest,
    caps: Capabilities | None = None,
    processor_kwargs: dict[str, Any] | None = None,
) -> Prepared:
    """Tokenised, preprocessed inputs for one request; 400 for media the model cannot take.

    ``caps`` defaults to ``processor_capabilities(processor)``; ``processor_kwargs``: the
    request's media options for the processor (``media_options.processor_kwargs``).
    """
    check_media(caps or processor_capabilities(processor), request.messages)
    rendered = _template_messages(request.messages, patch_factor(processor))
    text = _apply_template(processor, rendered.messages, _template_kwargs(request))
    inputs = run_processor(
        processor,
        [text],
        rendered.images,
        rendered.videos,
        video_metadata=rendered.metadata,
        **(processor_kwargs or {}),
    )
    if request.prefix_token_ids:
        inputs = _append_prefix(inputs, request.prefix_token_ids)
    tokens = int(inputs["input_ids"].shape[1])
    return Prepared(request=request, inputs=inputs, prompt_tokens=tokens, prompt_text=text)


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
