"""OpenAI ``response_format`` enforced token by token with xgrammar.

    GrammarCompiler(tokenizer, vocab_size=V)   one per loaded model (holds the token table)
      .compile(response_format) -> CompiledGrammar      cached by the schema's JSON text (LRU)
        .matcher(prefix) -> GrammarMatcher               one per sequence, replays a resumed prefix
          .fill_mask(masks, row) / .accept(token) / .is_terminated()
    allocate_masks(B, V) -> masks;  apply_masks(logits, masks, rows)

Shapes. V is the model's ``config.vocab_size``: the width of the lm_head logits, which may
exceed ``len(tokenizer)`` (Qwen2-VL-2B: 151936 logits for 151657 tokens; ids past the
tokenizer are never allowed) — the tiny test model has 1038 for 1038.
``masks``: int32 [B, ceil(V / 32)] on CPU, one bit per token id, 1 = allowed.
``logits``: float32/bf16/fp16 [B, V] on any device; masked ids become -inf in place.

The output is compact JSON (no free whitespace; xgrammar's generic objects/arrays use ", "
between items) so a random-weight model cannot loop on spaces. ``json_object`` is the schema
``{"type": "object"}``: a JSON object, never a bare value. Control tokens of the tokenizer
(``<|im_start|>``, ``<|endoftext|>``, ...) are never allowed inside the JSON: xgrammar would
otherwise read them as literal text, and an end-of-sequence id mid-string ends the output.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from vlmserve.engine.hf.schema_check import check_schema
from vlmserve.errors import InvalidRequest, UnsupportedFeature

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "allocate_masks",
    "apply_masks",
]

_PARAM = "response_format"
_CACHE_SIZE = 64  # compiled grammars kept per model (each holds a token-mask cache)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[14:41:10] /project/cpp/x.cc:4944: "


class GrammarMatcher:
    """The grammar state of one sequence."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher):
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance by one generated token; RuntimeError if the mask did not allow it."""
        if not self._matcher.accept_token(int(token_id)):
            raise RuntimeError(f"token {token_id} is not allowed by the response_format grammar")

    def is_terminated(self) -> bool:
        """The JSON value is complete and the stop token was accepted: nothing more may follow."""
        return self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [B, ceil(V/32)], CPU)."""
        if self._matcher.is_terminated():
            raise RuntimeError("the grammar is terminated: the sequence must stop, not sample")
        self._matcher.fill_next_token_bitmask(bitmask, row)


class CompiledGrammar:
    """A compiled response format; immutable and shared by every request that uses it."""

    __slots__ = ("_compiled",)

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._compiled = compiled

    def matcher(self, prefix: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher that has accepted ``prefix`` (tokens generated before a resume)."""
        matcher = GrammarMatcher(xgr.GrammarMatcher(self._compiled))
        for i, token_id in enumerate(prefix):
            if not matcher._matcher.accept_token(int(token_id)):
                raise InvalidRequest(
                    f"the resumed tokens do not follow the response_format grammar (token "
                    f"{i} of {len(prefix)}, id {token_id}); resume with the same response_format",
                    param=_PARAM,
                )
        return matcher


class GrammarCompiler:
    """Compiles response formats against one model's vocabulary (thread-safe)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        threads = max(1, min(8, os.cpu_count() or 1))
        self._compiler = xgr.GrammarCompiler(
            _tokenizer_info(tokenizer, vocab_size), max_threads=threads, cache_enabled=False
        )
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, response_format: dict[str, Any]) -> CompiledGrammar:
        """The grammar of ``response_format``; 400 when it is malformed or not enforceable."""
        schema = _requested_schema(response_format)
        # Not sort_keys: xgrammar writes properties in the schema's order, so order is part of it.
        key = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = CompiledGrammar(self._compile(check_schema(schema)))
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, schema: Any) -> xgr.CompiledGrammar:
        try:
            grammar = xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
            )
            return self._compiler.compile_grammar(xgr.Grammar.from_ebnf(_valid_chars(str(grammar))))
        except (RuntimeError, ValueError) as exc:
            detail = _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc) else "")
            if "support" in detail.lower():
                raise UnsupportedFeature(
                    f"response_format: the JSON schema uses a feature that cannot be enforced: "
                    f"{detail}",
                    param=_PARAM,
                ) from None
            raise InvalidRequest(
                f"response_format: invalid JSON schema: {detail}", param=_PARAM
            ) from None


# xgrammar's string-character classes, as it prints them in EBNF: the one of min/maxLength
# strings lets in raw control characters (invalid JSON), both let in UTF-8-encoded surrogates
# (ED A0..BF xx: invalid UTF-8, decoded as U+FFFD x3, which breaks lengths). Replaced by a class
# of characters valid inside a JSON string.
_LOOSE_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\ud800-\\udfff]'


def _valid_chars(ebnf: str) -> str:
    for loose in _LOOSE_CHARS:
        ebnf = ebnf.replace(loose, _JSON_CHARS)
    return ebnf


def allocate_masks(batch: int, vocab_size: int) -> torch.Tensor:
    """int32 [batch, ceil(vocab_size / 32)] on CPU, every token allowed."""
    return xgr.allocate_token_bitmask(batch, vocab_size)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set disallowed logits to -inf in place: logits [B, V] (any device), masks [B, ceil(V/32)].

    ``rows``: the batch rows that have a grammar (others are left alone); None = all rows.
    """
    if rows is not None and not rows:
        return
    if masks.device != logits.device:
        masks = masks.to(logits.device, non_blocking=True)
    try:
        xgr.apply_token_bitmask_inplace(logits, masks, indices=rows)
    except ImportError:  # CUDA without triton: the plain torch kernel
        xgr.apply_token_bitmask_inplace(logits, masks, indices=rows, backend="torch_native")


def _requested_schema(response_format: Any) -> Any:
    """The JSON schema a response_format asks for (``json_object``: any object)."""
    if not isinstance(response_format, dict):
        raise InvalidRequest("response_format must be an object", param=_PARAM)
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise InvalidRequest(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param=_PARAM,
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "response_format.json_schema is required for type 'json_schema': "
            '{"name": "...", "schema": {...}, "strict": true}',
            param=_PARAM,
        )
    if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", True), bool):
        raise InvalidRequest(
            "response_format.json_schema.name must be a string and .strict a boolean",
            param=_PARAM,
        )
    if "schema" not in spec:
        raise InvalidRequest(
            "response_format.json_schema.schema is missing: put the JSON schema of the answer "
            "there",
            param=_PARAM,
        )
    if not isinstance(spec["schema"], dict):
        raise InvalidRequest(
            "response_format.json_schema.schema must be a JSON object (a JSON schema), got "
            f"{type(spec['schema']).__name__}",
            param=_PARAM,
        )
    return spec["schema"]


def _tokenizer_info(tokenizer: Any, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's token table, control tokens and control-byte tokens blanked (never allowed).

    ``from_huggingface`` keeps ``<|endoftext|>`` & co. as literal text, so the grammar would let
    them into JSON strings; an empty entry is what xgrammar treats as a special token.
    """
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    # Tokens holding a raw control byte: compact JSON never contains one (inside strings they
    # are invalid JSON, and xgrammar's min/maxLength rule would let them in).
    decoded = base.decoded_vocab
    special |= {i for i, raw in enumerate(decoded) if any(b < 0x20 for b in raw)}
    vocab = [""] * vocab_size  # [V]: ids past the tokenizer stay empty (never allowed)
    for text, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            vocab[token_id] = text
    return xgr.TokenizerInfo(
        vocab,
        base.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=base.stop_token_ids,
        add_prefix_space=base.add_prefix_space,
    )
