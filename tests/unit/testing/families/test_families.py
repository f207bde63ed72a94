"""Every tiny family checkpoint loads like the real model and answers text, image and video.

Built once into the tiny cache (about 5-10 s each on first use), then read from it. Each is
loaded with vlmserve's own ``load_model`` and driven through ``build_inputs`` (the model's
processor and official chat template) into ``model.generate``.
"""

from __future__ import annotations

import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from vlmserve.engine.hf.inputs import build_inputs
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    VideoPart,
)
from vlmserve.testing import FAMILIES, build_family
from vlmserve.testing.families._common import read_template
from vlmserve.testing.media import gradient_image
from vlmserve.testing.tiny_cache import MARKER
from vlmserve.testing.tiny_tokenizer import QWEN2_VL_CHAT_TEMPLATE

ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
}
VIDEO = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "smolvlm", "internvl"]
QUESTION = "What is shown?"
QWEN_CHATML = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>What is shown?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# One user turn, an image then the question, rendered with add_generation_prompt.
RENDERED = {
    "qwen2_vl": QWEN_CHATML,
    "qwen2_5_vl": QWEN_CHATML,
    "qwen3_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is shown?"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "llava": "USER: <image>\nWhat is shown? ASSISTANT:",
    "llava_onevision": "<|im_start|>user\n<image>\nWhat is shown?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "idefics3": "<|begin_of_text|>User:<image>What is shown?<end_of_utterance>\nAssistant:",
    "smolvlm": "<|im_start|>User:<image>What is shown?<end_of_utterance>\nAssistant:",
    "gemma3": "<bos><start_of_turn>user\n<start_of_image>What is shown?<end_of_turn>\n"
    "<start_of_turn>model\n",
    "internvl": "<|im_start|>user\n<IMG_CONTEXT>\nWhat is shown?<|im_end|>\n"
    "<|im_start|>assistant\n",
}
FAMILY_NAMES = sorted(FAMILIES)


def need(family: str) -> None:
    if family == "smolvlm":
        pytest.importorskip("num2words", reason="SmolVLMProcessor needs num2words")


@cache
def loaded(family: str) -> Any:
    from vlmserve.engine.hf.loading import LoadOptions, load_model

    return load_model(LoadOptions(source=str(FAMILIES[family]()), device="cpu"))


def model_inputs(family: str, *parts: Any) -> dict[str, torch.Tensor]:
    """The processor's tensors for one user turn: ``parts`` then the question."""
    message = ChatMessage("user", [*parts, TextPart(QUESTION)])
    request = GenerateRequest(request_id="f", messages=[message], sampling=SamplingParams())
    prepared = build_inputs(loaded(family).processor, request)
    return {k: v for k, v in prepared.inputs.items() if isinstance(v, torch.Tensor)}


def generate(family: str, *parts: Any) -> tuple[str, int]:
    model = loaded(family)
    inputs = model_inputs(family, *parts)
    with torch.inference_mode():
        out = model.model.generate(**inputs, max_new_tokens=3, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    return model.processor.decode(new, skip_special_tokens=False), int(new.numel())


def test_registry_names_every_family() -> None:
    assert set(FAMILIES) == set(ARCHITECTURES)
    with pytest.raises(KeyError, match="known: gemma3, idefics3"):
        build_family("nope")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_loads_with_load_model_as_the_real_architecture(family: str) -> None:
    need(family)
    model = loaded(family)
    assert type(model.model).__name__ == ARCHITECTURES[family]
    assert model.model.config.architectures == [ARCHITECTURES[family]]
    text = model.model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert (text.hidden_size, text.num_hidden_layers, head_dim) == (128, 2, 32)
    assert sum(p.numel() for p in model.model.parameters()) < 2_000_000


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_builds_once_then_reads_the_cache(family: str) -> None:
    need(family)
    first = FAMILIES[family]()
    started = time.perf_counter()
    assert FAMILIES[family]() == first
    assert time.perf_counter() - started < 1.0
    assert (first / MARKER).is_file()
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in first.iterdir()
    }


def test_out_dir_builds_there(tmp_path: Path) -> None:
    target = tmp_path / "my-llava"
    assert build_family("llava", out_dir=target) == target
    assert (target / MARKER).is_file()
    assert (target / "chat_template.jinja").is_file() or (target / "chat_template.json").is_file()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_ships_the_vendored_official_template(family: str) -> None:
    need(family)
    template = loaded(family).processor.chat_template
    if family == "qwen2_vl":
        assert template == QWEN2_VL_CHAT_TEMPLATE
        return
    assert template == read_template(family)
    from importlib import resources

    header = resources.files("vlmserve.testing").joinpath("templates", f"{family}.jinja")
    first = header.read_text().split("#}", 1)[0].lower()
    assert "license" in first and ("vendored" in first or "copied" in first)


def test_qwen2_5_vl_template_is_qwen2_vls() -> None:
    assert read_template("qwen2_5_vl") == QWEN2_VL_CHAT_TEMPLATE


def test_smolvlm_template_is_transformers_default_video_template() -> None:
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    assert read_template("smolvlm") == DEFAULT_CHAT_TEMPLATE


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_template_renders_the_familys_prompt(family: str) -> None:
    need(family)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    rendered = loaded(family).processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == RENDERED[family]


def test_idefics3_renders_as_transformers_pins_the_official_template() -> None:
    """transformers' tests/models/idefics3/test_processing_idefics3.py::test_apply_chat_template."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What do these images show?"},
                {"type": "image"},
                {"type": "image"},
                "What do these images show?",
            ],
        },
        {
            "role": "assistant",
            "content": [
                {
                    "type": "text",
                    "text": "The first image shows the statue of Liberty in New York. The second "
                    "image picture depicts Idefix, the dog of Obelix in Asterix and Obelix.",
                }
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "And who is that?"}]},
    ]
    rendered = loaded("idefics3").processor.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert rendered == (
        "<|begin_of_text|>User: What do these images show?<image><image><end_of_utterance>\n"
        "Assistant: The first image shows the statue of Liberty in New York. The second image "
        "picture depicts Idefix, the dog of Obelix in Asterix and Obelix.<end_of_utterance>\n"
        "User: And who is that?<end_of_utterance>\n"
        "Assistant:"
    )


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generates_from_text(family: str) -> None:
    need(family)
    text, count = generate(family)
    assert count > 0 and isinstance(text, str)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generates_from_an_image(family: str) -> None:
    need(family)
    text, count = generate(family, ImagePart(gradient_image(64, 48)))
    assert count > 0 and isinstance(text, str)


def last_logits(family: str, *parts: Any) -> torch.Tensor:
    with torch.inference_mode():
        return loaded(family).model(**model_inputs(family, *parts)).logits[0, -1]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_image_changes_what_the_model_computes(family: str) -> None:
    """Random weights, but not degenerate ones: a checkpoint whose projector is all zeros
    (Gemma 3 initialises it so) would embed every image as the same nothing, and every
    test of image attention on it would pass whatever the code did."""
    need(family)
    one = last_logits(family, ImagePart(gradient_image(64, 48, seed=1)))
    other = last_logits(family, ImagePart(gradient_image(64, 48, seed=2)))
    assert (one - other).abs().max() > 1e-3


@pytest.mark.parametrize("family", VIDEO)
def test_generates_from_a_video(family: str) -> None:
    need(family)
    frames = [gradient_image(64, 48, seed=i) for i in range(4)]
    part = VideoPart(frames=frames, fps=8.0, frame_indices=[1, 3, 5, 7], total_frames=8)
    text, count = generate(family, part)
    assert count > 0 and isinstance(text, str)
