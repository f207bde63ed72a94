"""Query-document pairs -> the prompts each reranker kind was trained on, and a batch of them
-> model inputs: one unpadded row per pair for the batched engine's packed rows
(``pair_inputs``), or one left-padded batch for transformers' forward (``build_batch``).

Two prompt formats, each as its model's own code writes it:

- ``jina`` (jina-reranker-m0, ``modeling.py``'s ``formatting_prompts_func``): no chat
  template; ``"**Document**:\\n<doc>\\n**Query**:\\n<query>"`` where an image side is
  ``<|vision_start|><|image_pad|><|vision_end|>``; the score token (id 100) is appended
  after padding, and the score is read there.
- ``yes_no`` (Qwen3-VL-Reranker, ``Qwen3VLReranker.format_mm_instruction``): the model's chat
  template over a system message (the yes/no judgement), then one user message whose parts
  are ``<Instruct>: ...``, ``<Query>:``, the query's video, image and text, ``\\n<Document>:``
  and the document's; the generation prompt follows, and P(yes) is read at its last token.

The score is read at each row's last token (left padding puts it at the last position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from vlmserve.engine.hf.inputs import fit_image, patch_factor, run_processor
from vlmserve.engine.types import EmbedInput, ScorePair
from vlmserve.errors import InvalidRequest

__all__ = [
    "JINA",
    "JINA_SCORE_TOKEN_ID",
    "YES_NO",
    "YES_NO_INSTRUCTION",
    "YES_NO_SYSTEM",
    "Prompt",
    "append_score_token",
    "build_batch",
    "check_pair",
    "cut_text",
    "jina_prompt",
    "pair_inputs",
    "yes_no_prompt",
]

JINA = "jina"
YES_NO = "yes_no"
JINA_SCORE_TOKEN_ID = 100  # ``JinaVLForRanking.score_token_id``
_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
YES_NO_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
YES_NO_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


@dataclass(slots=True)
class Prompt:
    """One pair's prompt text (placeholders not expanded) and its media in prompt order."""

    text: str
    images: list[Image.Image] = field(default_factory=list)
    videos: list[list[Image.Image]] = field(default_factory=list)


def check_pair(pair: ScorePair, index: int) -> None:
    """Raise ``InvalidRequest`` naming ``documents[index]`` unless both sides hold something."""
    for side, item in (("query", pair.query), (f"documents[{index}]", pair.document)):
        if item.image is not None and item.frames is not None:
            raise InvalidRequest(f"{side} has both an image and a video; send one", param=side)
        if item.frames is not None and not item.frames:
            raise InvalidRequest(f"{side} is a video without frames", param=side)
        if not (item.text or "").strip() and item.image is None and item.frames is None:
            raise InvalidRequest(f"{side} is empty; send text, an image or a video", param=side)


def cut_text(tokenizer: Any, text: str | None, max_tokens: int | None) -> str | None:
    """``text`` cut to its first ``max_tokens`` tokens (unchanged when shorter or no limit)."""
    if text is None or max_tokens is None:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def _media(item: EmbedInput, prompt: Prompt) -> None:
    if item.frames is not None:
        prompt.videos.append(item.frames)
    if item.image is not None:
        prompt.images.append(item.image)


def _jina_side(item: EmbedInput) -> str:
    placeholder = _VIDEO if item.frames is not None else _IMAGE if item.image is not None else ""
    return placeholder + (item.text or "")


def jina_prompt(pair: ScorePair, tokenizer: Any) -> Prompt:
    """jina-reranker-m0's prompt: the document first, then the query (score token not yet
    appended)."""
    document = EmbedInput(
        cut_text(tokenizer, pair.document.text, pair.max_doc_tokens),
        pair.document.image,
        pair.document.frames,
    )
    prompt = Prompt(f"**Document**:\n{_jina_side(document)}\n**Query**:\n{_jina_side(pair.query)}")
    _media(document, prompt)
    _media(pair.query, prompt)
    return prompt


def _yes_no_side(item: EmbedInput, prefix: str, prompt: Prompt) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": prefix}]
    if item.frames is not None:
        parts.append({"type": "video"})
    if item.image is not None:
        parts.append({"type": "image"})
    if item.text:
        parts.append({"type": "text", "text": item.text})
    _media(item, prompt)
    return parts


def yes_no_prompt(pair: ScorePair, processor: Any, instruction: str = YES_NO_INSTRUCTION) -> Prompt:
    """Qwen3-VL-Reranker's prompt, rendered by the model's own chat template."""
    tokenizer = processor.tokenizer
    document = EmbedInput(
        cut_text(tokenizer, pair.document.text, pair.max_doc_tokens),
        pair.document.image,
        pair.document.frames,
    )
    prompt = Prompt("")
    user = [
        {"type": "text", "text": f"<Instruct>: {instruction}"},
        *_yes_no_side(pair.query, "<Query>:", prompt),
        *_yes_no_side(document, "\n<Document>:", prompt),
    ]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": YES_NO_SYSTEM}]},
        {"role": "user", "content": user},
    ]
    prompt.text = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return prompt


def _processed(
    processor: Any, kind: str, pairs: list[ScorePair], **extra: Any
) -> dict[str, torch.Tensor]:
    if kind == JINA:
        prompts = [jina_prompt(p, processor.tokenizer) for p in pairs]
    else:
        prompts = [yes_no_prompt(p, processor) for p in pairs]
    factor = patch_factor(processor)
    images = [fit_image(i, factor) for p in prompts for i in p.images]
    videos = [[fit_image(f, factor) for f in v] for p in prompts for v in p.videos]
    texts = [p.text for p in prompts]
    batch = run_processor(processor, texts, images, videos, **extra)
    if kind == JINA:
        append_score_token(batch)  # after the padding: every row's last column
    return batch


def build_batch(processor: Any, kind: str, pairs: list[ScorePair]) -> dict[str, torch.Tensor]:
    """Tokenise and preprocess ``pairs`` as one left-padded batch (input_ids: [B, L]); for
    ``jina`` the score token ends every row."""
    return _processed(processor, kind, pairs, padding=True, padding_side="left")


def pair_inputs(processor: Any, kind: str, pairs: list[ScorePair]) -> list[dict[str, torch.Tensor]]:
    """Each pair's processor outputs as a single unpadded row (input_ids: [1, T]), what the
    batched engine's prompt embedder takes; for ``jina`` the score token ends each. Text-only
    pairs are tokenised in one call of the tokenizer itself (what the processor does with a
    prompt without media, less its per-call overhead and padding); a pair with media has a
    processor call of its own."""
    rows: list[dict[str, torch.Tensor] | None] = [None] * len(pairs)
    text = [i for i, pair in enumerate(pairs) if not _has_media(pair)]
    for i, ids in zip(text, _text_ids(processor, kind, [pairs[i] for i in text]), strict=True):
        row = torch.tensor([ids])
        rows[i] = {"input_ids": row, "attention_mask": torch.ones_like(row)}
    for i, pair in enumerate(pairs):
        if rows[i] is None:
            rows[i] = _processed(processor, kind, [pair])
    return [row for row in rows if row is not None]


def _text_ids(processor: Any, kind: str, pairs: list[ScorePair]) -> list[list[int]]:
    """The token ids of text-only pairs' prompts (jina's score token appended)."""
    if not pairs:
        return []
    if kind == JINA:
        texts = [jina_prompt(p, processor.tokenizer).text for p in pairs]
    else:
        texts = [yes_no_prompt(p, processor).text for p in pairs]
    ids: list[list[int]] = processor.tokenizer(texts)["input_ids"]
    return [[*row, JINA_SCORE_TOKEN_ID] for row in ids] if kind == JINA else ids


def _has_media(pair: ScorePair) -> bool:
    return any(s.image is not None or s.frames is not None for s in (pair.query, pair.document))


def append_score_token(batch: dict[str, torch.Tensor]) -> None:
    """End every row with jina's score token: a text token, attended (in place)."""
    rows = batch["input_ids"].shape[0]
    column = {"input_ids": JINA_SCORE_TOKEN_ID, "attention_mask": 1, "mm_token_type_ids": 0}
    for key, value in column.items():
        if key in batch:
            extra = torch.full((rows, 1), value, dtype=batch[key].dtype)
            batch[key] = torch.cat([batch[key], extra], dim=1)
