"""Rerank and score: limits first, then the model (by name, else the ``rerank`` role, else the
``embedding`` role), then the media, then ``Backend.score``; a proxied model (a gateway's
``openai``/``vllm`` entry with the ``rerank`` role) answers the same endpoint upstream.

Every check that reads nothing comes before any media is fetched: the number of documents
(``VLMSERVE_RERANK_MAX_DOCUMENTS``), empty lists, the model's kind and the modalities it
takes. Media documents go through the same fetch policy and limits as chat (bytes per item,
pixels per image, frames per video); an uploaded file (``file_id``) must be the caller's and
is sized from its stored row before a byte of it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from vlmserve.api.common.convert import Converter
from vlmserve.api.endpoints.files.service import FilesService
from vlmserve.api.endpoints.rerank.protocol import (
    ItemIn,
    RerankRequest,
    ScoreRequest,
    as_items,
)
from vlmserve.api.endpoints.responses.files import image_mime
from vlmserve.engine.protocol import Backend, Proxied, as_proxied
from vlmserve.engine.types import EmbedInput, ScorePair, Serves
from vlmserve.errors import InvalidRequest, NotFound, PayloadTooLarge, VlmserveError
from vlmserve.media.encode import data_url
from vlmserve.registry.manager import Lease, ModelManager

__all__ = ["RerankService"]

SCORERS = frozenset({Serves.RERANK, Serves.EMBEDDING})


def _needs(items: list[ItemIn]) -> frozenset[str]:
    """What the items are known to need before they are read (a file's kind is read later)."""
    return frozenset({"video" for i in items if i.video} | {"vision" for i in items if i.image})


class RerankService:
    def __init__(
        self,
        models: ModelManager,
        converter: Converter,
        files: FilesService | None,
        max_documents: int,
    ):
        self.models = models
        self.converter = converter
        self.files = files
        self.max_documents = max_documents

    # --- routes --------------------------------------------------------------------------
    async def rerank(self, body: RerankRequest, owner: str) -> dict[str, Any]:
        try:
            query = body.query_item()
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="query") from None
        documents = _items(body.documents, "documents")
        self._check_count(len(documents), "documents")
        async with await self._acquire(body.model, [query, *documents]) as backend:
            if (proxied := as_proxied(backend)) is not None:
                return await _relay(proxied, "/v1/rerank", body)
            q = await self._item(query, owner, "query")
            docs = await self._items(documents, owner, "documents")
            _check_takes(backend, [q, *docs])
            pairs = [ScorePair(q, d, body.max_tokens_per_doc) for d in docs]
            scored = await backend.score(pairs)
            model_id = backend.model_id
        order = sorted(range(len(documents)), key=lambda i: -scored.scores[i])
        top = order[: body.top_n] if body.top_n else order
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model_id,
            "results": [_result(i, scored.scores[i], documents[i], body) for i in top],
            "usage": _usage(scored.prompt_tokens),
            "meta": {"billed_units": {"search_units": 1}},
        }

    async def score(self, body: ScoreRequest, owner: str) -> dict[str, Any]:
        first, second = (_items(s, "data") for s in body.sides() if s is not None)
        if len(first) != 1 and len(first) != len(second):
            raise InvalidRequest(
                f"text_1 has {len(first)} items and text_2 {len(second)}: give one item on the "
                "first side (one-to-many) or as many as on the second (pairwise)",
                param="text_1",
            )
        self._check_count(len(second), "text_2")
        async with await self._acquire(body.model, [*first, *second]) as backend:
            if (proxied := as_proxied(backend)) is not None:
                return await _relay(proxied, "/v1/score", body)
            left = await self._items(first, owner, "text_1")
            right = await self._items(second, owner, "text_2")
            _check_takes(backend, [*left, *right])
            queries = left * len(right) if len(left) == 1 else left
            pairs = [
                ScorePair(q, d, body.max_tokens_per_doc)
                for q, d in zip(queries, right, strict=True)
            ]
            scored = await backend.score(pairs)
            model_id = backend.model_id
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model_id,
            "data": [
                {"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)
            ],
            "usage": {**_usage(scored.prompt_tokens), "completion_tokens": 0},
        }

    # --- checks and the model ------------------------------------------------------------
    def _check_count(self, count: int, param: str) -> None:
        if count == 0:
            raise InvalidRequest(f"{param} is empty; send at least one document", param=param)
        if count > self.max_documents:
            raise InvalidRequest(
                f"{count} documents in one request; the limit is {self.max_documents} "
                "(VLMSERVE_RERANK_MAX_DOCUMENTS): split them over several requests",
                param=param,
                code="too_many_documents",
            )

    async def _acquire(self, name: str | None, items: list[ItemIn]) -> Lease:
        """The lease of the model that scores; 400 when it lacks a modality of ``items``."""
        needs = _needs(items)
        lease = await self.models.acquire(name or self._default(), "rerank", SCORERS, needs)
        try:
            _refuse_missing(lease.handle.backend, needs)
        except InvalidRequest:
            lease.release()
            raise
        return lease

    def _default(self) -> str:
        """The ``rerank`` role's model, else the ``embedding`` role's (cosine scores)."""
        for role in ("rerank", "embedding"):
            with contextlib.suppress(NotFound):
                return self.models.for_role(role).name
        raise NotFound(
            'no model here scores documents: give one roles = ["rerank"] (a reranker) or '
            '["embedding"] (cosine scores), or name a model',
            param="model",
            code="model_not_found",
        )

    # --- media ---------------------------------------------------------------------------
    async def _items(self, items: list[ItemIn], owner: str, param: str) -> list[EmbedInput]:
        return list(
            await asyncio.gather(
                *(self._item(item, owner, f"{param}[{i}]") for i, item in enumerate(items))
            )
        )

    async def _item(self, item: ItemIn, owner: str, where: str) -> EmbedInput:
        try:
            image, video = item.image, item.video
            if item.file_id is not None:
                image, video = await self._file(item.file_id, owner, where)
            return EmbedInput(
                text=item.text,
                image=await self.converter.image(image) if image else None,
                frames=(await self.converter.video(video)).frames if video else None,
            )
        except VlmserveError as exc:
            exc.param = exc.param or where
            raise

    async def _file(self, file_id: str, owner: str, where: str) -> tuple[str | None, str | None]:
        """An uploaded file as a data URL: (image, None) or (None, video)."""
        if self.files is None:
            raise InvalidRequest("file_id needs the Files API, which is not set up here")
        row = self.files.get(owner, file_id, param=where)
        limit = self.converter.policy.max_bytes
        if row.bytes > limit:
            raise PayloadTooLarge(
                f"file {file_id!r} is {row.bytes} bytes; the limit is {limit} bytes per media "
                "item (VLMSERVE_MAX_MEDIA_BYTES)",
                param=where,
            )
        data = await asyncio.to_thread(self.files.store.blob(row.id).read_bytes)
        mime = image_mime(data[:16], row.filename)
        if mime is not None:
            return data_url(data, mime), None
        return None, data_url(data, "video/mp4")


def _refuse_missing(backend: Backend, needs: frozenset[str]) -> None:
    takes = backend.capabilities()
    missing = sorted(needs - takes) if takes is not None else []
    if missing:
        raise InvalidRequest(
            f"model {backend.model_id!r} does not take {' or '.join(missing)} documents "
            f"(it takes: text{''.join(', ' + t for t in sorted(takes or ()))}); send text, "
            "or pick a model that has them",
            param="documents",
            code="model_capability_missing",
        )


def _check_takes(backend: Backend, inputs: list[EmbedInput]) -> None:
    """The modalities of fetched items (an uploaded file is an image or a video)."""
    needs = {"vision" for i in inputs if i.image is not None}
    _refuse_missing(backend, frozenset(needs | {"video" for i in inputs if i.frames}))


async def _relay(proxied: Proxied, path: str, body: RerankRequest | ScoreRequest) -> dict[str, Any]:
    """A proxied model answers upstream (its media, as sent, are read there)."""
    wire = {k: _plain(v) for k, v in body.model_dump(mode="json", exclude_none=True).items()}
    return {**await proxied.relay(path, wire), "model": proxied.model_id}


def _plain(value: Any) -> Any:
    """Text items as the strings every upstream takes (``{"text": t}`` -> ``t``)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and set(value) == {"text"}:
        return value["text"]
    return value


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _result(index: int, score: float, item: ItemIn, body: RerankRequest) -> dict[str, Any]:
    result: dict[str, Any] = {"index": index, "relevance_score": score}
    if body.return_documents:
        shown = item.model_dump(exclude_none=True)
        result["document"] = shown if shown else {"text": ""}
    return result


def _items(value: Any, param: str) -> list[Any]:
    """A side of the request as items; a part that makes no item (an empty URL) is a 400."""
    try:
        return as_items(value)
    except ValueError as exc:  # pydantic's ValidationError included
        raise InvalidRequest(f"{param}: {exc}", param=param) from None
