"""The Qwen towers' patch embedding runs as a matrix multiply and computes what the
convolution computes, on the tiny checkpoints as loaded by the server."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForImageTextToText

from vlmserve.engine.configs import LoadOptions
from vlmserve.engine.hf.loading import load_model
from vlmserve.engine.models.patch_embed import PatchConv3d, linear_patch_embeds
from vlmserve.testing.families import FAMILIES


@pytest.mark.parametrize(
    "shape",
    [
        (7, 3, 2, 14, 14),  # one patch a row: how the towers call it
        (2, 3, 4, 30, 45),  # patches in every direction, with a remainder the kernel never reaches
        (1, 3, 5, 28, 29),
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_the_gemm_equals_the_convolution(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 16, (2, 14, 14), stride=(2, 14, 14), bias=bias)
    pixels = torch.randn(*shape)
    expected = conv(pixels)
    assert linear_patch_embeds(nn.Sequential(conv)) == 1
    assert isinstance(conv, PatchConv3d)
    got = conv(pixels)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv3d(3, 4, 2, stride=1),  # slides: not a linear map of one patch
        nn.Conv3d(3, 4, 2, stride=2, padding=1),
        nn.Conv3d(4, 4, 2, stride=2, groups=2),
        nn.Conv2d(3, 4, 14, stride=14),  # the 2-D towers' convolution is fast as it is
    ],
)
def test_only_non_sliding_plain_convolutions_change(conv: nn.Module) -> None:
    before = type(conv)
    assert linear_patch_embeds(nn.Sequential(conv)) == 0
    assert type(conv) is before


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_server_loads_the_qwen_towers_with_the_gemm(family: str) -> None:
    path = str(FAMILIES[family]())
    loaded = load_model(LoadOptions(source=path, device="cpu", dtype="float32"))
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ours, theirs = loaded.model.model.visual, reference.model.visual
    assert isinstance(ours.patch_embed.proj, PatchConv3d)
    assert type(theirs.patch_embed.proj) is nn.Conv3d
    assert loaded.model.state_dict().keys() == reference.state_dict().keys()

    config = reference.config.vision_config
    volume = config.in_channels * config.temporal_patch_size * config.patch_size**2
    torch.manual_seed(1)
    pixels, grid = torch.randn(2 * 8 * 12, volume), torch.tensor([[2, 8, 12]])
    with torch.inference_mode():
        got = loaded.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
        want = reference.model.get_image_features(pixels, grid, return_dict=True).pooler_output
    torch.testing.assert_close(torch.cat(list(got)), torch.cat(list(want)), rtol=1e-4, atol=1e-4)
