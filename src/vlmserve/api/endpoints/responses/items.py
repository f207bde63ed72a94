"""``GET /v1/responses/{id}/input_items``: a stored response's input, as OpenAI's item list.

The input is not stored twice: it is read back from the chat messages the response ran
(``record.request["body"]["messages"]`` from ``turns_from`` on: this turn's input, without the
earlier turns of ``previous_response_id`` nor ``instructions``, as OpenAI lists them). An image
that came from an uploaded file is listed by its ``file_id`` again (``input_files``), not as
the data URL it was read into. Item ids are derived from the response id and the position, so
they are stable for ``after`` paging.
"""

from __future__ import annotations

from typing import Any

from vlmserve.errors import InvalidRequest

__all__ = ["input_items", "list_page"]


def _url(value: Any) -> str:
    return value if isinstance(value, str) else str((value or {}).get("url", ""))


def _part(role: str, part: dict[str, Any], file_id: str | None) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "text":
        if role == "assistant":
            return {"type": "output_text", "text": part.get("text", ""), "annotations": []}
        return {"type": "input_text", "text": part.get("text", "")}
    if kind == "image_url":
        if file_id is not None:
            return {"type": "input_image", "detail": "auto", "file_id": file_id, "image_url": None}
        return {
            "type": "input_image",
            "detail": "auto",
            "file_id": None,
            "image_url": _url(part.get("image_url")),
        }
    return {k: v for k, v in part.items() if v is not None}  # input_video, video_url: ours


def _content(role: str, content: Any, files: dict[int, str]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [_part(role, {"type": "text", "text": content}, None)]
    return [_part(role, p, files.get(j)) for j, p in enumerate(content or [])]


def input_items(response_id: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    """This turn's input items, oldest first."""
    messages = request["body"]["messages"][request["turns_from"] :]
    files: dict[tuple[int, int], str] = {(i, j): f for i, j, f in request.get("input_files", [])}
    stem = response_id.removeprefix("resp_")
    items = []
    for i, message in enumerate(messages):
        role = message.get("role", "user")
        mine = {j: f for (m, j), f in files.items() if m == i}
        items.append(
            {
                "id": f"msg_{stem}_{i}",
                "type": "message",
                "role": role,
                "status": "completed",
                "content": _content(role, message.get("content"), mine),
            }
        )
    return items


def list_page(
    items: list[dict[str, Any]], after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """OpenAI's cursor page over ``items`` (oldest first): ``order`` ``desc`` (OpenAI's
    default) lists the newest first; ``after`` is the id of the last item already seen."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequest(
                f"after={after!r} is not an input item of this response",
                param="after",
                code="invalid_cursor",
            )
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "has_more": len(ordered) > limit,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
