"""benchmarks/gpu.py: its --tiny CPU run end to end, its help, and the 2B model it builds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("benchmark_gpu", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_tiny_run_exits_0_and_writes_every_metric(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "tiny" and result["device"] == "cpu"
    assert result["weight_bytes"] > result["decode_weight_bytes"] > 0  # vision tower excluded
    assert result["copy_bandwidth_gb_s"] > 0
    tpot = result["tpot_ms"]
    assert tpot["bandwidth_floor"] > 0 and tpot["hf_generate"] >= 0 and tpot["vlmserve"] >= 0
    tokens = result["tokens_per_s"]
    assert tokens["hf_generate_one_at_a_time"] > 0
    assert set(tokens["vlmserve"]) == {"8", "32", "64"}
    assert all(rate > 0 for rate in tokens["vlmserve"].values())
    embed = result["embed_images_per_s"]
    assert embed["hf_one_per_forward"] > 0 and embed["vlmserve"] > 0
    ratios = {"hf_tpot_over_floor", "vlmserve_tpot_over_floor", "vlmserve_tpot_over_hf",
              "vlmserve_embed_over_hf", "vlmserve_tokens_c8_over_hf",
              "vlmserve_tokens_c32_over_hf", "vlmserve_tokens_c64_over_hf"}  # fmt: skip
    assert set(result["ratios"]) == ratios
    assert "TPOT ms, 1 request" in done.stdout and "embed images/s, 112x112" in done.stdout


def test_help_says_what_is_measured(gpu: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for phrase in ("TPOT", "copy bandwidth", "tokens/s", "images/s", "448x448", "--tiny"):
        assert phrase in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="only without a GPU")
def test_without_a_gpu_the_full_run_points_at_tiny(
    gpu: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu.parse_args([])
    assert exit_info.value.code == 2
    assert "--tiny" in capsys.readouterr().err


def test_the_2b_model_has_qwen2_vl_2b_shapes(gpu: ModuleType, tiny_dir: Path) -> None:
    """Built on the meta device: the parameter count of Qwen2-VL-2B-Instruct (2.21B)."""
    from transformers import Qwen2VLForConditionalGeneration

    config = gpu.real_config(tiny_dir)
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    total, decode = gpu.decode_weight_bytes(model)
    assert total == 2 * 2_208_985_600  # bf16 bytes: vision 665.3M + language 1543.7M params
    assert decode == 2 * 1_543_714_304  # the tied embedding / LM head counted once
    text = config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (1536, 28, 8960)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (12, 2, 151936)
    assert config.image_token_id < 1038  # the tiny tokenizer's ids, which the processor emits
