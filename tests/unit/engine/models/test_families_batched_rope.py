"""The runner's rotary tables give transformers' own angles for each family's layout.

``RotaryTables`` (a gather from one cos/sin table) against the families' rotary modules
called directly: Qwen2.5-VL's sectioned M-RoPE, Qwen3-VL's interleaved M-RoPE and Llama's
1-D RoPE, on random 3-axis positions (t, h, w differ, as for vision tokens).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vlmserve.engine.models.rope import RotaryTables, rotary_axes


def qwen2_5() -> tuple[Any, list[int], bool]:
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    text = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 128,
            "num_attention_heads": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [4, 6, 6],
            },
        }
    ).text_config
    return Qwen2_5_VLRotaryEmbedding(text), [4, 6, 6], False


def qwen3() -> tuple[Any, list[int], bool]:
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    text = Qwen3VLConfig(
        text_config={
            "hidden_size": 128,
            "num_attention_heads": 4,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
        }
    ).text_config
    return Qwen3VLTextRotaryEmbedding(text), [6, 5, 5], True


def llama() -> tuple[Any, list[int], bool]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32)
    return LlamaRotaryEmbedding(config), [16], False


@pytest.mark.parametrize("make", [qwen2_5, qwen3, llama], ids=["qwen2_5_vl", "qwen3_vl", "llama"])
def test_table_angles_equal_the_models_rotary_embedding(make: Any) -> None:
    rotary, sections, interleaved = make()
    tables = RotaryTables(
        rotary.inv_freq,
        sections,
        float(rotary.attention_scaling),
        torch.float32,
        torch.device("cpu"),
        interleaved=interleaved,
    )
    gen = torch.Generator().manual_seed(0)
    if len(sections) == 1:  # 1-D: the same position on every axis
        positions = torch.randint(0, 3000, (1, 200), generator=gen).expand(3, 200)
        hf_positions = positions[0][None]  # [batch 1, N]
    else:
        positions = torch.randint(0, 3000, (3, 200), generator=gen)
        hf_positions = positions[:, None]  # [3, batch 1, N]
    cos, sin = tables.multimodal(positions)  # [N, 1, D], sin signed for the swapped halves
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), hf_positions)  # [1, N, D]
    half = hf_sin.shape[-1] // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, half:], hf_sin[0, :, half:], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, :half], -hf_sin[0, :, :half], rtol=0, atol=1e-6)


def test_interleaved_axes_put_height_and_width_on_every_third_dim() -> None:
    assert rotary_axes([6, 5, 5], 16, interleaved=True) == [
        0,
        1,
        2,
        0,
        1,
        2,
        0,
        1,
        2,
        0,
        1,
        2,
        0,
        1,
        2,
        0,
    ]
    assert rotary_axes([4, 6, 6], 16) == [0] * 4 + [1] * 6 + [2] * 6
    with pytest.raises(ValueError, match="does not cover"):
        rotary_axes([4, 6, 5], 16)
