"""The image-processor cache: same tensors as the processor's own, and the vision cache's key
passed along so a repeated image is neither preprocessed nor hashed again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoProcessor
from transformers.image_processing_backends import TorchvisionBackend

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.inputs import run_processor
from vlmserve.engine.hf.loading import LoadOptions, load_processor
from vlmserve.engine.hf.processor_cache import CachedImageProcessor, block_call, install
from vlmserve.engine.types import ChatMessage, GenerateRequest, ImagePart, SamplingParams, TextPart
from vlmserve.media.workers.shared import LentImage, release_block, write_block
from vlmserve.testing.families import FAMILIES, build_family
from vlmserve.testing.media import gradient_image

ONE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image's placeholder
PROMPT = f"{ONE}a and b {ONE}"


@pytest.fixture
def processors(tiny_dir: Path) -> tuple[object, object]:
    plain = AutoProcessor.from_pretrained(str(tiny_dir))
    cached = AutoProcessor.from_pretrained(str(tiny_dir))
    assert isinstance(install(cached, 64 * 2**20), CachedImageProcessor)
    return plain, cached


def assert_same(a: dict, b: dict) -> None:
    tensors = {k for k, v in a.items() if isinstance(v, torch.Tensor)}
    assert tensors == {k for k, v in b.items() if isinstance(v, torch.Tensor)}
    for key in tensors:
        assert torch.equal(a[key], b[key]), key


def test_cached_outputs_equal_the_processors_own_cold_and_warm(processors) -> None:
    plain, cached = processors
    images = [gradient_image(120, 90, seed=1), gradient_image(56, 200, seed=2)]
    expected = run_processor(plain, [PROMPT], images, [])
    cold = run_processor(cached, [PROMPT], images, [])
    warm = run_processor(cached, [PROMPT], images, [])
    assert_same(expected, cold)
    assert_same(expected, warm)
    assert cached.image_processor.stats()["hits"] == 2  # both images, second call
    assert cached.image_processor.stats()["misses"] == 2
    assert cold["image_keys"] == warm["image_keys"] and len(set(cold["image_keys"])) == 2
    assert "image_keys" not in expected


def test_one_changed_pixel_is_a_different_entry(processors) -> None:
    _, cached = processors
    image = gradient_image(64, 64, seed=3)
    changed = image.copy()
    changed.putpixel((5, 5), (0, 0, 0) if image.getpixel((5, 5)) != (0, 0, 0) else (1, 1, 1))
    one = run_processor(cached, [ONE], [image], [])
    two = run_processor(cached, [ONE], [changed], [])
    assert one["image_keys"] != two["image_keys"]
    assert cached.image_processor.stats()["hits"] == 0


def test_entries_are_evicted_by_bytes(tiny_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(str(tiny_dir))
    one = gradient_image(64, 64, seed=4)
    size = run_processor(processor, [ONE], [one], [])["pixel_values"]
    cache = install(processor, size.numel() * size.element_size())  # room for one image
    assert cache is not None
    for seed in (4, 5, 4):
        run_processor(processor, [ONE], [gradient_image(64, 64, seed=seed)], [])
    assert cache.stats()["entries"] == 1 and cache.stats()["hits"] == 0


def test_text_only_calls_carry_no_keys(processors) -> None:
    _, cached = processors
    run_processor(cached, [PROMPT], [gradient_image(64, 64), gradient_image(64, 64)], [])
    assert "image_keys" not in run_processor(cached, ["just text"], [], [])


async def test_a_repeated_image_skips_preprocessing_and_decodes_the_same(tiny_dir: Path) -> None:
    def backend(processor_cache: int) -> HFChatBackend:
        options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
        b = HFChatBackend(
            "pc",
            options,
            max_model_len=4096,
            max_queued=8,
            vision_cache_bytes=2**24,
            processor_cache_bytes=processor_cache,
        )
        b.load()
        return b

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def ask() -> GenerateRequest:
        parts = [ImagePart(gradient_image(100, 70, seed=9)), TextPart("What is this?")]
        return GenerateRequest("pc", [ChatMessage("user", parts)], greedy)

    async def tokens(b: HFChatBackend) -> list[int]:
        return [t async for c in b.generate(await b.prepare(ask())) for t in c.token_ids]

    cached, plain = backend(2**24), backend(0)
    try:
        first, second = await tokens(cached), await tokens(cached)
        assert cached.processor_cache_stats()["hits"] == 1
        assert cached.vision_cache_stats()["hits"] == 1  # found under the processor's key
        assert plain.processor_cache_stats() == {"hits": 0, "misses": 0, "bytes": 0, "entries": 0}
        assert first == second == await tokens(plain)
    finally:
        cached.close()
        plain.close()


@pytest.mark.parametrize(
    ("bounds", "patches"),
    [({}, 256), ({"max_pixels": 1003520}, 1024), ({"min_pixels": 6272, "max_pixels": 100352}, 484)],
)
def test_one_pixel_bound_alone_keeps_the_checkpoints_other_bound(
    tiny_dir: Path, bounds: dict[str, int], patches: int
) -> None:
    """--max-pixels without --min-pixels used to make every image request a 400."""
    processor = load_processor(LoadOptions(source=str(tiny_dir), **bounds))
    out = run_processor(processor, [ONE], [gradient_image(448, 448)], [])
    assert out["pixel_values"].shape[0] == patches  # the tiny checkpoint caps at 224x224


def test_a_processor_without_per_image_rows_passes_through_uncached() -> None:
    from transformers import CLIPImageProcessor  # pixel_values [n, 3, H, W]: a batch, no grid

    inner = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    cached = CachedImageProcessor(inner, 2**24)
    images = [gradient_image(40, 40, seed=1), gradient_image(50, 40, seed=2)]
    for _ in range(2):
        out = cached(images, return_tensors="pt")
        assert torch.equal(out["pixel_values"], inner(images, return_tensors="pt")["pixel_values"])
        assert cached.take_keys() is None
    assert cached.stats()["entries"] == 0 and cached.stats()["hits"] == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_block_image_is_preprocessed_to_the_same_bytes_as_its_pil_image(family: str) -> None:
    """An image in a shared block goes to a torchvision-backed processor as a view of the
    block (no PIL image made of it), and the output is byte for byte the PIL image's."""
    inner = AutoProcessor.from_pretrained(str(build_family(family))).image_processor
    arrays = isinstance(inner, TorchvisionBackend)
    for width, height in [(120, 90), (41, 3), (333, 177)]:  # 41x3: channels first or last?
        photo = gradient_image(width, height, seed=width)
        shared = write_block(photo)
        try:
            images, kwargs = block_call(LentImage(shared), inner, {"return_tensors": "pt"})
            assert isinstance(images[0], np.ndarray) == arrays
            assert_same(inner([photo], return_tensors="pt"), inner(images, **kwargs))
        finally:
            release_block(shared.name)
