"""The runner's packed CPU linears (``batching/linear.py``): the same product as
``F.linear`` within float32 tolerance, batch invariant from 4 rows (a row's result does not
depend on how many rows share the call or where it sits), held once, and the HF modules
still compute from the packed weight. Small weights stay plain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.engine.models.linear import PACK_MIN_ELEMENTS, can_pack, fuse

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build"
)


class Attention(nn.Module):
    def __init__(self, hidden: int, kv: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=True)
        self.k_proj = nn.Linear(hidden, kv, bias=True)
        self.v_proj = nn.Linear(hidden, kv, bias=True)


@pytest.fixture
def attn() -> Attention:
    torch.manual_seed(0)
    return Attention(1024, 256)


def test_the_packed_product_equals_the_plain_one_and_is_held_once(attn: Attention) -> None:
    plain = [
        (m.weight.detach().clone(), m.bias.detach().clone())
        for m in (attn.q_proj, attn.k_proj, attn.v_proj)
    ]
    params_before = sum(p.numel() for p in attn.parameters())
    fused = fuse(attn, ["q_proj", "k_proj", "v_proj"])
    assert fused.packed and fused.out_features == 1024 + 2 * 256
    x = torch.randn(9, 1024)
    expected = torch.cat([F.linear(x, w, b) for w, b in plain], dim=1)
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-4)
    # the HF modules read the packed weight (model.generate keeps working), counted once
    torch.testing.assert_close(
        attn.k_proj(x[None])[0], expected[:, 1024:1280], rtol=1e-5, atol=1e-4
    )
    assert sum(p.numel() for p in attn.parameters()) == params_before


def test_a_rows_result_does_not_depend_on_its_companions(attn: Attention) -> None:
    fused = fuse(attn, ["q_proj", "k_proj", "v_proj"])
    x = torch.randn(300, 1024)
    alone = fused(x[37:41])  # 4 rows: the GEMM path
    for before, after in ((0, 4), (4, 0), (33, 27), (1, 250), (120, 0)):
        window = torch.cat([x[100 : 100 + before], x[37:41], x[41 : 41 + after]])
        assert torch.equal(fused(window)[before : before + 4], alone), (before, after)
    # fewer than 4 rows are padded to 4: the same results as inside a bigger call
    assert torch.equal(fused(x[37:38]), alone[:1])


def test_small_weights_and_other_devices_stay_plain() -> None:
    small = nn.Linear(128, 256)
    assert small.weight.numel() < PACK_MIN_ELEMENTS and not can_pack(small.weight.data)
    holder = nn.Module()
    holder.proj = small
    fused = fuse(holder, ["proj"])
    assert not fused.packed and isinstance(holder.proj, nn.Linear)  # HF module untouched
    assert holder.proj.weight.data_ptr() == fused.weight.data_ptr()  # a view, not a copy
    assert not can_pack(torch.empty(2048, 1024, dtype=torch.float16))
