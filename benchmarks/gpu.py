"""GPU benchmark: vlmserve's hf engine beside plain transformers, on Qwen2-VL-2B-sized models.

    python benchmarks/gpu.py --json gpu.json          # real 2B configurations, random bf16 weights
    python benchmarks/gpu.py --tiny --json tiny.json  # the same code, tiny checkpoint, CPU, seconds

What it measures (every number beside plain HF transformers, one request at a time, same device):

1. copy bandwidth: a large on-device tensor copy, (read + write bytes) / seconds.
2. TPOT at concurrency 1 (ms per output token after the first, from whole-request latencies:
   (T(n) - T(1)) / (n - 1)) of HFChatBackend and of ``model.generate``, next to the bandwidth
   floor: bytes read per decode step (every weight but the vision tower's) / copy bandwidth.
3. output tokens/s with 8, 32 and 64 concurrent requests through HFChatBackend (its public
   API: prepare + generate; each level warmed up first with as many other prompts), next to
   ``model.generate`` run one request after another (that rate does not depend on how many
   requests wait, so it is measured once).
4. embedding images/s for 448x448 images (112x112 with --tiny) sent as concurrent
   single-image requests through HFEmbedBackend (VLM2Vec-2B: base + a random LoRA, merged
   at load), next to plain transformers embedding one image per forward pass (last token
   of the final hidden state; the plain base: a merged LoRA costs nothing extra).

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
import gc
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from rich.console import Console
from rich.table import Table

from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.embed import EmbedInput, HFEmbedBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart
from vlmserve.testing import build_lora_adapter, build_qwen2_vl
from vlmserve.testing.media import gradient_image

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384  # Qwen2-VL's image processor defaults
IMAGE_PROMPT = "Represent the given image."


@dataclass(slots=True)
class Plan:
    tiny: bool
    device: str
    dtype: str
    max_tokens: int  # output tokens per request (EOS ignored)
    prompt_words: int  # words of filler text per chat prompt
    concurrency: list[int]
    sequential: int  # requests for the one-at-a-time generate rate
    images: int  # images embedded per measurement
    image_size: int
    embed_max_batch: int
    copy_mib: int
    workdir: Path = field(default_factory=Path)


# --- checkpoints -------------------------------------------------------------------------
def real_config(tiny_dir: Path) -> Any:
    """Qwen2-VL-2B-Instruct's config.json numbers; special token ids from the tiny tokenizer."""
    from transformers import AutoConfig, Qwen2VLConfig

    tiny = AutoConfig.from_pretrained(tiny_dir)
    text = tiny.get_text_config()
    text_config = {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,  # head_dim 128
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [16, 24, 24],
        },
        "bos_token_id": text.bos_token_id,
        "eos_token_id": text.eos_token_id,
        "pad_token_id": text.pad_token_id,
        "tie_word_embeddings": True,
    }
    vision_config = {
        "depth": 32,
        "embed_dim": 1280,
        "num_heads": 16,
        "mlp_ratio": 4,
        "hidden_size": 1536,  # the merger projects into the text hidden size
        "hidden_act": "quick_gelu",
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    ids = {k: getattr(tiny, k) for k in ("image_token_id", "video_token_id")}
    ids |= {k: getattr(tiny, k) for k in ("vision_start_token_id", "vision_end_token_id")}
    return Qwen2VLConfig(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=True, **ids
    )


def build_real_checkpoint(out: Path, device: str) -> Path:
    """Random-weight Qwen2-VL-2B (bf16, safetensors) + the tiny processor, written to ``out``."""
    from transformers import AutoProcessor, GenerationConfig, Qwen2VLForConditionalGeneration

    tiny_dir = build_qwen2_vl()
    with torch.device(device):  # initialise on the GPU: seconds instead of minutes on CPU
        model = Qwen2VLForConditionalGeneration(real_config(tiny_dir)).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    free_memory()
    AutoProcessor.from_pretrained(tiny_dir).save_pretrained(out)
    GenerationConfig.from_pretrained(tiny_dir).save_pretrained(out)
    return out


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- plain transformers baselines --------------------------------------------------------
def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes/s moved by ``dst.copy_(src)`` of ``mib`` MiB (read + write), best of 5."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() / best


def decode_weight_bytes(model: Any) -> tuple[int, int]:
    """(all weight bytes, bytes read per decode step: all but the vision tower's)."""
    params = list(model.named_parameters())  # tied embedding/lm_head counted once
    total = sum(p.numel() * p.element_size() for _, p in params)
    vision = sum(p.numel() * p.element_size() for n, p in params if ".visual." in f".{n}")
    return total, total - vision


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


async def vlmserve_chat(
    plan: Plan, ckpt: Path, texts: list[str], warm: list[str]
) -> dict[str, Any]:
    options = LoadOptions(source=str(ckpt), device=plan.device, dtype=plan.dtype)
    top = max(plan.concurrency)
    backend = HFChatBackend(
        "bench-chat", options, max_model_len=32768, max_queued=top + 1, max_num_seqs=top
    )
    await asyncio.to_thread(backend.load)
    try:
        await stream(backend, texts[0], 4)  # warm-up
        latencies = {}
        for n in (plan.max_tokens, 1):  # best of 3 whole-request latencies, as for HF
            latencies[n] = min([await timed(stream(backend, texts[0], n)) for _ in range(3)])
        tpot = per_token(latencies.__getitem__, plan.max_tokens, tries=1)
        rates = {}
        for c in plan.concurrency:
            # first-seen batch shapes (kernel choice, allocator growth) outside the timing;
            # other prompts, so that the prefix cache holds none of the timed ones
            await asyncio.gather(*(stream(backend, t, 4) for t in warm[:c]))
            started = time.perf_counter()
            runs = await asyncio.gather(*(stream(backend, t, plan.max_tokens) for t in texts[:c]))
            tokens = sum(runs)
            rates[str(c)] = tokens / (time.perf_counter() - started)
    finally:
        backend.close()
        free_memory()
    return {"tpot_s": tpot, "tokens_per_s": rates}


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
def prompts(plan: Plan, count: int, label: str = "Request") -> list[str]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "at", "dawn"]
    filler = " ".join(words[i % len(words)] for i in range(plan.prompt_words))
    return [f"{label} {i}: continue this text. {filler}" for i in range(count)]


def run(plan: Plan) -> dict[str, Any]:
    device = torch.device(plan.device)
    if plan.tiny:
        ckpt = build_qwen2_vl()
        adapter: Path | None = build_lora_adapter(ckpt)
    else:
        ckpt = build_real_checkpoint(plan.workdir / "qwen2-vl-2b-random", plan.device)
        adapter = build_lora_adapter(ckpt, out_dir=plan.workdir / "vlm2vec-lora-random")
    texts = prompts(plan, max(plan.concurrency))
    bandwidth = copy_bandwidth(device, plan.copy_mib)
    hf = hf_baselines(plan, ckpt, texts)
    warm = prompts(plan, max(plan.concurrency), label="Warm-up")
    ours = asyncio.run(vlmserve_chat(plan, ckpt, texts, warm))
    embed_rate = asyncio.run(vlmserve_embed(plan, ckpt, adapter))
    floor = hf["decode_weight_bytes"] / bandwidth
    result = {
        "mode": "tiny" if plan.tiny else "qwen2-vl-2b-random",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "plan": {k: v for k, v in asdict(plan).items() if k != "workdir"},
        "weight_bytes": hf["weight_bytes"],
        "decode_weight_bytes": hf["decode_weight_bytes"],
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "tpot_ms": {
            "bandwidth_floor": floor * 1e3,
            "hf_generate": hf["tpot_s"] * 1e3,
            "vlmserve": ours["tpot_s"] * 1e3,
        },
        "tokens_per_s": {
            "hf_generate_one_at_a_time": hf["tokens_per_s"],
            "vlmserve": ours["tokens_per_s"],
        },
        "embed_images_per_s": {
            "image_size": plan.image_size,
            "hf_one_per_forward": hf["images_per_s"],
            "vlmserve": embed_rate,
        },
    }
    result["ratios"] = ratios(result)
    return result


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """Each vlmserve figure over its plain-transformers one; TPOTs over the bandwidth floor."""
    tpot, tok, emb = result["tpot_ms"], result["tokens_per_s"], result["embed_images_per_s"]
    base = tok["hf_generate_one_at_a_time"]
    out = {
        "hf_tpot_over_floor": _ratio(tpot["hf_generate"], tpot["bandwidth_floor"]),
        "vlmserve_tpot_over_floor": _ratio(tpot["vlmserve"], tpot["bandwidth_floor"]),
        "vlmserve_tpot_over_hf": _ratio(tpot["vlmserve"], tpot["hf_generate"]),
        "vlmserve_embed_over_hf": _ratio(emb["vlmserve"], emb["hf_one_per_forward"]),
    }
    for c, rate in tok["vlmserve"].items():
        out[f"vlmserve_tokens_c{c}_over_hf"] = _ratio(rate, base)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None  # None: too fast to time (only seen with --tiny)


def _fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.2f}{unit}"


def table(result: dict[str, Any]) -> Table:
    tpot, tok, emb = result["tpot_ms"], result["tokens_per_s"], result["embed_images_per_s"]
    r, bandwidth = result["ratios"], result["copy_bandwidth_gb_s"]
    title = f"vlmserve hf engine vs plain transformers ({result['mode']}, {result['device']})"
    out = Table(title=f"{title}\ncopy bandwidth {bandwidth:.1f} GB/s")
    for name in ("metric", "HF one at a time", "vlmserve", "vlmserve / HF", "note"):
        out.add_column(name, justify="left" if name in ("metric", "note") else "right")
    floor = (
        f"floor {tpot['bandwidth_floor']:.3f} ms: HF {_fmt(r['hf_tpot_over_floor'], 'x')}, "
        f"vlmserve {_fmt(r['vlmserve_tpot_over_floor'], 'x')}"
    )
    ms = (f"{tpot['hf_generate']:.2f}", f"{tpot['vlmserve']:.2f}")
    out.add_row("TPOT ms, 1 request", *ms, _fmt(r["vlmserve_tpot_over_hf"]), floor)
    base = f"{tok['hf_generate_one_at_a_time']:.1f}"
    for c, rate in tok["vlmserve"].items():
        ratio = _fmt(r[f"vlmserve_tokens_c{c}_over_hf"])
        out.add_row(f"output tok/s, {c} concurrent", base, f"{rate:.1f}", ratio, "HF: in turn")
    rates = (f"{emb['hf_one_per_forward']:.1f}", f"{emb['vlmserve']:.1f}")
    size, ratio = emb["image_size"], _fmt(r["vlmserve_embed_over_hf"])
    out.add_row(f"embed images/s, {size}x{size}", *rates, ratio, "HF: one per forward")
    return out


def parse_args(argv: list[str] | None = None) -> tuple[Plan, Path | None, Path | None]:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--tiny", action="store_true", help="tiny random checkpoint on CPU (float32), seconds")
    add("--json", type=Path, help="also write the results to this JSON file")
    add("--device", help="default: cuda (cpu with --tiny)")
    add("--max-tokens", type=int, help="output tokens per request (default 64; tiny 16)")
    add("--concurrency", default="8,32,64", help="comma-separated levels (default 8,32,64)")
    add("--images", type=int, help="images per embedding run (default 64; tiny 4)")
    add("--image-size", type=int, help="image width and height (default 448; tiny 112)")
    add("--embed-max-batch", type=int, default=16, help="items per embedding forward pass")
    add("--workdir", type=Path, help="where the 2B checkpoint goes (default: temp, removed)")
    args = parser.parse_args(argv)
    tiny = args.tiny
    if not tiny and args.device in (None, "cuda") and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible: run on a GPU machine, or pass --tiny for a CPU run")
    plan = Plan(
        tiny=tiny,
        device=args.device or ("cpu" if tiny else "cuda"),
        dtype="float32" if tiny else "bfloat16",
        max_tokens=args.max_tokens or (16 if tiny else 64),
        prompt_words=16 if tiny else 96,
        concurrency=[int(c) for c in args.concurrency.split(",")],
        sequential=2 if tiny else 4,
        images=args.images or (4 if tiny else 64),
        image_size=args.image_size or (112 if tiny else 448),
        embed_max_batch=args.embed_max_batch,
        copy_mib=64 if tiny else 2048,
    )
    return plan, args.json, args.workdir


def main(argv: list[str] | None = None) -> None:
    plan, json_path, workdir = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)  # logs: one line a row
    temp = None if workdir or plan.tiny else Path(tempfile.mkdtemp(prefix="vlmserve-gpu-"))
    plan.workdir = workdir or temp or Path(".")
    try:
        result = run(plan)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    console.print(table(result))
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
