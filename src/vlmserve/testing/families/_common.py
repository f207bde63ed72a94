"""Shared parts of the tiny family builders: tokenizer, template files, save, cache.

Every family checkpoint is built the same way as ``tiny.build_qwen2_vl``: the locally
trained BPE tokenizer (``tiny_tokenizer.build_tokenizer``) plus the family's own special
tokens, the family's real processor classes and official chat template (vendored under
``vlmserve/testing/templates``), random weights drawn from a seeded generator, written
atomically into the tiny cache under ``<family>-<key>``.

torch/transformers are imported inside the functions so importing the registry stays fast.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmserve.testing.tiny import INIT_STD, TinySpec
from vlmserve.testing.tiny_cache import build_atomically, cache_root, short_hash
from vlmserve.testing.tiny_tokenizer import build_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "FAMILY_FORMAT",
    "INIT_STD",
    "SPEC",
    "build_cached",
    "family_tokenizer",
    "hub_vision_names",
    "qwen_tokens",
    "qwen_vision",
    "read_template",
    "save_checkpoint",
    "vit_config",
]

# Bump when a family builder's output changes for an unchanged spec: part of every cache key.
FAMILY_FORMAT = 2
SPEC = TinySpec()


def read_template(name: str) -> str:
    """A vendored chat template (``templates/<name>.jinja``) without its provenance header.

    The header is a Jinja comment block ``{# ... #}`` followed by one newline; the template
    proper starts right after it, byte for byte as published.
    """
    text = resources.files("vlmserve.testing").joinpath("templates", f"{name}.jinja").read_text()
    if text.startswith("{#"):
        text = text[text.index("#}\n") + 3 :]
    return text.removesuffix("\n")


def family_tokenizer(
    *,
    named: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
    eos: str,
    pad: str,
    bos: str | None = None,
    spec: TinySpec = SPEC,
) -> PreTrainedTokenizerBase:
    """The tiny BPE tokenizer plus ``extra`` and ``named`` special tokens (``tokenizer.<name>``).

    ``named`` are the model-specific special tokens processors read as attributes
    (e.g. ``boi_token`` for Gemma 3, ``context_image_token`` for InternVL).
    """
    from transformers import AutoTokenizer

    named = dict(named or {})
    base = build_tokenizer(spec.vocab_target)
    vocab = base.get_vocab()
    wanted = [*extra, *named.values(), eos, pad, *([bos] if bos else [])]
    new = list(dict.fromkeys(t for t in wanted if t not in vocab))
    if new:
        base.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    with tempfile.TemporaryDirectory() as tmp:  # reload: named tokens are an init argument
        base.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(
            tmp, extra_special_tokens=named, eos_token=eos, pad_token=pad, bos_token=bos
        )


def save_checkpoint(
    out: Path,
    *,
    model_class: Any,
    config: Any,
    processor: Any,
    eos_ids: Sequence[int],
    pad_id: int,
    bos_id: int | None = None,
    spec: TinySpec = SPEC,
    randomize: Sequence[str] = (),
) -> None:
    """Seeded random weights of ``model_class(config)``, saved with processor and generation
    config (greedy by default, like the Qwen2-VL checkpoint). ``randomize``: parameters the
    architecture initialises to a constant (Gemma 3's projector: zeros, so every image would
    embed as nothing) drawn from N(0, ``INIT_STD``) instead."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):  # seed without touching the caller's RNG
        torch.manual_seed(spec.seed)
        model = model_class(config)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in randomize:
                params[name].normal_(0.0, INIT_STD)
    model.to(getattr(torch, spec.torch_dtype))
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        do_sample=False,
    ).save_pretrained(out)
    processor.save_pretrained(out)


def hub_vision_names(out: Path) -> None:
    """Rename the saved ``vision_tower.*`` weights to the hub's ``vision_tower.vision_model.*``
    (as ``llava-hf`` checkpoints name them): transformers loads either, vLLM only the hub's."""
    from safetensors.torch import load_file, save_file

    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        renamed = {
            ("vision_tower.vision_model." + k.removeprefix("vision_tower."))
            if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
            else k: v
            for k, v in tensors.items()
        }
        save_file(renamed, path, metadata={"format": "pt"})


def build_cached(
    family: str,
    write: Callable[[Path], None],
    out_dir: Path | None,
    spec: TinySpec = SPEC,
    version: int = 0,
) -> Path:
    """Build (or find in the cache) ``<family>-<key>`` with ``write(tmp_dir)``.

    The key covers the spec, ``FAMILY_FORMAT``, the family's own ``version`` (bumped when its
    builder changes) and the vendored template, so editing a template file builds a fresh
    checkpoint instead of serving a stale one.
    """
    key = short_hash(
        {
            "family": family,
            "format": FAMILY_FORMAT,
            "template": short_hash(read_template(family)),
            **dataclasses.asdict(spec),
            **({"version": version} if version else {}),
        }
    )
    target = Path(out_dir) if out_dir is not None else cache_root() / f"{family}-{key}"
    return build_atomically(target, partial(_write, write), what=f"tiny {family} {key}")


def _write(write: Callable[[Path], None], out: Path) -> None:
    write(out)


def token_ids(tokenizer: PreTrainedTokenizerBase, *tokens: str) -> list[int]:
    return [int(tokenizer.convert_tokens_to_ids(t)) for t in tokens]


def text_config(vocab_size: int, spec: TinySpec = SPEC, **extra: Any) -> dict[str, Any]:
    """The tiny decoder's common fields (Llama/Qwen2 names)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "initializer_range": INIT_STD,
        **extra,
    }


def vit_config(image_size: Any, patch: Any, spec: TinySpec = SPEC, **extra: Any) -> dict[str, Any]:
    """A ViT vision tower's common fields (CLIP, SigLIP, InternViT, Idefics3 names)."""
    return {
        "hidden_size": spec.vision_embed_dim,
        "intermediate_size": 2 * spec.vision_embed_dim,
        "num_hidden_layers": spec.vision_depth,
        "num_attention_heads": spec.vision_num_heads,
        "image_size": image_size,
        "patch_size": patch,
        "initializer_range": INIT_STD,
        **extra,
    }


def qwen_vision(patch: int, hidden_act: str, spec: TinySpec = SPEC, **extra: Any) -> dict[str, Any]:
    """A Qwen-VL vision tower's common fields (2x2 merge, 2-frame temporal patches)."""
    return {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_embed_dim,
        "intermediate_size": 2 * spec.vision_embed_dim,
        "num_heads": spec.vision_num_heads,
        "out_hidden_size": spec.hidden_size,
        "hidden_act": hidden_act,
        "patch_size": patch,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": INIT_STD,
        **extra,
    }


def qwen_tokens(tokenizer: PreTrainedTokenizerBase, eos: str, pad: str) -> dict[str, int]:
    """The ids of a Qwen-VL checkpoint's end, pad and vision tokens, as its config names them
    (``image_token_id``...), plus ``eos`` and ``pad``."""
    eos_id, pad_id, image, video, start, end = token_ids(
        tokenizer,
        eos,
        pad,
        "<|image_pad|>",
        "<|video_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
    )
    return {
        "eos": eos_id,
        "pad": pad_id,
        "image_token_id": image,
        "video_token_id": video,
        "vision_start_token_id": start,
        "vision_end_token_id": end,
    }
