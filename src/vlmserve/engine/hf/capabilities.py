"""What a loaded model takes as input (images, video), detected from its config and processor.

A family takes images when its config has a vision tower and its processor an image
processor; it takes video when the processor also has a video processor *and* the chat
template renders video parts (LLaVA-1.5, Idefics3 and Gemma 3 have neither: their templates
would drop a video part silently). ``build_inputs`` refuses a part the model cannot take with
a 400 naming the architecture and the missing capability.

``capabilities(model, processor)`` also remembers the result on the processor, so
``processor_capabilities(processor)`` -- all that ``build_inputs`` has -- names the real
architecture; without that call it reads the architecture from the checkpoint's config.json.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Capabilities", "capabilities", "processor_capabilities"]

_ATTR = "_vlmserve_capabilities"


@dataclass(frozen=True, slots=True)
class Capabilities:
    image: bool
    video: bool
    architecture: str = "unknown"  # e.g. "LlavaForConditionalGeneration", for messages

    def enabled(self) -> list[str]:
        """The input kinds taken, as named in the registry ("vision", "video")."""
        return [name for name, on in (("vision", self.image), ("video", self.video)) if on]


def capabilities(model: Any, processor: Any) -> Capabilities:
    """Detect from the model's config and its processor; remembered on the processor."""
    config = getattr(model, "config", None)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    has_tower = config is None or any(
        getattr(config, name, None) is not None for name in ("vision_config", "vision_tower")
    )
    caps = Capabilities(
        image=has_tower and _takes_images(processor),
        video=has_tower and _takes_video(processor),
        architecture=str(architectures[0]),
    )
    _remember(processor, caps)
    return caps


def processor_capabilities(processor: Any) -> Capabilities:
    """The capabilities ``capabilities()`` remembered, else detected from the processor alone."""
    cached = getattr(processor, _ATTR, None)
    if isinstance(cached, Capabilities):
        return cached
    caps = Capabilities(
        image=_takes_images(processor),
        video=_takes_video(processor),
        architecture=_architecture(processor),
    )
    _remember(processor, caps)
    return caps


def _takes_images(processor: Any) -> bool:
    return getattr(processor, "image_processor", None) is not None


def _takes_video(processor: Any) -> bool:
    if getattr(processor, "video_processor", None) is None:
        return False
    template = getattr(processor, "chat_template", None)
    if isinstance(template, dict):  # named templates: any of them
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "video" in template


def _architecture(processor: Any) -> str:
    """``architectures[0]`` of the checkpoint the processor was loaded from, else its class."""
    tokenizer = getattr(processor, "tokenizer", None)
    source = getattr(tokenizer, "name_or_path", None)
    if source:
        try:
            config = json.loads((Path(source) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        architectures = config.get("architectures") if isinstance(config, dict) else None
        if architectures:
            return str(architectures[0])
    return type(processor).__name__


def _remember(processor: Any, caps: Capabilities) -> None:
    with contextlib.suppress(AttributeError):  # __slots__: detected again next time
        setattr(processor, _ATTR, caps)
