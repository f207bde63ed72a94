"""benchmarks/gpu.py: its --tiny --quick CPU run end to end, its level sets, its help, and the
2B model it builds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from support import benchmark_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu() -> Iterator[ModuleType]:
    with benchmark_module("gpu.py") as module:
        yield module


def test_tiny_quick_run_exits_0_and_writes_every_metric(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--quick", "--json", str(out)],
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
    assert set(tokens["vlmserve"]) == {"1", "8"}
    assert all(rate > 0 for rate in tokens["vlmserve"].values())
    contexts = result["contexts"]
    assert list(contexts) == ["short", "1k"]
    assert contexts["short"]["prompt_tokens"] < 100
    assert 1000 <= contexts["1k"]["prompt_tokens"] <= 1050  # the prompt length per row
    for ctx in contexts.values():
        assert ctx["tpot_ms"] > 0 and set(ctx["tokens_per_s"]) == {"1", "8"}
        assert all(rate > 0 for rate in ctx["tokens_per_s"].values())
    # the floor grows with the KV bytes a longer context adds to every step
    kv = result["kv_bytes_per_token"]
    assert kv == 2 * 2 * 2 * 32 * 4  # k and v, 2 layers, 2 kv heads, head_dim 32, float32
    assert contexts["1k"]["floor_ms"] > contexts["short"]["floor_ms"]
    gap = (contexts["1k"]["prompt_tokens"] - contexts["short"]["prompt_tokens"]) * kv
    bandwidth = result["copy_bandwidth_gb_s"] * 1e9
    grown = contexts["1k"]["floor_ms"] - contexts["short"]["floor_ms"]
    assert grown == pytest.approx(gap / bandwidth * 1e3)
    embed = result["embed_images_per_s"]
    assert embed["hf_one_per_forward"] > 0 and embed["vlmserve"] > 0
    ratios = {
        "hf_tpot_over_floor",
        "vlmserve_tpot_over_floor",
        "vlmserve_tpot_over_hf",
        "vlmserve_embed_over_hf",
        "vlmserve_tokens_c1_over_hf",
        "vlmserve_tokens_c8_over_hf",
        "vlmserve_tpot_short_over_floor",
        "vlmserve_tpot_1k_over_floor",
    }
    assert set(result["ratios"]) == ratios
    phases = result["phases_s"]
    assert {"checkpoint", "HF baselines", "vlmserve context 1k", "vlmserve embed"} <= set(phases)
    assert "phase vlmserve context 1k: " in done.stdout  # printed as each phase ends
    assert "TPOT ms, 1 request" in done.stdout and "embed images/s, 112x112" in done.stdout
    assert "output tok/s, 1k (1024 tok), c=8" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU level sets need a GPU")
def test_full_and_quick_level_sets_on_a_gpu(gpu: ModuleType) -> None:
    full, _, _ = gpu.parse_args([])
    assert full.concurrency == [1, 8, 32, 64, 128] and full.contexts == ["short", "1k", "4k"]
    quick, _, _ = gpu.parse_args(["--quick"])
    assert quick.concurrency == [1, 8, 64] and quick.contexts == ["short", "4k"]


def test_level_and_context_flags(gpu: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    plan, _, _ = gpu.parse_args(["--tiny", "--concurrency", "2,4", "--contexts", "1k"])
    assert plan.concurrency == [2, 4] and plan.contexts == ["short", "1k"]  # short always
    assert gpu.parse_args(["--tiny"])[0].concurrency == [1, 8, 32, 64]
    for bad in (["--concurrency", "0"], ["--contexts", "8k"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(["--tiny", *bad])
    assert "comma-separated" in capsys.readouterr().err


def test_help_says_what_is_measured(gpu: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for phrase in (
        "TPOT",
        "copy bandwidth",
        "tokens/s",
        "images/s",
        "448x448",
        "--tiny",
        "--quick",
        "4k",
        "128",
        "5 minutes",
    ):
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
