"""Scripted tiny checkpoints emit their text under greedy decoding, whatever the prompt.

Checked through the real ``Qwen2VLForConditionalGeneration.generate`` and through the
batching engine (which walks the weights itself), with text and image prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.parsers import REASONING_PARSERS, TOOL_PARSERS, detect_reasoning_parser
from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, SamplingParams, TextPart
from vlmserve.testing.media import gradient_image
from vlmserve.testing.scripted import (
    THINKING_CHAT_TEMPLATE,
    TOOLS_CHAT_TEMPLATE,
    build_scripted,
    plan_script,
)
from vlmserve.testing.tiny_cache import MARKER

THINKING = "The quick brown</think> The answer is 42."
TOOL_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
PROMPTS = [
    ("Hi", False),
    ("Tell me a long story about a robot who paints the sky green, please.", True),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("scripted-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLMSERVE_TINY_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def thinking_dir(cache: Path) -> Path:
    return build_scripted(THINKING, template=THINKING_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tool_dir(cache: Path) -> Path:
    return build_scripted(TOOL_CALL, template=TOOLS_CHAT_TEMPLATE)


def generate(
    directory: Path, user: str, image: bool, history: list[dict] | None = None, **kwargs: object
) -> str:
    processor = AutoProcessor.from_pretrained(directory)
    model = Qwen2VLForConditionalGeneration.from_pretrained(directory)
    content: list[dict] = [{"type": "image"}] if image else []
    content.append({"type": "text", "text": user})
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}, *(history or [])],
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )
    images = [gradient_image(64, 48)] if image else None
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=80, do_sample=False)
    new = out[0, inputs.input_ids.shape[1] :].tolist()
    assert new[-1] == processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), "ends with EOS"
    return processor.tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize(("user", "image"), PROMPTS)
def test_thinking_script_is_the_greedy_output_of_generate(
    thinking_dir: Path, user: str, image: bool
) -> None:
    assert generate(thinking_dir, user, image) == THINKING


@pytest.mark.parametrize(("user", "image"), PROMPTS)
def test_tool_call_script_with_repeated_tokens_is_the_greedy_output(
    tool_dir: Path, user: str, image: bool
) -> None:
    assert generate(tool_dir, user, image) == TOOL_CALL


def test_tool_history_renders_and_the_script_still_answers(tool_dir: Path) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    history = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    processor = AutoProcessor.from_pretrained(tool_dir)
    messages = [{"role": "user", "content": "Weather?"}, *history]
    prompt = processor.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert '<tools>\n{"type": "function"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in prompt
    assert generate(tool_dir, "Weather?", False, history, tools=tools) == TOOL_CALL


def test_thinking_template_opens_think_in_the_prompt_unless_disabled(thinking_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(thinking_dir)
    messages = [{"role": "user", "content": "Hi"}]
    on = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<think>\n\n</think>\n\n")


def test_a_prompt_with_another_tail_still_gets_the_script(thinking_dir: Path) -> None:
    # enable_thinking=False ends the prompt differently: the fallback starts the script.
    assert generate(thinking_dir, "Hi", False, enable_thinking=False) == THINKING


async def test_batching_engine_emits_the_script_for_every_row(tool_dir: Path) -> None:
    options = LoadOptions(source=str(tool_dir), device="cpu", dtype="float32")
    backend = HFChatBackend("scripted", options, max_model_len=4096, max_queued=8)
    backend.load()
    try:
        assert backend.engine is not None, "the scripted checkpoint must batch"
        for user, image in PROMPTS:
            parts: list = [ImagePart(gradient_image(64, 48))] if image else []
            parts.append(TextPart(user))
            params = SamplingParams(max_tokens=80, temperature=0.0)
            req = GenerateRequest("t", [ChatMessage("user", parts)], params)
            text = ""
            async for chunk in backend.generate(await backend.prepare(req)):
                text += chunk.text
            assert text == TOOL_CALL
    finally:
        backend.close()


def test_the_parsers_split_what_the_scripted_models_say(thinking_dir: Path, tool_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(thinking_dir)
    name = detect_reasoning_parser(processor.chat_template)
    assert name == "qwen3"
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    text = generate(thinking_dir, "Hi", False)
    assert REASONING_PARSERS[name].split(text, prompt=prompt) == (
        "The quick brown",
        " The answer is 42.",
    )
    content, calls = TOOL_PARSERS["hermes"].parse(generate(tool_dir, "Hi", False))
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}')
    ]


def test_build_is_cached_by_text_and_template(cache: Path, thinking_dir: Path) -> None:
    assert (thinking_dir / MARKER).is_file()
    assert build_scripted(THINKING, template=THINKING_CHAT_TEMPLATE) == thinking_dir
    assert build_scripted(THINKING) != thinking_dir


def test_plan_uses_longer_contexts_only_where_a_token_repeats() -> None:
    # tail (7, 8); output a b a c EOS: "a" is followed by b, then by c.
    plan = plan_script([7, 8], [1, 2, 1, 3, 9])
    contexts = dict(plan.rules)
    assert {len(ctx) for ctx, nxt in plan.rules if nxt in (2, 3)} == {2}
    assert contexts[(1, 2)] == 3  # "a" after "b" -> c
    assert plan.context == 2


def test_plan_refuses_a_script_that_cannot_be_told_apart() -> None:
    # The output repeats the whole tail with different successors.
    with pytest.raises(ValueError, match="cannot script"):
        plan_script([5], [5, 6, 5, 7])
