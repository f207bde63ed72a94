"""A small SSE reader for tests: parse events as they arrive, stop after any number of them.

``read_events`` asks for the resumable wire (``Accept: text/event-stream``, as EventSource
does), so events carry their ``id:``; pass ``resumable=False`` for the default OpenAI wire.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

# What a browser's EventSource sends: the server answers with `id:` (and `event:`) lines.
RESUMABLE = {"Accept": "text/event-stream"}


@dataclass
class SSEEvent:
    id: str | None
    event: str | None
    data: str

    @property
    def index(self) -> int:
        assert self.id is not None
        return int(self.id.rsplit(":", 1)[1])

    @property
    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def content(self) -> str:
        if self.data == "[DONE]" or self.event == "error":
            return ""
        choices = self.json.get("choices") or [{}]
        return choices[0].get("delta", {}).get("content") or ""

    @property
    def finish_reason(self) -> str | None:
        if self.data == "[DONE]" or self.event == "error":
            return None
        choices = self.json.get("choices") or [{}]
        return choices[0].get("finish_reason")


def iter_events(response: httpx.Response) -> Iterator[SSEEvent]:
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                yield SSEEvent(fields.get("id"), fields.get("event"), "\n".join(data))
            fields, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        else:
            fields[name] = value


def read_events(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    limit: int | None = None,
    resumable: bool = True,
    **kwargs: Any,
) -> tuple[list[SSEEvent], httpx.Response]:
    """Read events (all, or the first ``limit`` then disconnect)."""
    if resumable:
        kwargs["headers"] = {**RESUMABLE, **(kwargs.get("headers") or {})}
    events: list[SSEEvent] = []
    with client.stream(method, url, **kwargs) as response:
        if response.status_code != 200:
            response.read()
            return events, response
        for event in iter_events(response):
            events.append(event)
            if limit is not None and len(events) >= limit:
                break
    return events, response


def text_of(events: list[SSEEvent]) -> str:
    return "".join(e.content for e in events)


def texts_by_choice(events: list[SSEEvent]) -> dict[int, tuple[str, str | None]]:
    """Each choice's text and finish reason (a stream of ``n`` > 1 choices)."""
    out: dict[int, tuple[str, str | None]] = {}
    for event in events:
        if event.data == "[DONE]" or event.event == "error":
            continue
        for choice in event.json.get("choices") or []:
            text, reason = out.get(choice["index"], ("", None))
            content = (choice.get("delta") or {}).get("content") or ""
            out[choice["index"]] = (text + content, choice.get("finish_reason") or reason)
    return out


def without_token(data: str) -> str:
    """An event's data without the ``resume_token`` that the first event of the answer which
    started a stream carries (replays are the stored events, which never hold it)."""
    head = '{"resume_token":"'
    if not data.startswith(head):
        return data
    end = data.index('"', len(head))
    return "{" + data[end + 1 :].lstrip(",")
