"""Semantic video search with the ``hf`` embedding backend: embed clips and queries, rank.

    python benchmarks/retrieval.py                      # tiny random-weight Qwen2-VL + LoRA
    python benchmarks/retrieval.py --model DIR --adapter DIR --device cuda

Clips are synthetic: a texture tinted one colour per clip, sliding sideways frame by frame.
Queries name those colours. With the tiny random-weight checkpoints the ranking is
MEANINGLESS -- the script shows the API (render, batched embed, cosine similarity, ranking)
and its timings; only real weights (Qwen2-VL-2B-Instruct + VLM2Vec-Qwen2VL-2B) rank sensibly.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

from vlmserve.engine.hf.embed import EmbedInput, HFEmbedBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.testing.media import gradient_image

COLOURS = {
    "red": (1.0, 0.15, 0.15),
    "green": (0.15, 1.0, 0.15),
    "blue": (0.15, 0.15, 1.0),
    "yellow": (1.0, 1.0, 0.15),
    "purple": (0.7, 0.15, 1.0),
    "cyan": (0.15, 1.0, 1.0),
}


def clip(
    colour: tuple[float, float, float], frames: int, size: int, seed: int
) -> list[Image.Image]:
    """``frames`` images of a tinted texture sliding right by 1/``frames`` of its width each."""
    base = np.asarray(gradient_image(size, size, seed=seed), dtype=np.float32)  # [H, W, 3]
    tinted = base * np.asarray(colour, dtype=np.float32)
    step = max(1, size // frames)
    return [
        Image.fromarray(np.roll(tinted, i * step, axis=1).clip(0, 255).astype(np.uint8), "RGB")
        for i in range(frames)
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="base model dir or hub id (default: tiny Qwen2-VL)")
    parser.add_argument("--adapter", help="PEFT LoRA dir or hub id (default: tiny LoRA)")
    parser.add_argument("--no-adapter", action="store_true", help="embed with the bare base")
    parser.add_argument("--clips", type=int, default=len(COLOURS), help="number of clips")
    parser.add_argument("--frames", type=int, default=4, help="frames per clip")
    parser.add_argument("--size", type=int, default=56, help="frame width and height")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch", type=int, default=16)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    console = Console()
    tiny = args.model is None
    if tiny:
        from vlmserve.testing import build_lora_adapter, build_qwen2_vl

        model = str(build_qwen2_vl())
        adapter = args.adapter or (None if args.no_adapter else str(build_lora_adapter(model)))
    else:
        model, adapter = args.model, None if args.no_adapter else args.adapter

    backend = HFEmbedBackend(
        "retrieval",
        LoadOptions(source=model, device=args.device, dtype=args.dtype),
        adapter=adapter,
        max_batch=args.max_batch,
    )
    backend.load()
    console.print(
        f"model {model}\nadapter {adapter or '(none)'}\n"
        f"loaded in {backend.load_seconds:.1f} s, dim {backend.dim}, "
        f"{backend.memory_bytes / 2**20:.1f} MiB"
    )

    names = [list(COLOURS)[i % len(COLOURS)] for i in range(args.clips)]
    clips = [
        EmbedInput(frames=clip(COLOURS[name], args.frames, args.size, seed=i))
        for i, name in enumerate(names)
    ]
    query_template = "a {} texture sliding to the right"
    queries = [EmbedInput(text=query_template.format(name)) for name in COLOURS]
    console.print(f"video prompt: {backend.render(clips[0])!r}")
    console.print(f"query prompt: {backend.render(queries[0])!r}")

    started = time.perf_counter()
    clip_vectors = backend.embed_sync(clips)  # [N, dim], unit norm
    clip_s = time.perf_counter() - started
    started = time.perf_counter()
    query_vectors = backend.embed_sync(queries)  # [M, dim], unit norm
    query_s = time.perf_counter() - started
    similarity = query_vectors @ clip_vectors.T  # [M, N] cosine similarities
    backend.close()

    clip_labels = [f"#{i} {name}" for i, name in enumerate(names)]
    title = f"cosine similarity: query {query_template.format('<colour>')!r} x clip"
    matrix = Table(title=title)
    matrix.add_column("query")
    for label in clip_labels:
        matrix.add_column(label, justify="right")
    for name, row in zip(COLOURS, similarity, strict=True):
        matrix.add_row(name, *(f"{v:+.3f}" for v in row))
    console.print(matrix)

    ranking = Table(title="clips ranked per query (best first)")
    ranking.add_column("query")
    ranking.add_column("ranking")
    ranking.add_column("own colour first?")
    for name, row in zip(COLOURS, similarity, strict=True):
        order = np.argsort(-row)
        first = names[order[0]] == name
        ranking.add_row(name, ", ".join(clip_labels[i] for i in order), str(first))
    console.print(ranking)

    console.print(
        f"embedded {len(clips)} clips x {args.frames} frames in {clip_s:.2f} s "
        f"({len(clips) / clip_s:.1f} clips/s), {len(queries)} queries in {query_s:.2f} s"
    )
    if tiny:
        console.print(
            "[bold yellow]NOTE:[/] these are tiny RANDOM-WEIGHT checkpoints: the similarities "
            "and rankings above are meaningless. The script demonstrates the API for semantic "
            "video search; run it with --model Qwen/Qwen2-VL-2B-Instruct "
            "--adapter TIGER-Lab/VLM2Vec-Qwen2VL-2B for real rankings."
        )


if __name__ == "__main__":
    main()
