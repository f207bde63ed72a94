"""Capabilities from the model: a part the model cannot take is a 400.

LLaVA-1.5, Idefics3 and Gemma 3 take no video: their chat templates would drop a video part
and answer from the text alone. ``build_inputs`` refuses it instead, naming the architecture
and the missing capability, with ``param="messages"``.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest

from vlmserve.engine.hf.capabilities import (
    Capabilities,
    capabilities,
    processor_capabilities,
)
from vlmserve.engine.hf.inputs import build_inputs
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    VideoPart,
)
from vlmserve.errors import InvalidRequest
from vlmserve.testing.families import FAMILIES
from vlmserve.testing.media import gradient_image

TAKES_VIDEO = {
    "qwen2_vl": True,
    "qwen2_5_vl": True,
    "qwen3_vl": True,
    "llava": False,
    "llava_onevision": True,
    "idefics3": False,
    "smolvlm": True,
    "gemma3": False,
    "internvl": True,
}
ARCHITECTURE = {
    "llava": "LlavaForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}
NO_VIDEO = [name for name, video in TAKES_VIDEO.items() if not video]


def need(family: str) -> None:
    if family == "smolvlm":
        pytest.importorskip("num2words", reason="SmolVLMProcessor needs num2words")


@cache
def loaded(family: str) -> Any:
    from vlmserve.engine.hf.loading import LoadOptions, load_model

    return load_model(LoadOptions(source=str(FAMILIES[family]()), device="cpu"))


def fresh_processor(family: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(FAMILIES[family]())


def request(*parts: Any) -> GenerateRequest:
    message = ChatMessage("user", [*parts, TextPart("What is this?")])
    return GenerateRequest(request_id="c", messages=[message], sampling=SamplingParams())


def video() -> VideoPart:
    return VideoPart(frames=[gradient_image(64, 48, seed=i) for i in range(4)], fps=8.0)


def test_every_family_has_an_expectation() -> None:
    assert set(TAKES_VIDEO) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(TAKES_VIDEO))
def test_detected_from_model_and_processor(family: str) -> None:
    need(family)
    model = loaded(family)
    caps = capabilities(model.model, model.processor)
    assert caps.image is True
    assert caps.video is TAKES_VIDEO[family]
    assert caps.architecture == model.model.config.architectures[0]
    assert caps.enabled() == ["vision", "video"] if caps.video else ["vision"]
    assert processor_capabilities(model.processor) == caps  # remembered for build_inputs


@pytest.mark.parametrize("family", NO_VIDEO)
def test_video_to_a_model_without_video_is_a_400_naming_it(family: str) -> None:
    model = loaded(family)
    capabilities(model.model, model.processor)
    with pytest.raises(InvalidRequest) as caught:
        build_inputs(model.processor, request(video()))
    message = str(caught.value)
    assert f"this model ({ARCHITECTURE[family]}) does not take video input" in message
    assert "send images (frames) instead" in message
    assert caught.value.param == "messages"
    assert caught.value.status_code == 400


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_the_400_names_the_architecture_from_the_processor_alone(family: str) -> None:
    """What the engine has today: a processor, no capabilities() call at load."""
    with pytest.raises(InvalidRequest, match=rf"\({ARCHITECTURE[family]}\) does not take video"):
        build_inputs(fresh_processor(family), request(video()))


@pytest.mark.parametrize("family", NO_VIDEO)
def test_images_still_pass(family: str) -> None:
    model = loaded(family)
    prepared = build_inputs(model.processor, request(ImagePart(gradient_image(64, 48))))
    assert prepared.prompt_tokens > 0


def test_video_and_text_mixed_with_images_is_refused_whole() -> None:
    model = loaded("llava")
    with pytest.raises(InvalidRequest, match="does not take video"):
        build_inputs(model.processor, request(ImagePart(gradient_image(64, 48)), video()))


def test_a_model_taking_video_builds_video_inputs() -> None:
    model = loaded("qwen2_5_vl")
    inputs = build_inputs(model.processor, request(video())).inputs
    assert "pixel_values_videos" in inputs


def test_template_without_video_parts_means_no_video() -> None:
    """A video processor alone is not enough: the template must render the part."""
    proc = SimpleNamespace(
        image_processor=object(), video_processor=object(), chat_template="{{ messages }}"
    )
    assert processor_capabilities(proc) == Capabilities(
        image=True, video=False, architecture="SimpleNamespace"
    )


def test_image_to_a_model_without_images_is_a_400() -> None:
    caps = Capabilities(image=False, video=False, architecture="TextOnlyModel")
    proc = SimpleNamespace(chat_template="", image_processor=None)
    with pytest.raises(InvalidRequest, match=r"\(TextOnlyModel\) does not take image input"):
        build_inputs(proc, request(ImagePart(gradient_image(8, 8))), caps)
    with pytest.raises(InvalidRequest, match="does not take video input; send text only"):
        build_inputs(proc, request(video()), caps)
