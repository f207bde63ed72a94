"""Free-text image tasks of the personal tagger (``vlmserve tag``): a caption and a description."""

from __future__ import annotations

__all__ = ["CAPTION_PROMPT", "DESCRIPTION_PROMPT", "caption_text", "media_noun"]

CAPTION_PROMPT = (
    "Write a caption for this {noun}: one sentence, at most 20 words, that says what it shows. "
    "Answer with the sentence only."
)
DESCRIPTION_PROMPT = (
    "Describe this {noun} in one paragraph of 3 to 6 sentences: the subject, the setting, "
    "notable objects, colours, light and mood. Answer with the paragraph only."
)


def media_noun(kind: str) -> str:
    return "video" if kind == "video" else "image"


def caption_text(text: str) -> str:
    """A model's caption trimmed to one line: quotes, a 'Caption:' label and extra lines go."""
    line = next((part.strip() for part in text.strip().splitlines() if part.strip()), "")
    if line.lower().startswith("caption:"):
        line = line[len("caption:") :].strip()
    if len(line) >= 2 and line[0] == line[-1] and line[0] in "\"'":
        line = line[1:-1].strip()
    return line
