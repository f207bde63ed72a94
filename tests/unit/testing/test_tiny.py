"""The tiny checkpoints load and run with plain transformers and peft: no mocks, no hub."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
)

from vlmserve.testing import (
    TinySpec,
    build_foreign_adapter,
    build_lora_adapter,
    build_qwen2_vl,
    cache_root,
)
from vlmserve.testing.tiny_cache import MARKER, build_atomically
from vlmserve.testing.tiny_tokenizer import SPECIAL_TOKENS


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("tiny-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLMSERVE_TINY_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def checkpoint(tiny_cache: Path) -> Path:
    return build_qwen2_vl()


@pytest.fixture(scope="module")
def processor(checkpoint: Path):
    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint: Path):
    return AutoModelForImageTextToText.from_pretrained(checkpoint).eval()


def test_cache_root_follows_environment(tiny_cache: Path) -> None:
    assert cache_root() == tiny_cache


def test_checkpoint_builds_into_the_cache_with_a_completion_marker(
    tiny_cache: Path, checkpoint: Path
) -> None:
    assert checkpoint.parent == tiny_cache
    assert checkpoint.name == f"qwen2-vl-{TinySpec().key()}"
    assert (checkpoint / MARKER).is_file()
    assert (checkpoint / "model.safetensors").is_file()
    assert not [p for p in tiny_cache.iterdir() if p.name.endswith(".tmp")]


def test_checkpoint_loads_as_qwen2_vl_with_tiny_dimensions(checkpoint: Path, model) -> None:
    config = AutoConfig.from_pretrained(checkpoint)
    text, vision = config.text_config, config.vision_config
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert config.model_type == "qwen2_vl"
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (128, 4, 2)
    assert text.hidden_size // text.num_attention_heads == 32  # head_dim
    assert sum(text.rope_parameters["mrope_section"]) == 16
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.hidden_size) == (2, 64, 4, 128)
    assert config.tie_word_embeddings is True


def test_config_token_ids_are_the_tokenizer_ids(checkpoint: Path, processor) -> None:
    config = AutoConfig.from_pretrained(checkpoint)
    ids = processor.tokenizer.convert_tokens_to_ids
    assert config.image_token_id == ids("<|image_pad|>")
    assert config.video_token_id == ids("<|video_pad|>")
    assert config.vision_start_token_id == ids("<|vision_start|>")
    assert config.vision_end_token_id == ids("<|vision_end|>")
    assert config.text_config.vocab_size == len(processor.tokenizer)
    assert processor.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(
        range(len(processor.tokenizer) - len(SPECIAL_TOKENS), len(processor.tokenizer))
    )
    generation = GenerationConfig.from_pretrained(checkpoint)
    assert generation.eos_token_id == [ids("<|im_end|>"), ids("<|endoftext|>")]
    assert generation.pad_token_id == ids("<|endoftext|>")
    assert generation.bos_token_id is None
    assert generation.do_sample is False


def test_tokenizer_is_qwen2_with_qwen_special_tokens(checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)
    assert tokenizer.chat_template is not None


def test_tokenizer_round_trips_multibyte_text(processor) -> None:
    tokenizer = processor.tokenizer
    text = "héllo 中文 😀"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("😀")) > 1  # 4 UTF-8 bytes, not one token: a streaming hazard


def test_chat_template_renders_vision_tokens_and_generation_prompt(processor) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "video"},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _image() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, size=(56, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _video() -> np.ndarray:
    # [frames, height, width, channels]
    return np.random.default_rng(1).integers(0, 256, size=(4, 56, 56, 3), dtype=np.uint8)


@pytest.mark.parametrize("modality", ["text", "image", "video"])
def test_greedy_generate_produces_new_tokens(processor, model, modality: str) -> None:
    content: list[dict[str, str]] = [{"type": "text", "text": "Describe it."}]
    media: dict[str, list[object]] = {}
    if modality != "text":
        content.insert(0, {"type": modality})
        media = {"images": [_image()]} if modality == "image" else {"videos": [_video()]}
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=[prompt], return_tensors="pt", **media)
    if modality == "image":
        assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    if modality == "video":
        assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert new_tokens.shape == (8,)
    assert isinstance(processor.decode(new_tokens), str)


def test_same_spec_builds_byte_identical_weights(tmp_path: Path) -> None:
    spec = TinySpec(seed=3)
    first = build_qwen2_vl(spec, out_dir=tmp_path / "a")
    second = build_qwen2_vl(spec, out_dir=tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = build_qwen2_vl(TinySpec(seed=4), out_dir=tmp_path / "c")
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_second_build_is_a_fast_cache_hit(checkpoint: Path) -> None:
    started = time.perf_counter()
    again = build_qwen2_vl()
    assert again == checkpoint
    assert time.perf_counter() - started < 0.5


def test_spec_key_is_stable_and_tracks_fields() -> None:
    assert TinySpec().key() == TinySpec().key()
    assert TinySpec(seed=1).key() != TinySpec().key()
    with pytest.raises(ValueError, match="num_attention_heads"):
        TinySpec(hidden_size=100, num_attention_heads=3)


def test_racing_build_keeps_the_first_complete_copy(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"

    def inner(out: Path) -> None:
        (out / "who").write_text("inner")

    def outer(out: Path) -> None:
        (out / "who").write_text("outer")
        build_atomically(target, inner, what="inner")  # another process finishes first

    assert build_atomically(target, outer, what="outer") == target
    assert (target / "who").read_text() == "inner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_incomplete_out_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="not a complete"):
        build_atomically(tmp_path / "stale", lambda out: None, what="x")


def test_lora_adapter_changes_the_last_hidden_state(checkpoint: Path, processor) -> None:
    from peft import PeftModel

    adapter = build_lora_adapter(checkpoint)
    assert build_lora_adapter(checkpoint) == adapter  # cached
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoint)
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]

    inputs = processor(text=["Nama: Budi Santoso"], return_tensors="pt")
    base = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        bare = base(**inputs, output_hidden_states=True).hidden_states[-1]
    with warnings.catch_warnings():
        # peft 0.21 reads transformers 5.x's deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        adapted_model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        adapted = adapted_model(**inputs, output_hidden_states=True).hidden_states[-1]
    assert bare.shape == adapted.shape
    assert not torch.allclose(bare, adapted, atol=1e-3)


def test_foreign_adapter_is_made_for_another_architecture(tiny_cache: Path) -> None:
    adapter = build_foreign_adapter()
    assert adapter.parent == tiny_cache
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-random/Phi-3.5-vision-instruct"
    assert config["auto_mapping"]["base_model_class"] == "Phi3ForCausalLM"
    assert "qkv_proj" in config["target_modules"]
    assert (adapter / "adapter_model.safetensors").is_file()
