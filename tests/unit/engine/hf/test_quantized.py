"""A torchao int8 weight-only checkpoint on the batched engine: the runner calls the
quantized linears as modules (their own kernels), and its output equals the same quantized
model's ``generate``, alone and batched. A missing quantization package names what to
install."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from vlmserve.engine.hf.loading import LoadOptions, load_model
from vlmserve.engine.models.linear import ModuleLinear
from vlmserve.errors import ConfigError

pytest.importorskip("torchao", reason="torchao is in the dev extra")

from tests.unit.engine.core.test_batching import concurrently, make_backend, request

from vlmserve.testing.quantized import build_int8_qwen2_vl


@pytest.fixture(scope="module")
def int8_dir() -> Path:
    return build_int8_qwen2_vl()


async def test_int8_checkpoint_is_batched_and_equals_its_own_generate(int8_dir: Path) -> None:
    backend = make_backend(int8_dir)
    try:
        engine = backend.engine
        assert engine is not None
        assert isinstance(engine.runner.layers[0].qkv, ModuleLinear)
        reqs = [
            request("Describe it.", image=(64, 48), max_tokens=12),
            request("Plain text", max_tokens=12),
            request("Another one", image=(48, 64), max_tokens=12, image_seed=3),
        ]
        together = await concurrently(backend, reqs)
        assert engine.peak_running == len(reqs)
        model: Any = backend._require().model
        for req, ours in zip(reqs, together, strict=True):
            prepared = await backend.prepare(req)
            with torch.inference_mode():
                out = model.generate(
                    **prepared.inputs, max_new_tokens=12, do_sample=False, eos_token_id=None
                )
            assert ours.tokens == out[0, prepared.prompt_tokens :].tolist()
    finally:
        backend.close()


def test_a_missing_quantization_package_names_what_to_install(
    int8_dir: Path, tmp_path: Path
) -> None:
    if importlib.util.find_spec("gptqmodel") is not None:
        pytest.skip("gptqmodel is installed here")
    copy = tmp_path / "gptq"
    shutil.copytree(int8_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantized with gptq.*pip install gptqmodel"):
        load_model(LoadOptions(str(copy), device="cpu"))
