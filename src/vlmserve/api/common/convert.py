"""Wire request -> engine request, in one place: limits first, then media fetch and decode."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from vlmserve.api.auth import ANONYMOUS
from vlmserve.api.common.fields import CHAT_FIELDS, check_messages
from vlmserve.api.common.guards import guard_params
from vlmserve.api.common.media_reader import (
    EMPTY_FRAMES,
    MediaRead,
    MediaReader,
    controls,
    media_policy,
    sample_frames,
)
from vlmserve.api.endpoints.chat.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    ImageUrlPart,
    InputImagePart,
    InputVideoPart,
    TextContentPart,
    VideoUrlPart,
)
from vlmserve.config import Settings
from vlmserve.engine.parsers import tool_call_response_format
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    OutputOptions,
    Part,
    SamplingParams,
    TextPart,
)
from vlmserve.errors import InvalidRequest, RequestTimeout, VlmserveError
from vlmserve.media.sampling import UNIFORM, VideoSampling

__all__ = ["Converter", "media_policy", "response_format", "sample_frames"]


T = TypeVar("T")
DEFAULT_MAX_N = 8  # choices per request when the settings do not say (VLMSERVE_MAX_N)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


def _unsupported(body: ChatCompletionRequest, max_n: int) -> None:
    """Sampling options outside what is served: n over the limit, top_logprobs over 20 or
    without logprobs."""
    if body.n > max_n:
        raise InvalidRequest(
            f"n={body.n} is over the limit of {max_n} choices per request (VLMSERVE_MAX_N)",
            param="n",
        )
    top = body.top_logprobs
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs={top} is over the limit of {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    if top and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")


def response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The grammar the answer must follow: ``response_format``, or the tool-call schema of
    ``tool_choice`` required / a named function; None for free text."""
    forced = _forced_tools(body)
    rf = body.response_format
    if forced is not None:
        if rf is not None and rf.type != "text":
            raise InvalidRequest(
                "response_format cannot be combined with tool_choice "
                f"{body.tool_choice!r}; the answer is the tool call",
                param="response_format",
            )
        return forced
    if rf is None or rf.type == "text":
        return None
    return rf.model_dump(mode="json", exclude_none=True)


def _forced_tools(body: ChatCompletionRequest) -> dict[str, Any] | None:
    if body.tool_choice is not None and not body.tools:
        raise InvalidRequest(
            "tool_choice needs tools; send the function definitions in `tools`", param="tool_choice"
        )
    if not body.tools or body.tool_choice in (None, "auto", "none"):
        return None
    parallel = body.parallel_tool_calls is not False
    return tool_call_response_format(body.tools, body.tool_choice, parallel=parallel)


def output_options(body: ChatCompletionRequest) -> OutputOptions:
    forced = body.tools is not None and body.tool_choice not in (None, "auto", "none")
    return OutputOptions(
        chat_template_kwargs=dict(body.chat_template_kwargs or {}),
        tools=body.tools,
        tool_choice=body.tool_choice or ("auto" if body.tools else None),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        include_reasoning=body.include_reasoning,
        enforced_tool_calls=forced,
    )


def _media_count(messages: list[ChatMessageIn]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.content, list)
        for p in m.content
        if not isinstance(p, TextContentPart)
    )


def _text_chars(messages: list[ChatMessageIn]) -> int:
    chars = 0
    for m in messages:
        if isinstance(m.content, str):
            chars += len(m.content)
        elif m.content is not None:
            chars += sum(len(p.text) for p in m.content if isinstance(p, TextContentPart))
    return chars


def _check_text_fits(messages: list[ChatMessageIn], settings: Settings) -> None:
    """Refuse, before tokenising, text that no tokenizer could fit in the context: more
    characters than ``max_model_len`` tokens of ``max_chars_per_token`` each."""
    chars, ratio = _text_chars(messages), getattr(settings, "max_chars_per_token", 64.0)
    limit = settings.max_model_len * ratio
    if chars > limit:
        raise InvalidRequest(
            f"the messages hold {chars} characters of text; the context limit of "
            f"{settings.max_model_len} tokens (VLMSERVE_MAX_MODEL_LEN) holds at most "
            f"{int(limit)} at {ratio:g} characters a token (VLMSERVE_MAX_CHARS_PER_TOKEN); "
            "shorten the input",
            param="messages",
            code="context_length_exceeded",
        )


def _check_frames(messages: list[ChatMessageIn]) -> None:
    for i, m in enumerate(messages):
        for j, p in enumerate(m.content if isinstance(m.content, list) else []):
            if isinstance(p, InputVideoPart) and p.frames is not None and not p.frames:
                raise InvalidRequest(EMPTY_FRAMES, param=f"messages[{i}].content[{j}]")


@dataclass(slots=True)
class Converter(MediaReader):
    """Wire chat request -> engine request (media read by ``MediaReader``)."""

    def check(self, body: ChatCompletionRequest) -> None:
        """Every check that needs no I/O; runs before any media is fetched (the fields
        refused for a model served here: ``to_request``)."""
        strict = getattr(self.settings, "strict_fields", False)
        CHAT_FIELDS.check(body.model_extra or {}, strict=strict, refuse=False)
        check_messages([m.model_extra or {} for m in body.messages], strict=strict, refuse=False)
        _unsupported(body, getattr(self.settings, "max_n", DEFAULT_MAX_N))
        _check_frames(body.messages)
        count = _media_count(body.messages)
        if count > self.settings.max_media_per_request:
            raise InvalidRequest(
                f"{count} media items in one request; the limit is "
                f"{self.settings.max_media_per_request} (VLMSERVE_MAX_MEDIA_PER_REQUEST)",
                param="messages",
                code="too_many_media_items",
            )
        _check_text_fits(body.messages, self.settings)
        limit = self.settings.max_model_len
        if self.max_tokens(body) >= limit:
            raise InvalidRequest(
                f"max_tokens={self.max_tokens(body)} is not below the context limit of {limit} "
                "tokens (VLMSERVE_MAX_MODEL_LEN)",
                param="max_tokens",
            )

    def needs(self, body: ChatCompletionRequest) -> frozenset[str]:
        """Capabilities the request needs from its model (checked before any work)."""
        self.check(body)
        kinds: set[str] = set()
        for m in body.messages:
            for p in m.content if isinstance(m.content, list) else []:
                if isinstance(p, ImageUrlPart | InputImagePart):
                    kinds.add("vision")
                elif isinstance(p, VideoUrlPart | InputVideoPart):
                    kinds.add("video")
        return frozenset(kinds)

    def max_tokens(self, body: ChatCompletionRequest) -> int:
        return body.max_completion_tokens or body.max_tokens or self.settings.max_tokens

    def sampling(self, body: ChatCompletionRequest) -> SamplingParams:
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        return SamplingParams(
            max_tokens=self.max_tokens(body),
            temperature=self.settings.temperature if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            stop=list(body.stop or []),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=body.logprobs,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
            n=body.n,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
            **guard_params(body),
        )

    async def to_request(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        *,
        sampling: VideoSampling | None = None,
        owner: str = ANONYMOUS,
    ) -> GenerateRequest:
        """``sampling``: the model's frame rule (``Backend.video_sampling``); ``owner``: the
        API key's digest, whose media uuids the request may use."""
        self.check(body)
        CHAT_FIELDS.check(body.model_extra or {}, strict=False)  # a 400 for what is not served
        check_messages([m.model_extra or {} for m in body.messages], strict=False)
        media = MediaRead(controls(body, self.settings), sampling or UNIFORM, owner)
        messages = await self._within_media_timeout(
            asyncio.gather(*(self._message(i, m, media) for i, m in enumerate(body.messages)))
        )
        return GenerateRequest(
            request_id=request_id,
            messages=list(messages),
            sampling=self.sampling(body),
            response_format=response_format(body),
            output=output_options(body),
            cache_salt=body.cache_salt,
            media=media.controls.options,
        )

    async def _within_media_timeout(self, work: Awaitable[T]) -> T:
        """408 when reading and decoding a request's media take over ``media_timeout``."""
        limit = getattr(self.settings, "media_timeout", None)
        try:
            return await asyncio.wait_for(work, limit)
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"reading and decoding the request's media took over {limit:g} s "
                "(VLMSERVE_MEDIA_TIMEOUT); send smaller or fewer media items",
                param="messages",
            ) from None

    async def _message(self, index: int, message: ChatMessageIn, media: MediaRead) -> ChatMessage:
        role = "system" if message.role == "developer" else message.role
        calls = [c.model_dump(mode="json") for c in message.tool_calls or []] or None
        out = ChatMessage(
            role=role,
            content=[],
            tool_calls=calls,
            tool_call_id=message.tool_call_id,
            reasoning=message.earlier_reasoning,
        )
        if isinstance(message.content, str):
            out.content = [TextPart(message.content)]
        elif message.content is not None:
            parts = await asyncio.gather(
                *(
                    self._part(f"messages[{index}].content[{j}]", p, media)
                    for j, p in enumerate(message.content)
                )
            )
            out.content = list(parts)
        return out

    async def _part(self, where: str, part: object, media: MediaRead) -> Part:
        try:
            if isinstance(part, TextContentPart):
                return TextPart(part.text)
            if isinstance(part, ImageUrlPart | InputImagePart | VideoUrlPart | InputVideoPart):
                return await self._media_part(where, part, media)
            raise InvalidRequest(f"unsupported content part {type(part).__name__}", param=where)
        except ValueError as exc:  # a part missing its payload (e.g. input_image without data)
            raise InvalidRequest(str(exc), param=where) from exc
        except VlmserveError as exc:
            exc.param = exc.param or where
            raise
