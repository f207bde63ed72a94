"""Task endpoints on top of chat completions: a built-in prompt + JSON schema per task.

Each task becomes one ``ChatCompletionRequest`` (system prompt, media, instruction,
``response_format`` json_schema) answered by ``ChatService.complete``; the answer is parsed
and checked against the schema here, so a server without constrained decoding (or an answer
cut off by ``max_tokens``) gives a clear 422 ``invalid_model_output``, never a 500.
A clip sent as ``frames`` (base64 JPEGs) joins the prompt as one ``input_video`` part with
its frames: decoded by the chat service for a local model, forwarded as is to a proxied one.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from fastapi import UploadFile

from vlmserve.api.auth import ANONYMOUS
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.chat.service import ChatService
from vlmserve.api.endpoints.tasks.protocol import (
    EntitiesRequest,
    ExtractRequest,
    IdCardRequest,
    TaskOptions,
    TriplesRequest,
)
from vlmserve.errors import InvalidRequest, MediaError, PayloadTooLarge, VlmserveError
from vlmserve.tasks import (
    DEFAULT_ENTITY_TYPES,
    MAX_ENTITIES,
    MAX_TRIPLES,
    OutputInvalid,
    TaskPrompt,
    entities_prompt,
    id_card_prompt,
    parse_json,
    schema_errors,
    triples_prompt,
    validate_id_card,
)

__all__ = ["DEFAULT_ROLE", "TaskService", "read_upload"]

DEFAULT_ROLE = "extract"  # ModelManager.for_role falls back to the chat model
_UPLOAD_CHUNK = 1024 * 1024


@dataclass(slots=True)
class Answer:
    data: Any
    completion: dict[str, Any]

    def envelope(self) -> dict[str, Any]:
        return {"model": self.completion["model"], "usage": self.completion["usage"]}


def _media_parts(body: ExtractRequest) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in body.images]
    if body.video:
        parts.append({"type": "video_url", "video_url": {"url": body.video}})
    if body.frames is not None:  # one clip, as its frames (decoded by whoever runs the model)
        parts.append({"type": "input_video", "frames": body.frames})
    return parts


def _media_param(exc: VlmserveError, names: list[str]) -> None:
    """Name a media item as the caller sent it (``images[1]``), not as the chat prompt holds it."""
    prefix = "messages[1].content["
    if exc.param and exc.param.startswith(prefix):
        index = exc.param[len(prefix) :].split("]", 1)[0]
        if index.isdigit() and int(index) < len(names):
            exc.param = names[int(index)]


def _require_input(body: ExtractRequest) -> None:
    if body.video and body.frames is not None:
        raise InvalidRequest("send a clip as `video` or as `frames`, not both", param="frames")
    if not (
        (body.text and body.text.strip()) or body.images or body.video or body.frames is not None
    ):
        raise InvalidRequest(
            "nothing to extract from: send `text`, `images`, `video` or `frames`", param="text"
        )


def _invalid(
    prompt: TaskPrompt, text: str, finish: str, problem: str, max_tokens: int
) -> OutputInvalid:
    if finish == "length":
        hint = f"the answer was cut off at max_tokens={max_tokens}; raise max_tokens"
    else:
        hint = (
            "the model's server may not enforce response_format json_schema "
            "(constrained decoding); check its version"
        )
    shown = text if len(text) <= 200 else text[:200] + "…"
    return OutputInvalid(
        f"the {prompt.name} answer is unusable: {problem}; {hint}. The answer began: {shown!r}"
    )


async def read_upload(file: UploadFile, limit: int, param: str = "file") -> bytes:
    """An uploaded file's bytes, refused (413) past ``limit`` before anything is decoded."""
    too_large = PayloadTooLarge(
        f"the uploaded file is larger than {limit} bytes (VLMSERVE_MAX_MEDIA_BYTES); "
        "send a smaller or more compressed image",
        param=param,
    )
    if file.size is not None and file.size > limit:
        raise too_large
    chunks, size = [], 0
    while chunk := await file.read(_UPLOAD_CHUNK):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    if size == 0:
        raise MediaError("the uploaded file is empty; send the card photo", param=param)
    return b"".join(chunks)


def id_card_body(data: dict[str, Any]) -> dict[str, Any]:
    """The KTP fields at the top level (normalised), then how each one checked out."""
    result = validate_id_card(data)
    return {**result.fields, "validation": result.validation(), "valid": result.valid}


def _shaped(answer: Answer, opts: TaskOptions, key: str) -> dict[str, Any]:
    if opts.json_schema is not None:  # a caller's schema: its answer as a whole
        return {"result": answer.data, **answer.envelope()}
    return {key: answer.data[key], **answer.envelope()}


class TaskService:
    def __init__(self, chat: ChatService):
        self.chat = chat

    def _wire(
        self, prompt: TaskPrompt, opts: TaskOptions, parts: list[dict[str, Any]], text: str | None
    ) -> ChatCompletionRequest:
        said = prompt.instruction if not text else f"Text:\n{text}\n\n{prompt.instruction}"
        context = self.chat.converter.settings.max_model_len
        return ChatCompletionRequest.model_validate(
            {
                "model": opts.model or f"role:{DEFAULT_ROLE}",
                "messages": [
                    {"role": "system", "content": prompt.system},
                    {"role": "user", "content": [*parts, {"type": "text", "text": said}]},
                ],
                "max_tokens": opts.max_tokens or min(prompt.max_tokens, max(1, context // 2)),
                "temperature": opts.temperature,
                "response_format": prompt.response_format(),
            }
        )

    async def _ask(
        self,
        prompt: TaskPrompt,
        wire: ChatCompletionRequest,
        request_id: str,
        owner: str = ANONYMOUS,
    ) -> Answer:
        completion = await self.chat.complete(wire, request_id, owner=owner)
        choice = completion["choices"][0]
        text, finish = choice["message"]["content"] or "", choice.get("finish_reason") or ""
        budget = wire.max_tokens or 0
        try:
            data = parse_json(text)
        except ValueError as exc:
            raise _invalid(prompt, text, finish, str(exc), budget) from None
        errors = schema_errors(data, prompt.schema)
        if errors:
            problem = f"it does not fit the schema ({errors[0]})"
            raise _invalid(prompt, text, finish, problem, budget)
        return Answer(data, completion)

    async def _extract(
        self, prompt: TaskPrompt, body: ExtractRequest, request_id: str, owner: str
    ) -> Answer:
        _require_input(body)
        wire = self._wire(prompt, body, _media_parts(body), body.text)
        try:
            return await self._ask(prompt, wire, request_id, owner)
        except VlmserveError as exc:
            clip = "frames" if body.frames is not None else "video"
            _media_param(exc, [f"images[{i}]" for i in range(len(body.images))] + [clip])
            raise

    async def entities(
        self, body: EntitiesRequest, request_id: str, owner: str = ANONYMOUS
    ) -> dict[str, Any]:
        types = body.entity_types or list(DEFAULT_ENTITY_TYPES)
        prompt = entities_prompt(types, body.json_schema, body.max_items or MAX_ENTITIES)
        return _shaped(await self._extract(prompt, body, request_id, owner), body, "entities")

    async def triples(
        self, body: TriplesRequest, request_id: str, owner: str = ANONYMOUS
    ) -> dict[str, Any]:
        prompt = triples_prompt(body.json_schema, body.max_items or MAX_TRIPLES)
        return _shaped(await self._extract(prompt, body, request_id, owner), body, "triples")

    async def id_card(
        self, body: IdCardRequest, request_id: str, owner: str = ANONYMOUS
    ) -> dict[str, Any]:
        prompt = id_card_prompt(body.json_schema)
        parts = [{"type": "image_url", "image_url": {"url": body.image}}]
        try:
            answer = await self._ask(
                prompt, self._wire(prompt, body, parts, None), request_id, owner
            )
        except VlmserveError as exc:
            _media_param(exc, ["image"])
            raise
        if body.json_schema is not None:
            return {"result": answer.data, **answer.envelope()}
        return {**id_card_body(answer.data), **answer.envelope()}

    async def ktp_upload(
        self, file: UploadFile, request_id: str, owner: str = ANONYMOUS
    ) -> dict[str, Any]:
        """``/ktp-ocr/``: a multipart photo, size-checked before decoding."""
        data = await read_upload(file, self.chat.converter.settings.max_media_bytes)
        body = IdCardRequest(image=base64.b64encode(data).decode())
        try:
            return await self.id_card(body, request_id, owner)
        except (MediaError, PayloadTooLarge) as exc:
            exc.param = "file"
            raise
