"""Media by reference through the gateway: a ``uuid`` goes back to the replica that saw it.

A worker keeps media sent with a ``uuid`` for the key that sent it; a later request that sends
the ``uuid`` alone must reach that worker. The gateway remembers, per model, which replica took
each ``uuid`` sent with its data, and prefers that replica for a request that references one
(any usable replica when it is gone: the worker's 400 then says to send the data again). The
``uuid``s reaching the workers are scoped to the client's key beforehand (``scoped_uuids``),
since the workers see one key, the gateway's. At most ``max_entries`` are remembered, the
least recently used forgotten first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

__all__ = ["MediaRoutes", "has_uuids", "scoped_uuids"]

_NOT_DATA = ("type", "uuid", "detail")


def _media_parts(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and isinstance(part.get("uuid"), str):
                yield part


def _has_data(part: dict[str, Any]) -> bool:
    return any(v not in (None, "", {}, []) for k, v in part.items() if k not in _NOT_DATA)


def has_uuids(body: dict[str, Any]) -> bool:
    return next(_media_parts(body), None) is not None


def scoped_uuids(body: dict[str, Any], owner: str) -> dict[str, Any]:
    """``body`` with each media part's ``uuid`` replaced by one of ``owner``'s own (in place)."""
    for part in _media_parts(body):
        digest = hashlib.sha256(f"{owner}\0{part['uuid']}".encode()).hexdigest()[:32]
        part["uuid"] = f"k{digest}"
    return body


class MediaRoutes:
    """uuid -> the replica URL that received its data."""

    def __init__(self, max_entries: int = 65536):
        self.max_entries = max_entries
        self._where: OrderedDict[str, str] = OrderedDict()

    def replica_for(self, body: dict[str, Any]) -> str | None:
        """The replica that holds a ``uuid`` this request sends without its data."""
        for part in _media_parts(body):
            url = self._where.get(part["uuid"]) if not _has_data(part) else None
            if url is not None:
                self._where.move_to_end(part["uuid"])
                return url
        return None

    def remember(self, body: dict[str, Any], url: str) -> None:
        """The ``uuid``s this request sent with their data are now at ``url``."""
        for part in _media_parts(body):
            if _has_data(part):
                self._where[part["uuid"]] = url
                self._where.move_to_end(part["uuid"])
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)
