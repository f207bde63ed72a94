"""Greedy answers of two servers compared request by request (``benchmarks/equivalence.py``).

An ``Answer`` is what one chat completion returned: its tokens (the bytes of each
``logprobs.content`` entry), their log-probabilities, the gap between the two most likely
tokens at each step, ``usage.prompt_tokens`` and the text. ``compare`` says whether two answers
are the same tokens and prompt length; where the tokens part, a gap under ``NEAR_TIE`` at that
step on either side makes it a near-tie (two tokens the model holds equally likely, which
float32 rounding may order either way), reported apart from a real difference.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NEAR_TIE", "Answer", "Verdict", "cases", "compare", "read_answer"]

NEAR_TIE = 1e-3
VIDEO_FRAMES, VIDEO_FPS = 16, 4  # a 4-second clip: 8 frames at 2 fps


@dataclass(slots=True)
class Answer:
    tokens: list[bytes]
    logprobs: list[float]
    gaps: list[float]  # top-1 minus top-2 logprob per step (inf when only one is given)
    prompt_tokens: int
    text: str
    error: str | None = None
    pieces: list[str] = field(default_factory=list)  # each logprob entry's token text
    split: bool = False  # a reasoning parser took part of the text out of `content`


@dataclass(slots=True)
class Verdict:
    same_tokens: bool
    same_prompt: bool
    near_tie: bool = False  # the tokens part at a step whose top-2 gap is under NEAR_TIE
    diverged_at: int | None = None
    max_logprob_diff: float = 0.0  # over the tokens both gave alike
    notes: list[str] = field(default_factory=list)


def _entry_bytes(entry: dict[str, Any]) -> bytes:
    raw = entry.get("bytes")
    return bytes(raw) if raw is not None else str(entry.get("token", "")).encode()


def read_answer(status: int, body: dict[str, Any]) -> Answer:
    """An ``Answer`` from a chat completion response (or its error)."""
    if status != 200:
        message = (body.get("error") or {}).get("message") or str(body)[:200]
        return Answer([], [], [], 0, "", error=f"HTTP {status}: {message}")
    choice = body["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    gaps = []
    for entry in content:
        top = sorted((t["logprob"] for t in entry.get("top_logprobs") or []), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return Answer(
        tokens=[_entry_bytes(e) for e in content],
        logprobs=[float(e["logprob"]) for e in content],
        gaps=gaps,
        prompt_tokens=int(body["usage"]["prompt_tokens"]),
        text=choice["message"].get("content") or "",
        pieces=[str(e.get("token", "")) for e in content],
        split=bool(
            choice["message"].get("reasoning") or choice["message"].get("reasoning_content")
        ),
    )


def _partial(token: bytes) -> bool:
    """A token that is part of a UTF-8 character: servers write its bytes differently (vLLM
    an empty list, others U+FFFD), so only the answer's text tells it apart."""
    return not token or b"\xef\xbf\xbd" in token


def _same(a: bytes, b: bytes) -> bool:
    return a == b or _partial(a) or _partial(b)


def compare(ours: Answer, theirs: Answer) -> Verdict:
    """Same tokens: as many, each with the same bytes (a partial character on either side
    matches), and the same text (which settles the partial ones; where a reasoning parser
    moved part of one side's text out of ``content``, the tokens alone decide; a last
    character cut by ``max_tokens`` is U+FFFD here and left out by vLLM, which is the same)."""
    if ours.error or theirs.error:
        note = f"ours: {ours.error}" if ours.error else f"peer: {theirs.error}"
        return Verdict(False, False, notes=[note])
    pairs = list(zip(ours.tokens, theirs.tokens, strict=False))
    common = next((i for i, (a, b) in enumerate(pairs) if not _same(a, b)), len(pairs))
    # an answer cut inside a character: vLLM drops the partial one, vlmserve keeps U+FFFD
    text = ours.text.rstrip("\ufffd") == theirs.text.rstrip("\ufffd") or ours.split or theirs.split
    same = len(ours.tokens) == len(theirs.tokens) == common and text
    verdict = Verdict(same, ours.prompt_tokens == theirs.prompt_tokens)
    if not same:
        verdict.diverged_at = common
        gaps = [g[common] for g in (ours.gaps, theirs.gaps) if common < len(g)]
        verdict.near_tie = any(g < NEAR_TIE for g in gaps)
    diffs = [
        abs(a - b) for a, b in zip(ours.logprobs[:common], theirs.logprobs[:common], strict=False)
    ]
    verdict.max_logprob_diff = max(diffs, default=0.0)
    return verdict


def _png(width: int, height: int, seed: int) -> str:
    from vlmserve.testing.media import gradient_image

    buf = io.BytesIO()
    gradient_image(width, height, seed=seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _mp4(seed: int) -> str:
    from vlmserve.testing.media import mp4_bytes

    clip = mp4_bytes(frames=VIDEO_FRAMES, width=64, height=48, fps=VIDEO_FPS, seed=seed)
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def _user(parts: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def cases(video: bool) -> dict[str, list[dict[str, Any]]]:
    """Case name -> messages: text, one image, two images, and a video where the family takes
    one (at the family's default frame choice)."""
    image = {"type": "image_url", "image_url": {"url": _png(96, 72, 1)}}
    other = {"type": "image_url", "image_url": {"url": _png(80, 60, 2)}}
    out = {
        "text": [{"role": "user", "content": "Write a short story about a lighthouse."}],
        "image": _user([image], "Describe this picture."),
        "two_images": _user([image, other], "What differs between these pictures?"),
    }
    if video:
        clip = {"type": "video_url", "video_url": {"url": _mp4(3)}}
        out["video"] = _user([clip], "What happens in this clip?")
    return out
