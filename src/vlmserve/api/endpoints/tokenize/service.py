"""``/tokenize`` and ``/detokenize`` (vLLM's shapes): a prompt as the model reads it.

A chat's ``messages`` go through the same conversion (media fetched and decoded under the same
limits), chat template and processor as a chat completion, so ``count`` equals the
``usage.prompt_tokens`` that request gets and a client can check context fit and cost first.
A proxied model answers upstream.
"""

from __future__ import annotations

import uuid
from typing import Any

from vlmserve.api.common.convert import Converter
from vlmserve.api.common.fields import CHAT_FIELDS
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from vlmserve.engine.protocol import as_proxied
from vlmserve.engine.types import GenerateRequest, Serves
from vlmserve.errors import UnsupportedFeature
from vlmserve.registry.manager import ModelManager

__all__ = ["detokenize", "tokenize"]


def _refuse(body: TokenizeRequest, strict: bool) -> None:
    """What would give other tokens than the chat completion gets: a 400 naming it."""
    if not body.add_generation_prompt:
        raise UnsupportedFeature(
            "add_generation_prompt false is not served yet", param="add_generation_prompt"
        )
    if body.continue_final_message:
        raise UnsupportedFeature(
            "continue_final_message is not served yet", param="continue_final_message"
        )
    if body.messages is not None and body.add_special_tokens:
        raise UnsupportedFeature(
            "add_special_tokens with messages is not served yet (the chat template adds its own)",
            param="add_special_tokens",
        )
    if body.return_token_strs:
        raise UnsupportedFeature("return_token_strs is not served yet", param="return_token_strs")
    CHAT_FIELDS.check(body.model_extra or {}, strict=strict)


async def _chat_request(
    converter: Converter, body: TokenizeRequest, model: str, sampling: Any = None
) -> GenerateRequest:
    chat = ChatCompletionRequest(
        model=model,
        messages=body.messages or [],
        tools=body.tools,
        chat_template_kwargs=body.chat_template_kwargs,
        mm_processor_kwargs=body.mm_processor_kwargs,
        media_io_kwargs=body.media_io_kwargs,
        max_tokens=1,  # no answer: the default must not count against the context limit
    )
    return await converter.to_request(chat, uuid.uuid4().hex, sampling=sampling)


async def tokenize(
    models: ModelManager, converter: Converter, body: TokenizeRequest, *, strict: bool = False
) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}``."""
    async with await models.acquire(body.model, "chat", Serves.CHAT) as backend:
        if (proxied := as_proxied(backend)) is not None:
            answer = await proxied.relay(
                "/tokenize", body.model_dump(mode="json", exclude_unset=True)
            )
            if answer is not None:
                return answer
        _refuse(body, strict)
        if body.prompt is not None:
            special = body.add_special_tokens is not False
            tokenized = await backend.tokenize(body.prompt, add_special_tokens=special)
        else:
            request = await _chat_request(
                converter, body, backend.model_id, backend.video_sampling()
            )
            tokenized = await backend.tokenize(request)
    return {
        "count": len(tokenized.ids),
        "max_model_len": tokenized.max_model_len,
        "tokens": tokenized.ids,
        "token_strs": None,
    }


async def detokenize(models: ModelManager, body: DetokenizeRequest) -> dict[str, Any]:
    """``{"prompt": text}``."""
    async with await models.acquire(body.model, "chat", Serves.CHAT) as backend:
        if (proxied := as_proxied(backend)) is not None:
            wire = body.model_dump(mode="json", exclude_unset=True)
            answer = await proxied.relay("/detokenize", wire)
            if answer is not None:
                return answer
        return {"prompt": await backend.detokenize(body.tokens)}
