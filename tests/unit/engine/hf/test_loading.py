"""Model loading: clear start-up errors that name the model and say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmserve.engine.hf.loading import LoadOptions, load_model, weight_bytes
from vlmserve.errors import ConfigError


def test_loads_the_tiny_checkpoint_on_cpu_in_float32(tiny_dir: Path) -> None:
    loaded = load_model(LoadOptions(str(tiny_dir), device="cpu"))
    assert loaded.device.type == "cpu" and loaded.dtype is torch.float32
    assert not loaded.model.training


def test_out_of_memory_names_the_model_and_the_memory_it_needs(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_room(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to", no_room)
    with pytest.raises(ConfigError) as info:
        load_model(LoadOptions(str(tiny_dir), device="cpu"))
    need = weight_bytes(str(tiny_dir))
    assert need and str(tiny_dir) in info.value.message
    assert f"{need / 2**20:.1f} MiB" in info.value.message  # the tiny model is a few MiB


def test_a_directory_without_a_model_says_how_to_point_at_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--model DIR"):
        load_model(LoadOptions(str(tmp_path), device="cpu"))


def test_cuda_without_a_gpu_is_a_config_error(tiny_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="--device cpu"):
        load_model(LoadOptions(str(tiny_dir), device="cuda:0"))
