"""Request fields that the wire models do not declare: no-ops, refusals, and unknown names.

A field that would change the answer is either served (declared on the wire model) or
refused with a 400 that names it; it is never silently ignored. A field that cannot change
the tokens (``user``, ``metadata``, ...) is accepted and does nothing. Any other name is
unknown: accepted with a log line that names it (vLLM's default), a 400 under
``VLMSERVE_STRICT_FIELDS`` (``--strict-fields``).

A refused field sent with a value that asks for nothing different from what is served (e.g.
``skip_special_tokens: true``, ``add_generation_prompt: true``, ``null``) is accepted: clients
that send every field with its default keep working. A proxied model gets the body as sent,
so there only the upstream decides on these fields (``FieldTable.refusals`` apply to models
served here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmserve.errors import InvalidRequest, UnsupportedFeature, VlmserveError

__all__ = [
    "CHAT_FIELDS",
    "ITEM_FIELDS",
    "MESSAGE_FIELDS",
    "RESPONSES_FIELDS",
    "FieldTable",
    "Refusal",
    "check_messages",
    "unknown_in_messages",
]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A field that would change the answer and is not served; ``inert``: its values that
    ask for exactly what is served anyway."""

    reason: str
    inert: tuple[Any, ...] = (None,)

    def asks_for_something(self, value: Any) -> bool:
        return not any(value == v and type(value) is type(v) for v in self.inert)


_NOT_YET = "is not served yet"
_GUIDED = "is not served; use response_format (json_object or json_schema)"


@dataclass(frozen=True, slots=True)
class FieldTable:
    """One endpoint's undeclared fields: ``no_ops`` (name -> why the tokens do not change)
    and ``refusals``."""

    no_ops: dict[str, str]
    refusals: dict[str, Refusal] = field(default_factory=dict)

    def unknown(self, extra: dict[str, Any]) -> list[str]:
        """The names neither declared, nor no-ops, nor refusals (sorted)."""
        return sorted(k for k in extra if k not in self.no_ops and k not in self.refusals)

    def check(self, extra: dict[str, Any], *, strict: bool, refuse: bool = True) -> list[str]:
        """400 for a refused field that asks for something (``refuse``: the model is served
        here) or, ``strict``, for an unknown one; returns the unknown names (to log)."""
        if refuse:
            for name in sorted(extra):
                refusal = self.refusals.get(name)
                if refusal is not None and refusal.asks_for_something(extra[name]):
                    raise UnsupportedFeature(f"{name} {refusal.reason}", param=name)
        unknown = self.unknown(extra)
        if unknown and strict:
            raise InvalidRequest(
                f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; leave "
                "it out (this server runs with VLMSERVE_STRICT_FIELDS)",
                param=unknown[0],
                code="unknown_field",
            )
        return unknown


_COMMON_NO_OPS = {
    "service_tier": "a billing tier; there is one here",
    "prompt_cache_key": "prefix caching here is automatic (cache_salt keeps tenants apart)",
    "prompt_cache_retention": "prefix caching here is automatic",
    "safety_identifier": "an end-user id for OpenAI's abuse checks",
}

CHAT_FIELDS = FieldTable(
    no_ops={
        **_COMMON_NO_OPS,
        "metadata": "kept by OpenAI for its dashboards; not used here",
        "store": "OpenAI's stored completions; not offered for chat completions",
        "prediction": "predicted outputs only speed OpenAI up; the answer is the model's own",
        "priority": "vLLM's scheduling order; the tokens are the same",
        "request_id": "vLLM's; this server names requests itself (X-Request-ID)",
        "kv_transfer_params": "vLLM's disaggregated prefill; not used here",
    },
    refusals={
        "audio": Refusal("is not served: this server answers in text"),
        "modalities": Refusal('other than ["text"] is not served', (None, ["text"])),
        "functions": Refusal("(deprecated) is not served; send tools"),
        "function_call": Refusal("(deprecated) is not served; send tool_choice"),
        "reasoning_effort": Refusal(
            "is not served; a thinking model's reasoning is switched off with "
            'chat_template_kwargs {"enable_thinking": false}'
        ),
        "verbosity": Refusal("other than medium is not served", (None, "medium")),
        "web_search_options": Refusal("is not served: no web search here"),
        "best_of": Refusal(_NOT_YET, (None, 1)),
        "use_beam_search": Refusal(_NOT_YET, (None, False)),
        "length_penalty": Refusal("applies to beam search, which is not served", (None, 1.0, 1)),
        "min_p": Refusal(_NOT_YET, (None, 0.0, 0)),
        "stop_token_ids": Refusal(_NOT_YET + "; send stop strings", (None, [])),
        "include_stop_str_in_output": Refusal(_NOT_YET, (None, False)),
        "skip_special_tokens": Refusal("false " + _NOT_YET, (None, True)),
        "spaces_between_special_tokens": Refusal("false " + _NOT_YET, (None, True)),
        "truncate_prompt_tokens": Refusal(_NOT_YET),
        "prompt_logprobs": Refusal(_NOT_YET),
        "bad_words": Refusal(_NOT_YET, (None, [])),
        "echo": Refusal(_NOT_YET, (None, False)),
        "add_generation_prompt": Refusal("false " + _NOT_YET, (None, True)),
        "continue_final_message": Refusal(_NOT_YET, (None, False)),
        "add_special_tokens": Refusal(_NOT_YET, (None, False)),
        "documents": Refusal(_NOT_YET),
        "chat_template": Refusal("per request is not served; the server sets --chat-template"),
        "guided_json": Refusal(_GUIDED),
        "guided_regex": Refusal(_NOT_YET),
        "guided_choice": Refusal(_NOT_YET),
        "guided_grammar": Refusal(_NOT_YET),
        "guided_decoding_backend": Refusal(_GUIDED),
        "guided_whitespace_pattern": Refusal(_GUIDED),
        "structural_tag": Refusal(_NOT_YET),
        "structured_outputs": Refusal(_GUIDED),
        "logits_processors": Refusal(_NOT_YET),
        "vllm_xargs": Refusal(_NOT_YET),
        "return_tokens_as_token_ids": Refusal(_NOT_YET, (None, False)),
        "return_token_ids": Refusal(_NOT_YET, (None, False)),
    },
)

RESPONSES_FIELDS = FieldTable(
    no_ops={
        **_COMMON_NO_OPS,
        "stream_options": "its only option (include_obfuscation) pads events; not used here",
    },
    refusals={
        "reasoning": Refusal(
            "is not served; a thinking model's reasoning is switched off by its chat template",
            (None, {}),
        ),
        "parallel_tool_calls": Refusal("needs tools, which are not served here", (None,)),
        "max_tool_calls": Refusal("needs tools, which are not served here"),
        "include": Refusal(_NOT_YET, (None, [])),
        "truncation": Refusal(
            "auto " + _NOT_YET + " (an input too long is a 400)", (None, "disabled")
        ),
        "top_logprobs": Refusal(_NOT_YET, (None, 0)),
        "prompt": Refusal("(a stored prompt template) is not served; send instructions"),
        "conversation": Refusal("is not served; chain responses with previous_response_id"),
        "context_management": Refusal(_NOT_YET),
        "logit_bias": Refusal(_NOT_YET + " on /v1/responses; use /v1/chat/completions"),
        "frequency_penalty": Refusal(_NOT_YET + " on /v1/responses", (None, 0, 0.0)),
        "presence_penalty": Refusal(_NOT_YET + " on /v1/responses", (None, 0, 0.0)),
    },
)

# Fields of a chat message object (the declared ones: role, content, name, tool_calls,
# tool_call_id, reasoning_content, reasoning). Clients that send an earlier answer back as
# the SDK returned it carry these with null or empty values.
MESSAGE_FIELDS = FieldTable(
    no_ops={
        "annotations": "an earlier answer's URL citations; chat templates do not render them",
    },
    refusals={
        "refusal": Refusal(
            "in an earlier answer is not rendered by chat templates; send it as content"
        ),
        "audio": Refusal("(an earlier audio answer) is not served: this server answers in text"),
        "function_call": Refusal("(deprecated) is not served; send tool_calls"),
        "prefix": Refusal("(continue a partial assistant message) " + _NOT_YET, (None, False)),
    },
)


# Fields of a /v1/responses input message item (declared: type, role, content): an earlier
# output item sent back carries its id, status and phase.
ITEM_FIELDS = FieldTable(
    no_ops={
        "id": "an earlier output item's id",
        "status": "an earlier output item's status",
        "phase": "an earlier output item's phase",
    },
)


def check_messages(
    extras: list[dict[str, Any]],
    *,
    strict: bool,
    refuse: bool = True,
    table: FieldTable = MESSAGE_FIELDS,
    where: str = "messages",
) -> None:
    """``table.check`` on each message's undeclared fields; the 400 names the message
    (``messages[i].field``; ``where``: ``input`` for Responses items)."""
    for i, extra in enumerate(extras):
        try:
            table.check(extra, strict=strict, refuse=refuse)
        except VlmserveError as exc:
            exc.param = f"{where}[{i}].{exc.param}"
            raise


def unknown_in_messages(
    extras: list[dict[str, Any]], table: FieldTable = MESSAGE_FIELDS, where: str = "messages"
) -> list[str]:
    """``messages[i].name`` for each unknown message field (to log)."""
    return [f"{where}[{i}].{n}" for i, e in enumerate(extras) for n in table.unknown(e)]
