"""Tag a folder: walk, skip what is tagged, ask for caption/keywords/description, write.

Files are processed by ``concurrency`` workers; requests to the server are bounded by the
client's own semaphore. A file that cannot be read or tagged is recorded as failed (with
the reason) and the run goes on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmserve.tagger.client import TagClient, pick_model
from vlmserve.tagger.files import MediaFile, encode_media, find_media, sha256_of
from vlmserve.tagger.outputs import TagRecord, Writer, make_writer
from vlmserve.tasks.base import json_schema_format
from vlmserve.tasks.captioning import CAPTION_PROMPT, DESCRIPTION_PROMPT, caption_text, media_noun
from vlmserve.tasks.keywords import keywords_prompt, keywords_schema, parse_keywords

__all__ = ["Outcome", "Summary", "TagOptions", "resolve_models", "run_tagging"]

DONE, SKIPPED, FAILED = "done", "skipped", "failed"
DEFAULT_ROLES = {"caption": "caption", "keywords": "keywords", "description": "description"}


@dataclass(slots=True)
class TagOptions:
    root: Path
    server: str
    model: str | None = None
    roles: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLES))
    out: str = "sidecar"
    concurrency: int = 4
    force: bool = False
    api_key: str | None = None
    max_keywords: int = 10
    max_tokens: int | None = None  # None: per task (caption 64, keywords by count, desc 320)
    timeout: float = 300.0

    def budget(self, task: str) -> int:
        if self.max_tokens is not None:
            return self.max_tokens
        return {"caption": 64, "keywords": 16 + 12 * self.max_keywords}.get(task, 320)


@dataclass(slots=True)
class Outcome:
    file: str
    status: str  # done | skipped | failed
    reason: str | None = None


@dataclass(slots=True)
class Summary:
    outcomes: list[Outcome] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)

    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == FAILED]


async def resolve_models(client: TagClient, options: TagOptions) -> dict[str, str]:
    """task -> the ``model`` to send: ``role:<role>`` if the server has it, else ``--model``,
    else the server's first chat model."""
    listed = await client.models()
    return {task: pick_model(listed, role, options.model) for task, role in options.roles.items()}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


async def _tag_one(
    client: TagClient, options: TagOptions, models: dict[str, str], media: MediaFile, data: bytes
) -> TagRecord:
    part = await asyncio.to_thread(encode_media, media, data)
    noun = media_noun(media.kind)

    def ask(task: str, prompt: str, fmt: dict[str, Any] | None = None) -> Any:
        content = [part, {"type": "text", "text": prompt}]
        return client.chat(models[task], content, options.budget(task), fmt)

    kw_format = json_schema_format("keywords", keywords_schema(options.max_keywords))
    caption, keywords, description = await asyncio.gather(
        ask("caption", CAPTION_PROMPT.format(noun=noun)),
        ask("keywords", keywords_prompt(noun, options.max_keywords), kw_format),
        ask("description", DESCRIPTION_PROMPT.format(noun=noun)),
    )
    words = parse_keywords(
        keywords.text, options.max_keywords, truncated=keywords.finish_reason == "length"
    )
    answered = {
        "caption": caption.model,
        "keywords": keywords.model,
        "description": description.model,
    }
    return TagRecord(
        file=media.rel,
        sha256=sha256_of(data),
        caption=caption_text(caption.text),
        keywords=words,
        description=description.text.strip(),
        model=caption.model,
        tagged_at=_now(),
        models=answered,
    )


async def _process(
    client: TagClient,
    options: TagOptions,
    models: dict[str, str],
    writer: Writer,
    media: MediaFile,
) -> Outcome:
    try:
        data = await asyncio.to_thread(media.path.read_bytes)
        if not options.force and writer.done(media.rel, sha256_of(data)):
            return Outcome(media.rel, SKIPPED)
        record = await _tag_one(client, options, models, media, data)
        writer.write(record)
    except Exception as exc:  # one bad file never stops the run; the summary says why
        return Outcome(media.rel, FAILED, str(exc) or type(exc).__name__)
    return Outcome(media.rel, DONE)


async def run_tagging(
    options: TagOptions,
    client: TagClient,
    models: dict[str, str],
    on_outcome: Callable[[Outcome], None] | None = None,
    files: list[MediaFile] | None = None,
) -> Summary:
    """Tag every media file under ``options.root`` (or ``files``); never raises per file."""
    files = find_media(options.root) if files is None else files
    writer = make_writer(options.out, options.root)
    summary = Summary(models=models)
    queue: asyncio.Queue[MediaFile] = asyncio.Queue()
    for media in files:
        queue.put_nowait(media)

    async def worker() -> None:
        while not queue.empty():
            outcome = await _process(client, options, models, writer, queue.get_nowait())
            summary.outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, options.concurrency))))
    finally:
        writer.finish()
    summary.outcomes.sort(key=lambda o: o.file)
    return summary
