"""A Responses request -> the ChatCompletionRequest that ChatService's pipeline runs.

The conversation of a response is kept as chat messages (wire dicts, JSON-serialisable): the
``previous_response_id`` chain prepends the earlier turn's conversation and its answer, and
``instructions`` (never carried over to the next turn, as in OpenAI's API) come first.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from vlmserve.api.common.fields import ITEM_FIELDS, RESPONSES_FIELDS, check_messages
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.responses.protocol import (
    InputFilePart,
    InputImagePart,
    InputItem,
    InputTextPart,
    OutputTextPart,
    RefusalPart,
    ResponsesRequest,
)
from vlmserve.errors import InvalidRequest, UnsupportedFeature, VlmserveError

__all__ = [
    "assistant_message",
    "check_supported",
    "input_messages",
    "remap",
    "to_chat_request",
    "wire_param",
]

# Parameter names of the chat request -> the Responses request's, for error messages.
_PARAMS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("messages", "input"),
)


def wire_param(param: str | None) -> str | None:
    """A chat-request parameter named in an error, as the Responses client knows it."""
    for chat, responses in _PARAMS:
        if param is not None and param.startswith(chat):  # messages[i]: turns shift indices
            return responses if chat == "messages" else responses + param[len(chat) :]
    return param


def check_supported(body: ResponsesRequest, *, strict: bool = False) -> None:
    """Refuse what would change the answer and is not offered (never silently ignored);
    ``strict``: an unknown field too."""
    RESPONSES_FIELDS.check(body.model_extra or {}, strict=strict)
    check_messages(body.item_extras, strict=strict, table=ITEM_FIELDS, where="input")
    if body.tools:
        raise UnsupportedFeature("tools are not supported by /v1/responses here", param="tools")
    choice = body.tool_choice
    if choice is not None and choice not in ("none", "auto"):
        raise UnsupportedFeature(
            "tool_choice needs tools, which are not supported", param="tool_choice"
        )
    if body.background and not body.store:
        raise InvalidRequest(
            "background responses must be stored; leave store at true", param="store"
        )


def _part(where: str, part: BaseModel) -> dict[str, Any]:
    if isinstance(part, InputTextPart | OutputTextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, RefusalPart):
        return {"type": "text", "text": part.refusal}
    if isinstance(part, InputImagePart):
        ref = {"uuid": part.uuid} if part.uuid else {}
        if part.image_url:
            url = {"url": part.image_url, "detail": part.detail}
            return {"type": "image_url", "image_url": url, **ref}
        if part.uuid:  # by reference: the data was sent before
            return {"type": "image_url", "image_url": None, **ref}
        message = (
            "input_image needs image_url (a URL or a data URL) or file_id (a file "
            "uploaded to /v1/files with purpose 'vision' or 'user_data')"
        )
        raise InvalidRequest(message, param=where)
    if isinstance(part, InputFilePart):
        raise UnsupportedFeature(
            "input_file parts are not supported; send text, input_image or input_video parts",
            param=where,
        )
    return part.model_dump(mode="json", exclude_none=True)  # input_video, video_url: chat's own


def _message(index: int, item: InputItem) -> dict[str, Any]:
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    parts = [_part(f"input[{index}].content[{j}]", p) for j, p in enumerate(item.content)]
    return {"role": item.role, "content": parts}


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input as chat messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return [_message(i, item) for i, item in enumerate(body.input)]


def assistant_message(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise InvalidRequest(
            "text.format.schema is required for type 'json_schema'", param="text.format.schema"
        )
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    if fmt.description:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def _first_problem(exc: ValidationError) -> tuple[str, str]:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error.get("loc", ()))
    return str(error.get("msg", "invalid value")).removeprefix("Value error, "), where


def to_chat_request(
    body: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request for ``conversation`` (earlier turns + this input), instructions first."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [*system, *conversation],
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stop": body.stop,
        "repetition_penalty": body.repetition_penalty,
        "ignore_eos": body.ignore_eos,
        "min_tokens": body.min_tokens,
        "response_format": _response_format(body),
        "user": body.user,
        "cache_salt": body.cache_salt,
        "include_metrics": body.include_metrics,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as exc:
        message, where = _first_problem(exc)
        raise InvalidRequest(f"{wire_param(where)}: {message}", param=wire_param(where)) from None


def remap(exc: VlmserveError) -> VlmserveError:
    """Rename the chat parameter an error names to the Responses one (in place)."""
    exc.param = wire_param(exc.param)
    return exc
