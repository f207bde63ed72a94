"""Tiny PEFT LoRA adapters: one that fits a tiny Qwen2-VL base, one made for another model.

``build_lora_adapter`` stands in for adapters like TIGER-Lab/VLM2Vec-Qwen2VL-2B (LoRA on
the language model's attention projections). Both LoRA matrices are random, because
PEFT's default zero ``lora_B`` would make the adapter a no-op that tests cannot see.

``build_foreign_adapter`` is a LoRA for a tiny Phi-3 (fused ``qkv_proj``/``gate_up_proj``,
hidden 96) that claims ``tiny-random/Phi-3.5-vision-instruct`` as its base: loading it on
Qwen2-VL must be refused (peft would only warn, and the embeddings would come from the bare
base).
"""

from __future__ import annotations

import json
import warnings
from functools import partial
from pathlib import Path
from typing import Any

from vlmserve.testing.tiny_cache import build_atomically, cache_root, short_hash

__all__ = ["FOREIGN_BASE_NAME", "build_foreign_adapter", "build_lora_adapter"]

ADAPTER_FORMAT = 1
FOREIGN_BASE_NAME = "tiny-random/Phi-3.5-vision-instruct"
QWEN2_VL_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # only the LM has these names
PHI3_LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_LORA_STD = 0.1  # delta W = 2 * B @ A (r=8) has std ~0.06, next to base weights of std 0.1


def build_lora_adapter(
    base_dir: Path, *, seed: int = 1, r: int = 8, out_dir: Path | None = None
) -> Path:
    """Build (or find in the cache) a LoRA adapter for the tiny checkpoint at ``base_dir``."""
    base_dir = Path(base_dir)
    key = short_hash(
        {"format": ADAPTER_FORMAT, "base": str(base_dir.resolve()), "seed": seed, "r": r}
    )
    target = Path(out_dir) if out_dir is not None else cache_root() / f"lora-{key}"
    return build_atomically(
        target, partial(_write_lora, base_dir, seed, r), what=f"tiny LoRA r={r} for {base_dir}"
    )


def build_foreign_adapter(*, seed: int = 2, out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) a LoRA adapter for a tiny Phi-3, not for Qwen2-VL."""
    key = short_hash({"format": ADAPTER_FORMAT, "foreign": FOREIGN_BASE_NAME, "seed": seed})
    target = Path(out_dir) if out_dir is not None else cache_root() / f"foreign-lora-{key}"
    return build_atomically(
        target, partial(_write_foreign, seed), what=f"foreign LoRA for {FOREIGN_BASE_NAME}"
    )


def _write_lora(base_dir: Path, seed: int, r: int, out: Path) -> None:
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(base_dir)
    _save_random_lora(base, QWEN2_VL_LORA_TARGETS, seed, r, str(base_dir), out)


def _write_foreign(seed: int, out: Path) -> None:
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        base = Phi3ForCausalLM(config)
    _save_random_lora(base, PHI3_LORA_TARGETS, seed, 8, FOREIGN_BASE_NAME, out)


def _save_random_lora(
    base: Any, targets: tuple[str, ...], seed: int, r: int, base_name: str, out: Path
) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(targets), task_type=None
    )
    with warnings.catch_warnings():
        # peft 0.21 calls transformers 5.x's deprecated `is_gradient_checkpointing` (FutureWarning)
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * _LORA_STD)
    model.peft_config["default"].base_model_name_or_path = base_name
    # save_embedding_layers=False: "auto" would ask the Hub about base_name's config.
    model.save_pretrained(out, save_embedding_layers=False)
    # peft keeps target_modules as a set: sort it so the file's bytes do not depend on hash seeds
    config_path = out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["target_modules"] = sorted(saved["target_modules"])
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True))
