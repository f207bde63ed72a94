"""The models and prompts of benchmarks/gpu.py: Qwen2-VL-2B-Instruct's shapes with random
weights, and chat prompts of a given length in tokens (each one distinct).
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import torch

from vlmserve.client.payload import prompt_text
from vlmserve.testing import build_qwen2_vl

__all__ = ["CONTEXTS", "build_real_checkpoint", "context_prompts", "free_memory", "real_config"]

# prompt tokens per row by context name; "short": today's ~100-token prompt (--prompt-words)
CONTEXTS = {"short": 0, "1k": 1024, "4k": 4096}


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


def context_prompts(tokenizer: Any, context: str, words: int, count: int, label: str) -> list[str]:
    """``count`` distinct prompts of ``context`` (``CONTEXTS``): for "short" ``words`` random
    words, else random words cut to that many tokens of ``tokenizer``. Each opens with
    ``label`` and its index, so no two (and none of another label) share a prefix beyond it."""
    target = CONTEXTS[context]
    out = []
    for i in range(count):
        rng = random.Random(f"{label}/{context}/{i}")
        head = f"{label} {i}: continue this text."
        if not target:
            out.append(f"{head} {prompt_text(rng, words)}")
            continue
        ids = tokenizer(f"{head} {prompt_text(rng, target)}")["input_ids"][:target]
        out.append(tokenizer.decode(ids))
    return out
