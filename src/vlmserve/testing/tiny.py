"""Tiny random-weight checkpoints of real architectures, built locally, never downloaded.

``build_qwen2_vl()`` writes a directory that plain transformers loads like the real
``Qwen/Qwen2-VL-2B-Instruct``: ``AutoConfig``, ``AutoProcessor`` (tokenizer, image and
video processors, chat template), ``AutoModelForImageTextToText`` and
``GenerationConfig`` -- only every dimension is tiny and the output text is random.
Same spec, same bytes: the weights are drawn from a seeded generator.

torch/transformers are imported inside the builders, so a cache hit (and importing
this module) stays fast for the CLI.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmserve.testing.tiny_adapters import build_foreign_adapter, build_lora_adapter
from vlmserve.testing.tiny_cache import build_atomically, cache_root, short_hash
from vlmserve.testing.tiny_tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    QWEN2_VL_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TinySpec",
    "build_foreign_adapter",
    "build_lora_adapter",
    "build_qwen2_vl",
    "cache_root",
    "media_processors",
]

# Bump when the builder's output changes for an unchanged spec: it is part of every cache key.
BUILD_FORMAT = 1
# Weight std. With the usual 0.02 the layers barely move the residual stream, and tied
# embeddings then make greedy decoding repeat the prompt's last token ("\n\n\n..."); at 0.1
# the output is varied random text that reaches multi-byte fragments and special tokens.
INIT_STD = 0.1
_LATER_FIELDS = ("video_min_pixels", "video_max_pixels")


@dataclass(frozen=True, slots=True)
class TinySpec:
    seed: int = 0
    hidden_size: int = 128
    num_attention_heads: int = 4  # head_dim 32: vLLM's CPU kernels accept only 32, 64, 80, ...
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_num_heads: int = 4
    vocab_target: int = 1024  # BPE vocab size to train (special tokens added on top)
    max_position_embeddings: int = 4096
    min_pixels: int = 28 * 28 * 4  # image processor bounds (keep images tiny for CPU speed)
    max_pixels: int = 28 * 28 * 64
    torch_dtype: str = "float32"
    # video processor bounds per frame; None: the image bounds above
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.head_dim % 8:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 8 for mrope")
        if self.vision_embed_dim % (4 * self.vision_num_heads):
            raise ValueError(
                f"vision_embed_dim {self.vision_embed_dim} must be a multiple of "
                f"4 * vision_num_heads ({4 * self.vision_num_heads}) for the vision rope"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def key(self) -> str:
        """Stable short hash of the fields (and of ``BUILD_FORMAT``): the cache key. Fields
        added later count only when set, so existing specs keep their keys (and caches)."""
        fields = dataclasses.asdict(self)
        for name in _LATER_FIELDS:
            if fields[name] is None:
                del fields[name]
        return short_hash({"format": BUILD_FORMAT, **fields})


def build_qwen2_vl(spec: TinySpec = TinySpec(), out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) a tiny Qwen2-VL checkpoint directory and return it."""
    target = Path(out_dir) if out_dir is not None else cache_root() / f"qwen2-vl-{spec.key()}"
    return build_atomically(
        target, partial(_write_qwen2_vl, spec), what=f"tiny Qwen2-VL {spec.key()}"
    )


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (t, h, w) like the real model (64 -> 16, 24, 24)."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def _write_qwen2_vl(spec: TinySpec, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_tokenizer(spec.vocab_target)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = _qwen2_vl_config(spec, ids, vocab_size=len(tokenizer))
    with torch.random.fork_rng(devices=[]):  # seed without touching the caller's RNG
        torch.manual_seed(spec.seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.to(getattr(torch, spec.torch_dtype))
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=None,
        eos_token_id=[ids[EOS_TOKEN], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
        do_sample=False,
    ).save_pretrained(out)
    _processor(spec, tokenizer).save_pretrained(out)
    _add_legacy_rope_keys(out / "config.json")


def _qwen2_vl_config(spec: TinySpec, ids: dict[str, int], *, vocab_size: int) -> Any:
    from transformers import Qwen2VLConfig

    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": mrope_section(spec.head_dim),
        },
        "initializer_range": INIT_STD,
        # As in the real config: bos is <|endoftext|> although the tokenizer adds no bos.
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "tie_word_embeddings": True,  # Qwen2-VL-2B ties them (7B does not)
    }
    vision_config = {
        "depth": spec.vision_depth,
        "embed_dim": spec.vision_embed_dim,
        "num_heads": spec.vision_num_heads,
        "hidden_size": spec.hidden_size,  # the merger projects into the text hidden size
        "mlp_ratio": 2,
        "hidden_act": "quick_gelu",
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": INIT_STD,
    }
    return Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype=spec.torch_dtype,
    )


def media_processors(spec: TinySpec = TinySpec()) -> tuple[Any, Any]:
    """The image and video processors of ``spec``'s checkpoint (its pixel bounds), alone."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    video_size = {
        "shortest_edge": spec.video_min_pixels or spec.min_pixels,
        "longest_edge": spec.video_max_pixels or spec.max_pixels,
    }
    common = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    return (
        Qwen2VLImageProcessor(size=size, **common),
        # cap_pixels_per_frame=True: the qwen-vl-utils behaviour (and silences a v5 warning)
        Qwen2VLVideoProcessor(size=video_size, **common, cap_pixels_per_frame=True),
    )


def _processor(spec: TinySpec, tokenizer: PreTrainedTokenizerBase) -> Any:
    from transformers import Qwen2VLProcessor

    image, video = media_processors(spec)
    return Qwen2VLProcessor(
        image_processor=image,
        tokenizer=tokenizer,
        video_processor=video,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def _add_legacy_rope_keys(config_path: Path) -> None:
    """Also write the rope settings under the pre-5.x name, as the Hub's Qwen2-VL config has them.

    transformers 5.x reads ``rope_parameters`` (and accepts ``rope_scaling``); 4.x and
    engines built on it (vLLM) read ``rope_scaling["mrope_section"]`` and ``rope_theta``.
    """
    config = json.loads(config_path.read_text())
    text = config["text_config"]
    rope = text["rope_parameters"]
    text["rope_scaling"] = dict(rope)  # no "type": "mrope", which 5.x would keep as an extra key
    text["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
