"""GPU benchmark: vlmserve's hf engine beside plain transformers, on Qwen2-VL-2B-sized models.

    python benchmarks/gpu.py --json gpu.json          # real 2B configurations, random bf16 weights
    python benchmarks/gpu.py --quick                  # the level set of scripts/gpu_check.sh
    python benchmarks/gpu.py --tiny --json tiny.json  # the same code, tiny checkpoint, CPU, seconds

What it measures (every number beside plain HF transformers, one request at a time, same device):

1. copy bandwidth: a large on-device tensor copy, (read + write bytes) / seconds.
2. TPOT at concurrency 1 (ms per output token after the first, from whole-request latencies:
   (T(n) - T(1)) / (n - 1)) of HFChatBackend and of ``model.generate``, next to the bandwidth
   floor: bytes read per decode step (every weight but the vision tower's, plus the row's
   keys and values) / copy bandwidth.
3. per context (prompt tokens per row: short ~100, 1k, 4k), the TPOT at concurrency 1 and the
   output tokens/s with 1, 8, 32, 64 and 128 concurrent requests through HFChatBackend (its
   public API: prepare + generate; each level warmed up first with as many other prompts, and
   every prompt distinct, so no prefix cache serves a timed one), next to ``model.generate``
   run one request after another at the short context, and to the floor at that level
   (c tokens per step of weights + c rows' KV bytes at the copy bandwidth).
4. embedding images/s for 448x448 images (112x112 with --tiny) sent as concurrent
   single-image requests through HFEmbedBackend (VLM2Vec-2B: base + a random LoRA, merged
   at load), next to plain transformers embedding one image per forward pass (last token
   of the final hidden state; the plain base: a merged LoRA costs nothing extra).

Each phase prints its duration as it ends (and the JSON has them under ``phases_s``).
``--quick`` (contexts short and 4k, levels 1, 8 and 64, fewer requests and images) keeps
``scripts/gpu_check.sh`` within 5 minutes, compilation included.

No downloads: Qwen2-VL-2B-Instruct's real configuration (hidden 1536, 28 layers, 12 heads,
2 kv heads, intermediate 8960, vocab 151936, vision depth 32 / width 1280 / 16 heads) is
built with random weights in bf16 and saved to a temp dir (about 4.4 GB). The tokenizer,
chat template and image processor are the tiny test checkpoint's (vlmserve.testing): its
1,038 token ids all exist in the 151,936-row embedding, and with random weights the ids
are meaningless anyway -- generation ignores EOS and decodes a fixed number of tokens, and
ids the tiny tokenizer lacks decode to no text (they are still counted). Speed depends on
shapes, not on weight values, so the timings are those of the real models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floor import copy_bandwidth, decode_weight_bytes, kv_bytes_per_token, sync
from gpu_model import CONTEXTS, build_real_checkpoint, context_prompts, free_memory, real_config
from gpu_report import ratios, table

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.embed import EmbedInput, HFEmbedBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart
from vlmserve.testing import build_lora_adapter, build_qwen2_vl
from vlmserve.testing.media import gradient_image

__all__ = ["Plan", "copy_bandwidth", "decode_weight_bytes", "main", "parse_args", "real_config"]

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384  # Qwen2-VL's image processor defaults
IMAGE_PROMPT = "Represent the given image."
LEVELS = [1, 8, 32, 64, 128]
QUICK_LEVELS = [1, 8, 64]


@dataclass(slots=True)
class Plan:
    tiny: bool
    device: str
    dtype: str
    max_tokens: int  # output tokens per request (EOS ignored)
    prompt_words: int  # words of filler text per short chat prompt
    concurrency: list[int]
    sequential: int  # requests for the one-at-a-time generate rate
    images: int  # images embedded per measurement
    image_size: int
    embed_max_batch: int
    copy_mib: int
    contexts: list[str] = field(default_factory=lambda: ["short"])  # "short" first
    quick: bool = False
    cuda_graphs: bool = True  # vlmserve's paged decode as CUDA graphs (--no-cuda-graphs: gathered)
    workdir: Path = field(default_factory=Path)


class Phases:
    """Times each phase of the run, printing its duration as it ends."""

    def __init__(self, console: Console):
        self.console = console
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - began
            self.seconds[name] = round(took, 2)
            total = time.perf_counter() - self.started
            self.console.print(f"phase {name}: {took:.1f} s (total {total:.1f} s)")


# --- plain transformers baselines --------------------------------------------------------
def hf_generate(model: Any, processor: Any, prompt: str, n: int) -> float:
    """Seconds for a greedy ``model.generate`` of exactly ``n`` new tokens."""
    inputs = processor(text=[prompt], return_tensors="pt").to(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    sync(model.device)
    return time.perf_counter() - started


def per_token(latency: Callable[[int], float], n: int, tries: int = 3) -> float:
    """Seconds per output token after the first: (T(n) - T(1)) / (n - 1), best of ``tries``.

    Whole-request latencies, so no per-token clock is needed and prefill cancels out.
    """
    full = min(latency(n) for _ in range(tries))
    first = min(latency(1) for _ in range(tries))
    return max(0.0, full - first) / max(1, n - 1)


def hf_baselines(plan: Plan, ckpt: Path, prompts: list[str]) -> dict[str, float]:
    """TPOT, one-at-a-time tokens/s and one-image-per-pass images/s with plain transformers."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dtype = getattr(torch, plan.dtype)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype).to(plan.device).eval()
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    processor = AutoProcessor.from_pretrained(ckpt, size=size)
    total, decode = decode_weight_bytes(model)
    hf_generate(model, processor, prompts[0], 4)  # warm-up
    tpot = per_token(partial(hf_generate, model, processor, prompts[0]), plan.max_tokens)
    started = time.perf_counter()
    for prompt in prompts[: plan.sequential]:
        hf_generate(model, processor, prompt, plan.max_tokens)
    rate = plan.sequential * plan.max_tokens / (time.perf_counter() - started)
    images = make_images(plan)
    hf_embed_one(model, processor, images[0])  # warm-up
    started = time.perf_counter()
    for image in images:
        hf_embed_one(model, processor, image)
    img_rate = len(images) / (time.perf_counter() - started)
    del model
    free_memory()
    return {
        "weight_bytes": total,
        "decode_weight_bytes": decode,
        "tpot_s": tpot,
        "tokens_per_s": rate,
        "images_per_s": img_rate,
    }


def hf_embed_one(model: Any, processor: Any, image: Image.Image) -> torch.Tensor:
    """One image's VLM2Vec-style vector in its own forward pass (last token, final norm)."""
    content = [{"type": "image"}, {"type": "text", "text": IMAGE_PROMPT}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=[prompt], images=[image], return_tensors="pt").to(model.device)
    with torch.inference_mode():
        hidden = model.model(**inputs, use_cache=False).last_hidden_state  # [1, L, H]
        return torch.nn.functional.normalize(hidden[0, -1].float(), dim=-1).cpu()


def make_images(plan: Plan) -> list[Image.Image]:
    return [gradient_image(plan.image_size, plan.image_size, seed=i) for i in range(plan.images)]


# --- vlmserve ----------------------------------------------------------------------------
def chat_request(prompt_text: str, n: int) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    messages = [ChatMessage("user", [TextPart(prompt_text)])]
    return GenerateRequest(f"bench-{time.monotonic_ns()}", messages, sampling)


async def stream(backend: HFChatBackend, prompt_text: str, n: int) -> int:
    """One request of ``n`` output tokens, start to end; the tokens it received."""
    prepared = await backend.prepare(chat_request(prompt_text, n))
    return sum([len(chunk.token_ids) async for chunk in backend.generate(prepared)])


async def timed(work: Awaitable[Any]) -> float:
    started = time.perf_counter()
    await work
    return time.perf_counter() - started


async def vlmserve_chat(plan: Plan, ckpt: Path, tokenizer: Any, phases: Phases) -> dict:
    """Per context: TPOT at c=1, output tokens/s at every level, the prompt's token count."""
    options = LoadOptions(source=str(ckpt), device=plan.device, dtype=plan.dtype)
    top = max(plan.concurrency)
    backend = HFChatBackend(
        "bench-chat",
        options,
        max_model_len=32768,
        max_queued=top + 1,
        max_num_seqs=top,
        cuda_graphs=plan.cuda_graphs,
    )
    out: dict[str, Any] = {}
    try:
        with phases("vlmserve load + warm-up"):
            await asyncio.to_thread(backend.load)
            await stream(backend, "Warm-up: say something.", 4)
        for context in plan.contexts:
            with phases(f"vlmserve context {context}"):
                out[context] = await one_context(plan, backend, tokenizer, context)
    finally:
        backend.close()
        free_memory()
    return out


async def one_context(plan: Plan, backend: HFChatBackend, tokenizer: Any, context: str) -> dict:
    def texts(count: int, label: str) -> list[str]:
        return context_prompts(tokenizer, context, plan.prompt_words, count, label)

    first = texts(1, "TPOT")[0]
    latencies = {}
    for n in (plan.max_tokens, 1):  # best of 3 whole-request latencies, as for HF
        latencies[n] = min([await timed(stream(backend, first, n)) for _ in range(3)])
    tpot = per_token(latencies.__getitem__, plan.max_tokens, tries=1)
    rates = {}
    for c in plan.concurrency:
        # first-seen batch shapes (kernel choice, allocator growth, compiled graphs) outside
        # the timing, with other prompts than the timed ones
        await asyncio.gather(*(stream(backend, t, 4) for t in texts(c, f"Warm-up c{c}")))
        timed_texts = texts(c, f"Request c{c}")
        started = time.perf_counter()
        runs = await asyncio.gather(*(stream(backend, t, plan.max_tokens) for t in timed_texts))
        rates[str(c)] = sum(runs) / (time.perf_counter() - started)
    prompt_tokens = len(tokenizer(first)["input_ids"])
    return {"prompt_tokens": prompt_tokens, "tpot_s": tpot, "tokens_per_s": rates}


async def vlmserve_embed(plan: Plan, ckpt: Path, adapter: Path | None) -> float:
    options = LoadOptions(
        source=str(ckpt),
        device=plan.device,
        dtype=plan.dtype,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    backend = HFEmbedBackend(
        "bench-embed",
        options,
        adapter=str(adapter) if adapter else None,
        max_batch=plan.embed_max_batch,
    )
    await asyncio.to_thread(backend.load)
    try:
        images = make_images(plan)
        await backend.embed([EmbedInput(image=images[0])])  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(backend.embed([EmbedInput(image=im)]) for im in images))
        return len(images) / (time.perf_counter() - started)
    finally:
        backend.close()
        free_memory()


# --- the run -----------------------------------------------------------------------------
def run(plan: Plan, console: Console) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    device = torch.device(plan.device)
    phases = Phases(console)
    with phases("checkpoint"):
        if plan.tiny:
            ckpt = build_qwen2_vl()
            adapter: Path | None = build_lora_adapter(ckpt)
        else:
            ckpt = build_real_checkpoint(plan.workdir / "qwen2-vl-2b-random", plan.device)
            adapter = build_lora_adapter(ckpt, out_dir=plan.workdir / "vlm2vec-lora-random")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    short = context_prompts(tokenizer, "short", plan.prompt_words, plan.sequential, "HF")
    with phases("copy bandwidth"):
        bandwidth = copy_bandwidth(device, plan.copy_mib)
    with phases("HF baselines"):
        hf = hf_baselines(plan, ckpt, short)
    ours = asyncio.run(vlmserve_chat(plan, ckpt, tokenizer, phases))
    with phases("vlmserve embed"):
        embed_rate = asyncio.run(vlmserve_embed(plan, ckpt, adapter))
    kv = kv_bytes_per_token(
        AutoConfig.from_pretrained(ckpt), torch.finfo(getattr(torch, plan.dtype)).bits // 8
    )
    weights = hf["decode_weight_bytes"]
    contexts = {}
    for name, got in ours.items():
        row_kv = kv * (got["prompt_tokens"] + plan.max_tokens // 2)  # mid-answer context
        contexts[name] = {
            "prompt_tokens": got["prompt_tokens"],
            "tpot_ms": got["tpot_s"] * 1e3,
            "floor_ms": (weights + row_kv) / bandwidth * 1e3,
            "tokens_per_s": got["tokens_per_s"],
            "floor_tokens_per_s": {
                str(c): c * bandwidth / (weights + c * row_kv) for c in plan.concurrency
            },
        }
    short_ctx = contexts["short"]
    result = {
        "mode": "tiny" if plan.tiny else "qwen2-vl-2b-random",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "plan": {k: v for k, v in asdict(plan).items() if k != "workdir"},
        "weight_bytes": hf["weight_bytes"],
        "decode_weight_bytes": weights,
        "kv_bytes_per_token": kv,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "tpot_ms": {
            "bandwidth_floor": short_ctx["floor_ms"],
            "hf_generate": hf["tpot_s"] * 1e3,
            "vlmserve": short_ctx["tpot_ms"],
        },
        "tokens_per_s": {
            "hf_generate_one_at_a_time": hf["tokens_per_s"],
            "vlmserve": short_ctx["tokens_per_s"],
        },
        "contexts": contexts,
        "embed_images_per_s": {
            "image_size": plan.image_size,
            "hf_one_per_forward": hf["images_per_s"],
            "vlmserve": embed_rate,
        },
        "phases_s": phases.seconds,
    }
    result["ratios"] = ratios(result)
    return result


def _levels(text: str) -> list[int]:
    levels = [int(c) for c in text.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated levels, each >= 1")
    return levels


def _contexts(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names or any(n not in CONTEXTS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, of {', '.join(CONTEXTS)}")
    return ["short", *(n for n in dict.fromkeys(names) if n != "short")]


def parse_args(argv: list[str] | None = None) -> tuple[Plan, Path | None, Path | None]:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--tiny", action="store_true", help="tiny random checkpoint on CPU (float32), seconds")
    add(
        "--no-cuda-graphs",
        action="store_true",
        help="vlmserve's decode without --cuda-graphs (attention over gathered blocks)",
    )
    add(
        "--quick",
        action="store_true",
        help="contexts short,4k (tiny: short,1k), levels 1,8,64 (tiny: 1,8), fewer requests "
        "and images: what scripts/gpu_check.sh runs, within its 5 minutes",
    )
    add("--json", type=Path, help="also write the results to this JSON file")
    add("--device", help="default: cuda (cpu with --tiny)")
    add("--max-tokens", type=int, help="output tokens per request (default 64; tiny 16)")
    add(
        "--concurrency",
        type=_levels,
        help="comma-separated levels (default 1,8,32,64,128; --quick 1,8,64)",
    )
    add(
        "--contexts",
        type=_contexts,
        help="comma-separated prompt lengths per row of short (~100 tokens), 1k, 4k (default "
        "all; --tiny short,1k; --quick short,4k); short is always measured",
    )
    add("--images", type=int, help="images per embedding run (default 64; quick 16; tiny 4)")
    add("--image-size", type=int, help="image width and height (default 448; tiny 112)")
    add("--embed-max-batch", type=int, default=16, help="items per embedding forward pass")
    add("--workdir", type=Path, help="where the 2B checkpoint goes (default: temp, removed)")
    args = parser.parse_args(argv)
    tiny, quick = args.tiny, args.quick
    if not tiny and args.device in (None, "cuda") and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: run on a GPU machine, or pass --tiny for a CPU run")
    if tiny:
        levels = [1, 8] if quick else LEVELS[:4]
        contexts = ["short", "1k"]  # the tiny checkpoint has 4,096 positions
    else:
        levels = QUICK_LEVELS if quick else LEVELS
        contexts = ["short", "4k"] if quick else list(CONTEXTS)
    plan = Plan(
        cuda_graphs=not args.no_cuda_graphs,
        tiny=tiny,
        device=args.device or ("cpu" if tiny else "cuda"),
        dtype="float32" if tiny else "bfloat16",
        max_tokens=args.max_tokens or (16 if tiny else 64),
        prompt_words=16 if tiny else 96,
        concurrency=args.concurrency or levels,
        sequential=2 if tiny or quick else 4,
        images=args.images or (4 if tiny else 16 if quick else 64),
        image_size=args.image_size or (112 if tiny else 448),
        embed_max_batch=args.embed_max_batch,
        copy_mib=64 if tiny else 2048,
        contexts=args.contexts or contexts,
        quick=quick,
    )
    return plan, args.json, args.workdir


def main(argv: list[str] | None = None) -> None:
    plan, json_path, workdir = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)  # logs: one line a row
    temp = None if workdir or plan.tiny else Path(tempfile.mkdtemp(prefix="vlmserve-gpu-"))
    plan.workdir = workdir or temp or Path(".")
    try:
        result = run(plan, console)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    console.print(table(result))
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
