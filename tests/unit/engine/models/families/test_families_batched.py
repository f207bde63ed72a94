"""Every batched family on the continuous-batching engine, on its tiny real checkpoint.

This file runs the Qwen families; ``test_families_batched_llava.py`` and
``test_families_batched_tiles.py``, ``test_families_batched_gemma3.py`` run the same tests
(imported) on the others. Per family
(``vlmserve.testing.families``: transformers' own classes, random weights): the runner's
greedy tokens equal ``model.generate`` alone (text, image, two images, video where the
family takes it); a request's tokens are the same alone and joined mid-flight into a busy
batch of that model; 8 concurrent requests decode together; a family without a runner
keeps the ``model.generate`` path.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.engine.core.test_batching import Outcome, concurrently, run, start_all, wait_for

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.models.architectures import supports
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    VideoPart,
)
from vlmserve.testing import FAMILIES
from vlmserve.testing.media import gradient_image

ALL_BATCHED = [
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "llava_onevision",
    "idefics3",
    "smolvlm",
    "internvl",
    "gemma3",
]
VIDEO = {"qwen2_5_vl", "qwen3_vl", "llava_onevision", "smolvlm", "internvl"}  # take video


def backend_for(family: str, dtype: str = "float32", **kw: Any) -> HFChatBackend:
    if family == "smolvlm":
        pytest.importorskip("num2words", reason="SmolVLMProcessor needs num2words")
    options = LoadOptions(source=str(FAMILIES[family]()), device="cpu", dtype=dtype)
    kw = {
        "max_model_len": 4096,
        "max_queued": 64,
        "vision_cache_bytes": 0,
        "processor_cache_bytes": 0,
        "max_num_seqs": 8,
        **kw,
    }
    backend = HFChatBackend(family, options, **kw)
    backend.load()
    assert backend.engine is not None, f"{family} must run on the batching engine"
    return backend


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family(request: pytest.FixtureRequest) -> Iterator[tuple[str, HFChatBackend]]:
    backend = backend_for(request.param)
    yield request.param, backend
    backend.close()


def request(
    text: str,
    *,
    images: list[tuple[int, int, int]] = (),  # type: ignore[assignment]
    video: int = 0,
    max_tokens: int = 16,
    **sampling: Any,
) -> GenerateRequest:
    parts: list[Any] = [ImagePart(gradient_image(w, h, seed=seed)) for w, h, seed in images]
    if video:
        parts.append(VideoPart([gradient_image(56, 56, seed=40 + i) for i in range(video)]))
    parts.append(TextPart(text))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return GenerateRequest("test", [ChatMessage("user", parts)], params)


def mixed(family: str) -> list[GenerateRequest]:
    """Text, one image, two images and (where the family takes it) a video."""
    reqs = [
        request("Describe it.", images=[(64, 48, 0)], max_tokens=20),
        request("A longer text-only prompt " * 4, max_tokens=24),
        request("Compare them.", images=[(60, 60, 1), (40, 90, 2)], max_tokens=18),
        request("Short.", max_tokens=22),
    ]
    if family in VIDEO:
        reqs.append(request("And the video?", video=4, max_tokens=20))
    return reqs


async def generate_alone(backend: HFChatBackend, req: GenerateRequest) -> list[int]:
    prepared = await backend.prepare(req)
    with torch.inference_mode():
        out = backend._require().model.generate(
            **prepared.inputs,
            max_new_tokens=req.sampling.max_tokens,
            do_sample=False,
            eos_token_id=None,
            repetition_penalty=req.sampling.repetition_penalty,
        )
    return out[0, prepared.prompt_tokens :].tolist()


async def test_batched_greedy_matches_transformers_generate(
    family: tuple[str, HFChatBackend],
) -> None:
    name, backend = family
    reqs = [*mixed(name), request("Plain text", max_tokens=16, repetition_penalty=1.3)]
    for req in reqs:
        ours = await run(backend, req)
        assert ours.tokens == await generate_alone(backend, req), req.messages[0].content


async def test_greedy_output_is_identical_alone_and_joining_a_busy_batch(
    family: tuple[str, HFChatBackend],
) -> None:
    name, backend = family
    engine = backend.engine
    assert engine is not None
    others = mixed(name)
    probe = request("Probe with two pictures", images=[(80, 80, 9), (50, 70, 3)], max_tokens=20)
    alone = [await run(backend, r) for r in [*others, probe]]
    tasks = await start_all(backend, others)
    await wait_for(lambda: engine.gauges.running == len(others))
    started = engine.steps
    await wait_for(lambda: engine.steps >= started + 2)
    joined = await run(backend, probe)  # joins mid-flight; others leave while it decodes
    together: list[Outcome] = [*await asyncio.gather(*tasks), joined]
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert [o.text for o in together] == [o.text for o in alone]


async def test_eight_concurrent_requests_decode_together(
    family: tuple[str, HFChatBackend],
) -> None:
    _, backend = family
    engine = backend.engine
    assert engine is not None
    reqs = [
        request(f"Request {i}", images=[(48 + 8 * i, 48, i)] if i % 2 else [], max_tokens=24)
        for i in range(8)
    ]
    engine.peak_running = 0
    outs = await concurrently(backend, reqs)
    assert engine.peak_running == 8
    assert all(len(o.tokens) == 24 for o in outs)


async def test_a_cached_image_keeps_its_deepstack_features() -> None:
    """Qwen3-VL from the vision cache: the hit carries the DeepStack sets with the features,
    so the second request gives ``model.generate``'s tokens too."""
    backend = backend_for("qwen3_vl", vision_cache_bytes=1 << 26)
    try:
        req = request("Describe it.", images=[(64, 48, 0)], max_tokens=12)
        first, second = await run(backend, req), await run(backend, req)
        assert backend.vision_cache_stats()["hits"] >= 1
        assert first.tokens == second.tokens == await generate_alone(backend, req)
    finally:
        backend.close()


async def test_a_config_the_runner_does_not_compute_keeps_the_generate_path(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A Qwen2.5-VL whose MLP is GELU: no runner computes it, so it is served by
    ``model.generate`` one request at a time, with the log line, and still answers."""
    shutil.copytree(FAMILIES["qwen2_5_vl"](), tmp_path / "gelu", dirs_exist_ok=True)
    config_path = tmp_path / "gelu" / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["hidden_act"] = "gelu"
    config_path.write_text(json.dumps(config))
    options = LoadOptions(source=str(tmp_path / "gelu"), device="cpu", dtype="float32")
    backend = HFChatBackend("gelu", options, max_model_len=4096)
    with caplog.at_level("INFO"):
        backend.load()
    try:
        assert not supports(backend._require().model)
        assert backend.engine is None
        assert "served one request at a time" in caplog.text
        req = request("Describe it.", images=[(64, 48, 0)], max_tokens=8)
        assert (await run(backend, req)).tokens == await generate_alone(backend, req)
    finally:
        backend.close()
