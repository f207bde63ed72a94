"""A photo's and a video's way through the vision tower, with the patch embedding as the
3-D convolution transformers runs and as the matrix multiply the engine runs.

    python benchmarks/vision_tower.py                        # medium checkpoint, bf16, CPU
    python benchmarks/vision_tower.py --dtype float32 --repeat 5
    python benchmarks/vision_tower.py --size tiny --dtype float32
    python benchmarks/vision_tower.py --device cuda

The checkpoint's own processor turns a 1280x960 photo and 16 frames of 448x448 into patches
(on the medium checkpoint, Qwen2-VL's real bounds: ~4,800 and ~8,200 patches), then the
tower encodes them (``get_image_features`` / ``get_video_features``): the median of
``--repeat`` runs after one untimed one, and the patch embedding alone the same way. The two
ways run on the same module and weights, alternating in one process (``PatchConv3d`` is the
module's class while the GEMM is timed, ``nn.Conv3d`` while the convolution is). Printed: ms
each way and the convolution's time over the GEMM's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor import sync
from runner import load, model_args

from vlmserve.engine.models.patch_embed import PatchConv3d

PHOTO = (1280, 960)
FRAME, FRAMES = (448, 448), 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/vision_tower.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_args(p)
    p.add_argument("--repeat", type=int, default=3, help="timed runs a way (the median)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def _picture(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def inputs(ckpt: Path, device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Any, Any]]:
    """The processor's patches and grid for the photo and for the clip."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(ckpt)
    photo = processor.image_processor(images=[_picture(PHOTO, 0)], return_tensors="pt")
    frames = [_picture(FRAME, i) for i in range(FRAMES)]
    clip = processor.video_processor(videos=[frames], return_tensors="pt")
    return {
        "photo": (photo["pixel_values"].to(device, dtype), photo["image_grid_thw"].to(device)),
        "video": (
            clip["pixel_values_videos"].to(device, dtype),
            clip["video_grid_thw"].to(device),
        ),
    }


def _ms(call: Any, device: torch.device, repeat: int) -> float:
    call()
    sync(device)
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        call()
        sync(device)
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def measure(model: Any, media: dict[str, tuple[Any, Any]], ns: argparse.Namespace) -> list[dict]:
    inner = model.model
    proj = inner.visual.patch_embed.proj
    if type(proj) is not nn.Conv3d:
        raise SystemExit(f"this checkpoint's patch embedding is a {type(proj).__name__}")
    device = proj.weight.device
    results = []
    with torch.inference_mode():
        for name, (pixels, grid) in media.items():
            encode = inner.get_image_features if name == "photo" else inner.get_video_features
            row: dict[str, Any] = {"media": name, "patches": int(pixels.shape[0])}
            tower = functools.partial(encode, pixels, grid)
            embed = functools.partial(inner.visual.patch_embed, pixels)
            for way, cls in (("conv", nn.Conv3d), ("gemm", PatchConv3d)):
                proj.__class__ = cls
                row[f"tower_{way}_ms"] = _ms(tower, device, ns.repeat)
                row[f"embed_{way}_ms"] = _ms(embed, device, ns.repeat)
            proj.__class__ = nn.Conv3d
            row["tower_ratio"] = row["tower_conv_ms"] / row["tower_gemm_ms"]
            row["embed_ratio"] = row["embed_conv_ms"] / row["embed_gemm_ms"]
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    ckpt, model, device, dtype = load(ns)
    results = measure(model, inputs(ckpt, device, dtype), ns)
    where = f"{ckpt.name}, {ns.dtype}, {device}, {torch.get_num_threads()} threads"
    print(f"vision tower ({where}); ms, median of {ns.repeat}")
    print(f"{'media':6s} {'patches':>7s}   tower conv / gemm (x)      patch embed conv / gemm (x)")
    for r in results:
        tower = f"{r['tower_conv_ms']:8.1f} / {r['tower_gemm_ms']:8.1f} ({r['tower_ratio']:.2f}x)"
        embed = f"{r['embed_conv_ms']:8.1f} / {r['embed_gemm_ms']:8.1f} ({r['embed_ratio']:.2f}x)"
        print(f"{r['media']:6s} {r['patches']:7d}   {tower}   {embed}")
    if ns.json:
        ns.json.write_text(json.dumps({"checkpoint": where, "results": results}, indent=1))


if __name__ == "__main__":
    main()
