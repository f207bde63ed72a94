"""``--dtype auto`` on CPU follows a bfloat16 checkpoint only where the CPU has native bf16."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from vlmserve.engine.hf import loading
from vlmserve.engine.hf.loading import LoadOptions, load_model, resolve_dtype, saved_dtype
from vlmserve.testing.tiny import TinySpec, build_qwen2_vl

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16_dir() -> Path:
    return build_qwen2_vl(TinySpec(torch_dtype="bfloat16"))


def test_a_bf16_checkpoint_is_served_in_bf16_on_a_cpu_with_native_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loading, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert resolve_dtype("auto", CPU, torch.bfloat16) is torch.bfloat16
    monkeypatch.setattr(loading, "_cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert resolve_dtype("auto", CPU, torch.bfloat16) is torch.bfloat16


def test_without_native_bf16_auto_falls_back_to_float32_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loading, "_cpu_flags", lambda: {"avx", "avx2", "fma"})
    with caplog.at_level(logging.INFO, logger=loading.__name__):
        assert resolve_dtype("auto", CPU, torch.bfloat16) is torch.float32
    assert "no native bfloat16" in caplog.text and "--dtype bfloat16" in caplog.text
    # float16 has no native CPU path either way; float32 and unknown stay float32
    assert resolve_dtype("auto", CPU, torch.float16) is torch.float32
    assert resolve_dtype("auto", CPU, torch.float32) is torch.float32
    assert resolve_dtype("auto", CPU, None) is torch.float32


def test_an_explicit_dtype_always_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "_cpu_flags", lambda: set())
    assert resolve_dtype("bfloat16", CPU, torch.float32) is torch.bfloat16
    assert resolve_dtype("float32", CPU, torch.bfloat16) is torch.float32


def test_load_reads_the_saved_dtype_from_the_checkpoint(
    bf16_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    assert saved_dtype(AutoConfig.from_pretrained(bf16_dir)) is torch.bfloat16
    monkeypatch.setattr(loading, "_cpu_flags", lambda: {"amx_bf16"})
    native = load_model(LoadOptions(str(bf16_dir), device="cpu"))
    assert native.dtype is torch.bfloat16
    assert next(native.model.parameters()).dtype is torch.bfloat16
    monkeypatch.setattr(loading, "_cpu_flags", lambda: set())
    assert load_model(LoadOptions(str(bf16_dir), device="cpu")).dtype is torch.float32
