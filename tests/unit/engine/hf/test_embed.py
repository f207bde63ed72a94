"""HFEmbedBackend on the tiny Qwen2-VL + LoRA: real transformers and peft, no mocks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from vlmserve.engine.hf.adapters import BaseInfo, base_info, check_adapter_base
from vlmserve.engine.hf.embed import EmbedInput, EmbedPrompts, HFEmbedBackend
from vlmserve.engine.hf.lifecycle import ModelState
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.errors import ConfigError, InvalidRequest, ServiceUnavailable
from vlmserve.testing import build_foreign_adapter, build_lora_adapter
from vlmserve.testing.media import gradient_image

TEXT_PREFIX = "Represent the given query for retrieving relevant video clips: "


def frames(n: int, seed: int = 0) -> list[Image.Image]:
    return [gradient_image(56, 56, seed=seed * 100 + i) for i in range(n)]


def backend(tiny_dir: Path, adapter: Path | None = None, **kw: Any) -> HFEmbedBackend:
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    return HFEmbedBackend("tiny-embed", options, adapter=str(adapter) if adapter else None, **kw)


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir: Path) -> Path:
    return build_lora_adapter(tiny_dir)


@pytest.fixture(scope="module")
def embedder(tiny_dir: Path, adapter_dir: Path) -> Iterator[HFEmbedBackend]:
    b = backend(tiny_dir, adapter_dir)
    b.load()
    yield b
    b.close()


@pytest.fixture(scope="module")
def bare(tiny_dir: Path) -> Iterator[HFEmbedBackend]:
    b = backend(tiny_dir)
    b.load()
    yield b
    b.close()


@dataclass
class Reference:
    model: Any
    processor: Any


@pytest.fixture(scope="module")
def reference(tiny_dir: Path, adapter_dir: Path) -> Reference:
    """Base + LoRA merged, straight from transformers and peft (no vlmserve code)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
    return Reference(merged, AutoProcessor.from_pretrained(tiny_dir))


def reference_vector(ref: Reference, content: list[dict[str, Any]], **media: Any) -> np.ndarray:
    messages = [{"role": "user", "content": content}]
    prompt = ref.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = ref.processor(text=[prompt], return_tensors="pt", **media)
    with torch.inference_mode():
        hidden = ref.model(**inputs, output_hidden_states=True).hidden_states[-1]
    return torch.nn.functional.normalize(hidden[0, -1].float(), dim=-1).numpy()


# --- shape, norm, batching --------------------------------------------------------------
def test_text_and_video_vectors_are_unit_norm_with_the_text_hidden_size(embedder, reference):
    vectors = embedder.embed_sync([EmbedInput(text="a red car"), EmbedInput(frames=frames(4))])
    hidden = reference.model.config.get_text_config().hidden_size
    assert embedder.dim == hidden == 128
    assert vectors.shape == (2, hidden) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_text_alone_equals_text_inside_a_batch_of_mixed_lengths(embedder):
    texts = [EmbedInput(text=t) for t in ("dog", "a cat on a mat " * 12, "red car at night")]
    batch = embedder.embed_sync(texts)
    for i, item in enumerate(texts):
        np.testing.assert_allclose(embedder.embed_sync([item])[0], batch[i], atol=1e-6)


def test_video_alone_equals_video_inside_a_batch_of_different_frame_counts(embedder):
    videos = [EmbedInput(frames=frames(n, seed=n)) for n in (2, 4, 6)]
    batch = embedder.embed_sync(videos)
    for i, item in enumerate(videos):
        np.testing.assert_allclose(embedder.embed_sync([item])[0], batch[i], atol=1e-6)


def test_mixed_media_batch_and_max_batch_splits_do_not_change_vectors(embedder):
    items = [
        EmbedInput(text="short"),
        EmbedInput(frames=frames(6, seed=1)),
        EmbedInput(image=gradient_image(84, 56, seed=3)),
        EmbedInput(text="a much longer query about a moving gradient " * 4),
        EmbedInput(text="which colour moves?", frames=frames(2, seed=2)),
        EmbedInput(text="describe it", image=gradient_image(10, 10, seed=4)),  # upscaled
    ]
    together = embedder.embed_sync(items)
    alone = np.stack([embedder.embed_sync([item])[0] for item in items])
    embedder.max_batch = 4
    try:
        split = embedder.embed_sync(items)
    finally:
        embedder.max_batch = 16
    np.testing.assert_allclose(together, alone, atol=1e-6)
    np.testing.assert_allclose(split, alone, atol=1e-6)


def test_qwen2_vl_rope_positions_ignore_left_padding(reference):
    """Pins the assumption batching relies on: get_rope_index honours the attention mask."""
    proc, model = reference.processor, reference.model.model
    video = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]}]
    prompt = proc.apply_chat_template(video, tokenize=False, add_generation_prompt=True)
    clips = [frames(2), frames(6, seed=1)]

    def positions(texts: list[str], videos: list[Any]) -> torch.Tensor:
        inputs = proc(
            text=texts,
            videos=videos,
            padding=True,
            padding_side="left",
            return_tensors="pt",
            do_sample_frames=False,
        )
        pos, _ = model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            video_grid_thw=inputs["video_grid_thw"],
            attention_mask=inputs["attention_mask"],
        )
        return [pos[:, row, mask.bool()] for row, mask in enumerate(inputs["attention_mask"])]

    batched = positions([prompt, prompt], clips)
    for row, clip in enumerate(clips):
        assert torch.equal(batched[row], positions([prompt], [clip])[0])


# --- same numbers as plain transformers + peft ------------------------------------------
def test_matches_an_independent_transformers_peft_computation(embedder, reference):
    clip = frames(4, seed=7)
    ours = embedder.embed_sync([EmbedInput(text="a blue square"), EmbedInput(frames=clip)])
    text = reference_vector(reference, [{"type": "text", "text": TEXT_PREFIX + "a blue square"}])
    video = reference_vector(
        reference,
        [{"type": "video"}, {"type": "text", "text": "Represent the given video clip."}],
        videos=[clip],
        do_sample_frames=False,
    )
    assert 1 - float(ours[0] @ text) < 1e-5
    assert 1 - float(ours[1] @ video) < 1e-5


def test_adapter_is_really_applied(embedder, bare):
    items = [EmbedInput(text="a red car"), EmbedInput(frames=frames(2))]
    with_adapter, without = embedder.embed_sync(items), bare.embed_sync(items)
    assert np.all(1 - np.sum(with_adapter * without, axis=1) > 1e-3)
    assert embedder.memory_bytes == bare.memory_bytes  # merged: no LoRA weights left over


async def test_async_embed_equals_embed_sync(embedder):
    items = [EmbedInput(text="query"), EmbedInput(frames=frames(2))]
    np.testing.assert_array_equal(await embedder.embed(items), embedder.embed_sync(items))


# --- adapter refusal (an adapter made for another base) ---------------------------------
def test_foreign_adapter_is_refused_naming_both_bases(tiny_dir):
    b = backend(tiny_dir, build_foreign_adapter())
    with pytest.raises(ConfigError) as info:
        b.load()
    message = str(info.value)
    assert "tiny-random/Phi-3.5-vision-instruct" in message and "Phi3ForCausalLM" in message
    assert str(tiny_dir) in message and "Qwen2VLForConditionalGeneration" in message
    assert b.state is ModelState.FAILED and b.error == message


def test_adapter_whose_weights_do_not_fit_is_refused_after_loading(tiny_dir, tmp_path):
    """No base info to compare -> peft loads it (and only warns); the empty LoRA layers refuse."""
    anonymous = shutil.copytree(build_foreign_adapter(), tmp_path / "anonymous")
    config_path = anonymous / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["auto_mapping"], config["base_model_name_or_path"] = None, "some-org/some-base"
    config_path.write_text(json.dumps(config))
    b = backend(tiny_dir, anonymous)
    with pytest.raises(ConfigError, match="LoRA layers got no weights") as info:
        b.load()
    assert "some-org/some-base" in str(info.value) and str(tiny_dir) in str(info.value)
    assert b.state is ModelState.FAILED


QWEN = BaseInfo(
    "/m/qwen2-vl-2b",
    frozenset({"/m/qwen2-vl-2b", "qwen/qwen2-vl-2b-instruct"}),
    "Qwen2VLForConditionalGeneration",
    "qwen2_vl",
)


@pytest.mark.parametrize(
    ("config", "known"),
    [
        ({"base_model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct"}, True),  # its _name_or_path
        ({"base_model_name_or_path": "org/qwen2-vl-2b/"}, True),  # a repo named like the dir
        (
            {
                "base_model_name_or_path": "other/name",
                "auto_mapping": {"base_model_class": "Qwen2VLModel"},
            },
            True,  # same architecture family
        ),
        ({"base_model_name_or_path": "org/unknown-thing"}, False),  # weights checked later
        ({}, False),
    ],
)
def test_adapter_base_check_accepts_the_same_or_an_unknown_base(config, known):
    assert check_adapter_base("/a", config, QWEN) is known


def test_base_names_include_resolved_paths_and_hub_cache_repo_ids(tmp_path):
    snapshot = tmp_path / "models--Qwen--Qwen2-VL-2B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "link").symlink_to(snapshot)
    info = base_info(str(tmp_path / "link"), object())
    assert check_adapter_base("/a", {"base_model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct"}, info)
    assert check_adapter_base("/a", {"base_model_name_or_path": f"{snapshot}/"}, info)


def test_adapter_base_check_refuses_a_base_of_another_family_by_name():
    with pytest.raises(ConfigError, match=r"'microsoft/Phi-3.5-vision-instruct'.*'/m/qwen2-vl-2b'"):
        check_adapter_base(
            "/a", {"base_model_name_or_path": "microsoft/Phi-3.5-vision-instruct"}, QWEN
        )


# --- prompts and input checks -----------------------------------------------------------
def test_render_uses_seed_000_prompts_through_the_chat_template(embedder):
    text = embedder.render(EmbedInput(text="a red car"))
    video = embedder.render(EmbedInput(frames=frames(2)))
    assert TEXT_PREFIX + "a red car" in text and text.startswith("<|im_start|>")
    assert "<|video_pad|>" in video and "Represent the given video clip." in video
    assert "<|image_pad|>" in embedder.render(EmbedInput(image=gradient_image(56, 56)))


def test_custom_prompts_need_a_text_placeholder():
    with pytest.raises(ConfigError, match="placeholder"):
        EmbedPrompts(text="Query:")


@pytest.mark.parametrize(
    "items",
    [
        [],
        [EmbedInput()],
        [EmbedInput(text="  ")],
        [EmbedInput(frames=[])],
        [EmbedInput(image=gradient_image(56, 56), frames=frames(2))],
    ],
)
def test_bad_inputs_are_invalid_requests(embedder, items):
    with pytest.raises(InvalidRequest):
        embedder.embed_sync(items)


def test_an_unloaded_backend_is_unavailable(tiny_dir):
    with pytest.raises(ServiceUnavailable, match="unloaded"):
        backend(tiny_dir).embed_sync([EmbedInput(text="x")])
