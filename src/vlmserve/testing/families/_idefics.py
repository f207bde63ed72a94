"""What the tiny Idefics3 and SmolVLM builders share: SigLIP-like tower, pixel shuffle, tiles.

SmolVLM is Idefics3's architecture with its own classes (and video); both split an image
into ``max_image_size`` tiles plus one global view, each ``image_seq_len`` ``<image>`` tokens.
"""

from __future__ import annotations

from typing import Any

from vlmserve.testing.families._common import (
    family_tokenizer,
    text_config,
    vit_config,
)

__all__ = ["IMAGE_SIZE", "SCALE", "SEQ_LEN", "TOKENS", "config_parts", "tiles", "tokenizer"]

IMAGE_SIZE = 56  # one tile: (56 / 14)**2 = 16 patches -> 16 / SCALE**2 = 4 tokens
PATCH = 14
SCALE = 2
SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
# The Idefics3/SmolVLM vocabulary's image and turn tokens (added tokens in the real tokenizers).
TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)),
)


def tokenizer(*, bos: str, eos: str, pad: str, extra: tuple[str, ...] = ()) -> Any:
    return family_tokenizer(extra=(*TOKENS, *extra), eos=eos, pad=pad, bos=bos)


def tiles() -> dict[str, Any]:
    """Processor sizes: an image becomes up to 2x2 IMAGE_SIZE tiles plus the global view."""
    return {
        "size": {"longest_edge": 2 * IMAGE_SIZE},
        "max_image_size": {"longest_edge": IMAGE_SIZE},
    }


def config_parts(vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """The config class's ``vision_config``, ``text_config``, ``scale_factor``, token ids."""
    text = text_config(vocab_size, model_type="llama", hidden_act="silu")
    text.update(
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=False,
    )
    return {
        "vision_config": vit_config(IMAGE_SIZE, PATCH),
        "text_config": text,
        "scale_factor": SCALE,
        "image_token_id": ids["image"],
        "pad_token_id": ids["pad"],
    }
