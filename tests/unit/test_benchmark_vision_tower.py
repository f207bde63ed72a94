"""benchmarks/vision_tower.py: a photo and a clip through the tiny tower with the patch
embedding both ways, on one module, the convolution's class given back after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from support import benchmark_module


def test_a_tiny_run_times_the_photo_and_the_clip_both_ways(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tower.json"
    with benchmark_module("vision_tower.py") as bench:
        argv = ["--model", str(tiny_dir), "--dtype", "float32", "--repeat", "1"]
        bench.main([*argv, "--json", str(out)])
        ns = bench.parse_args(argv)
        _, model, device, dtype = bench.load(ns)
        media = bench.inputs(tiny_dir, device, dtype)
        rows = bench.measure(model, media, ns)
        assert type(model.model.visual.patch_embed.proj) is nn.Conv3d  # given back
    saved = json.loads(out.read_text())["results"]
    assert [r["media"] for r in saved] == ["photo", "video"] == [r["media"] for r in rows]
    for row in saved:
        assert row["patches"] > 0
        for key in ("tower_conv_ms", "tower_gemm_ms", "embed_conv_ms", "embed_gemm_ms"):
            assert row[key] > 0
    photo, video = saved
    assert video["patches"] > photo["patches"]  # 16 frames against one photo at tiny bounds
    printed = capsys.readouterr().out
    assert "patch embed conv / gemm" in printed and "photo" in printed and "video" in printed
