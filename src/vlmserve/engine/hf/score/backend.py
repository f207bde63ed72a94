"""The ``hf`` reranker backend: a cross-encoder scores each query-document pair in one forward.

The model is loaded as transformers' own class (``AutoModelForImageTextToText``: Qwen2-VL
for jina-reranker-m0, Qwen3-VL for Qwen3-VL-Reranker); ``heads.py`` picks the score head
from the checkpoint, and the head reads the final hidden state at each pair's last token.

Where the batched engine has the family (``models.architectures``: Qwen2-VL and Qwen3-VL,
both reranker kinds), pairs run on its model code as **prefill-only rows**: each pair is one
unpadded row (``pair_inputs``: text-only pairs tokenised together, their padding cut off),
its images and videos scattered in by the family's prompt embedder through this model's
``VisionCache`` (a document image seen before, in this request or an earlier one, is not
encoded again); the rows are packed into forwards of at most ``max_batch`` pairs and
``max_batched_tokens`` tokens (``models.prefill_only.last_hidden``: no decode, no KV cache
allocated, written or kept). Other families fall back to transformers' forward over
left-padded batches (``embed.last_token_states``).

A model served with both the ``chat`` and ``rerank`` roles is loaded once: the chat backend
holds a reranker made with ``beside_chat``, which scores on the chat engine's runner and
prompt embedder, between the engine's steps and on its thread (``BatchEngine.call``), so the
two share one ``VisionCache``: a document image a chat request encoded is not encoded again
when it is scored, and the other way round.

Concurrent ``score`` calls share forward passes through a ``MicroBatcher`` (as embeddings
do); when a shared batch fails, each request runs again alone, so only the one at fault gets
the error (a pair over the context limit, say).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from functools import partial
from typing import Any

import torch

from vlmserve.engine.configs import RerankConfig, batched_tokens
from vlmserve.engine.hf.embed import last_token_states
from vlmserve.engine.hf.embed_batcher import MicroBatcher, shared_passes
from vlmserve.engine.hf.lifecycle import HFModel
from vlmserve.engine.hf.loading import Loaded, LoadOptions, load_model
from vlmserve.engine.hf.score.heads import ScoreHead, load_head
from vlmserve.engine.hf.score.prompts import JINA, build_batch, check_pair, pair_inputs
from vlmserve.engine.models.architectures import build, supports
from vlmserve.engine.models.batch import PrefillRow
from vlmserve.engine.models.prefill_only import last_hidden, shared_prefix
from vlmserve.engine.models.vision_cache import VisionCache
from vlmserve.engine.types import BackendStats, ModelState, Scored, ScorePair, Serves
from vlmserve.errors import InvalidRequest

__all__ = ["HFRerankBackend"]

log = logging.getLogger(__name__)


class HFRerankBackend(HFModel):
    thread_prefix = "rerank"
    serves = Serves.RERANK

    def __init__(
        self,
        model_id: str,
        options: LoadOptions,
        *,
        config: RerankConfig | None = None,
        max_batch: int | None = None,
    ):
        """``config`` (default: the settings' defaults); ``max_batch`` overrides it."""
        config = config or RerankConfig.defaults()
        max_batch = config.max_batch if max_batch is None else max_batch
        super().__init__(model_id, options)
        self.max_model_len = config.max_model_len
        self.forward_passes = 0  # model forward passes run, all requests together
        self.vision_cache = VisionCache(config.vision_cache_bytes)
        self._tokens_setting = config.max_batched_tokens
        self.max_batched_tokens = 0  # tokens one forward packs: set at load, by device
        self._head: ScoreHead | None = None
        self._runner: Any = None  # the batched engine's runner and prompt embedder, when
        self._embedder: Any = None  # the family has them; None: transformers' forward
        self._engine: Any = None  # a chat model's BatchEngine this reranker scores on
        self._batcher: MicroBatcher[ScorePair, Scored] = MicroBatcher.for_model(
            self._run_groups, model_id, max_batch, config.batch_wait_ms
        )

    @classmethod
    def beside_chat(
        cls, model_id: str, options: LoadOptions, config: RerankConfig, loaded: Loaded, engine: Any
    ) -> HFRerankBackend:
        """A reranker on a chat model's ``loaded`` weights: on its batched ``engine`` (runner,
        prompt embedder and vision cache, work run between the engine's steps) where it has
        one, else transformers' forward on a thread of its own."""
        scorer = cls(model_id, options, config=config)
        scorer._head = load_head(loaded.model, loaded.processor.tokenizer, options.source)
        if engine is not None:
            scorer._engine, scorer.vision_cache = engine, engine.vision_cache
            scorer._runner, scorer._embedder = engine.runner, engine.embedder
        scorer.max_batched_tokens = batched_tokens(scorer._tokens_setting, loaded.device.type)
        scorer._loaded, scorer.state = loaded, ModelState.READY
        return scorer

    @property
    def max_batch(self) -> int:
        """Most pairs in one forward pass."""
        return self._batcher.max_items

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        self._batcher.max_items = value

    @property
    def packed(self) -> bool:
        """Whether pairs run as packed prefill-only rows on the batched engine's model code
        (else transformers' forward over left-padded batches)."""
        return self._embedder is not None

    @property
    def kind(self) -> str:
        """``jina`` or ``yes_no`` (``heads.py``)."""
        return self._require_head().kind

    def _load(self) -> Loaded:
        loaded = load_model(self.options)
        self._head = load_head(loaded.model, loaded.processor.tokenizer, self.options.source)
        self._runner = self._embedder = None
        if supports(loaded.model):
            self._runner, self._embedder = build(loaded.model, self.vision_cache)
        self.max_batched_tokens = batched_tokens(self._tokens_setting, loaded.device.type)
        how = "packed prefill-only rows" if self._runner else "left-padded batches"
        log.info("reranker %s scores with the %s head, %s", self.model_id, self._head.kind, how)
        return loaded

    def close(self) -> None:
        super().close()
        if self._engine is None:  # else the cache is the chat engine's, closed with it
            self.vision_cache.clear()
        self._runner = self._embedder = self._engine = None

    def stats(self) -> BackendStats:
        return BackendStats(vision_cache=self.vision_cache.stats())

    def _require_head(self) -> ScoreHead:
        self._require()
        assert self._head is not None  # set with the loaded model
        return self._head

    def capabilities(self) -> frozenset[str] | None:
        """jina-reranker-m0 takes images (its modeling code places no video); the yes/no
        rerankers what their processor and template take."""
        if self._loaded is None or self._head is None:
            return None
        if self._head.kind == JINA:
            return frozenset({"vision"})
        from vlmserve.engine.hf.capabilities import processor_capabilities

        caps = processor_capabilities(self._loaded.processor)
        return frozenset(k for k, on in (("vision", caps.image), ("video", caps.video)) if on)

    # --- requests ------------------------------------------------------------------------
    def score_sync(self, pairs: list[ScorePair]) -> Scored:
        """Blocking: every pair's score, in forward passes of at most ``max_batch`` pairs
        (and, packed, ``max_batched_tokens`` tokens)."""
        _check_pairs(pairs)
        loaded, head = self._require(), self._require_head()
        if self._embedder is None:
            return self._score_padded(loaded, head, pairs)
        scores: list[float] = []
        with torch.inference_mode():
            rows = self._rows(loaded, head, pairs)
            lengths = [row.embeds.shape[0] for row in rows]
            # a beginning every row has alike runs once a forward (``shared_prefix``): the
            # token budget counts it once, and each row by its own tokens
            shared = shared_prefix(self._runner, rows)
            own = [length - shared for length in lengths]
            for pack in _packs(own, self.max_batch, self.max_batched_tokens - shared):
                self.forward_passes += 1
                last = last_hidden(self._runner, [rows[i] for i in pack])
                scores += head(last).cpu().tolist()
        return Scored(scores, sum(lengths))

    def _rows(self, loaded: Loaded, head: ScoreHead, pairs: list[ScorePair]) -> list[PrefillRow]:
        """One prefill row per pair, its media through the vision cache (lengths checked
        before any vision tower runs)."""
        inputs = pair_inputs(loaded.processor, head.kind, pairs)
        lengths = [int(i["input_ids"].shape[1]) for i in inputs]
        self._check_lengths(lengths, pairs, list(range(len(pairs))))
        return [self._embedder.build(i).row for i in inputs]

    def _score_padded(self, loaded: Loaded, head: ScoreHead, pairs: list[ScorePair]) -> Scored:
        """transformers' forward over left-padded batches of ``max_batch`` pairs; pairs of
        like size share a batch (less padding); scores go back in request order."""
        order = sorted(range(len(pairs)), key=lambda i: _size(pairs[i]))
        scores = [0.0] * len(pairs)
        tokens = 0
        for start in range(0, len(order), self.max_batch):
            chunk = order[start : start + self.max_batch]
            values, read = self._score_batch(loaded, head, [pairs[i] for i in chunk], chunk)
            for i, value in zip(chunk, values, strict=True):
                scores[i] = value
            tokens += read
        return Scored(scores, tokens)

    async def score(self, pairs: list[ScorePair]) -> Scored:
        """Like ``score_sync``, on the model's thread, sharing forward passes with concurrent
        calls; bad pairs are refused before joining anyone else's batch."""
        _check_pairs(pairs)
        self._require_head()
        return await self._batcher.submit(pairs)

    async def _run_groups(self, groups: list[list[ScorePair]]) -> list[Scored | BaseException]:
        """Every request's scores from shared forward passes (``shared_passes``), on the
        chat engine's thread between its steps when scoring beside a chat model."""
        job = partial(shared_passes, self.score_sync, groups, _by_request, "score")
        if self._engine is not None:
            return await asyncio.wrap_future(self._engine.call(job))
        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def _score_batch(
        self, loaded: Loaded, head: ScoreHead, pairs: list[ScorePair], indices: list[int]
    ) -> tuple[list[float], int]:
        batch = build_batch(loaded.processor, head.kind, pairs)
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        self._check_lengths(lengths, pairs, indices)
        self.forward_passes += 1
        with torch.inference_mode():
            scores = head(last_token_states(loaded, batch))
        return scores.cpu().tolist(), int(sum(lengths))

    def _check_lengths(
        self, lengths: list[Any], pairs: list[ScorePair], indices: list[int]
    ) -> None:
        for index, length, pair in zip(indices, lengths, pairs, strict=True):
            if length > self.max_model_len:
                where = f"documents[{index}]"
                hint = (
                    "shorten it or send max_tokens_per_doc to cut its text"
                    if pair.max_doc_tokens is None
                    else "its media alone exceed the limit; send smaller images or fewer frames"
                )
                raise InvalidRequest(
                    f"{where} with the query is {int(length)} tokens; the limit is "
                    f"{self.max_model_len} (VLMSERVE_MAX_MODEL_LEN): {hint}",
                    param=where,
                    code="context_length_exceeded",
                )


def _by_request(together: Scored, offsets: list[int]) -> list[Scored]:
    """Each request's scores; usage as an even share of the tokens read together."""
    share = together.prompt_tokens // max(1, offsets[-1])
    return [Scored(together.scores[a:b], share * (b - a)) for a, b in itertools.pairwise(offsets)]


def _packs(lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Consecutive rows in forwards of at most ``max_rows`` rows and ``max_tokens`` tokens
    (a row longer than ``max_tokens`` alone)."""
    packs: list[list[int]] = []
    tokens = 0
    for i, length in enumerate(lengths):
        if not packs or len(packs[-1]) >= max_rows or tokens + length > max_tokens:
            packs.append([])
            tokens = 0
        packs[-1].append(i)
        tokens += length
    return packs


def _size(pair: ScorePair) -> tuple[int, int]:
    """A sort key that groups pairs of like cost: media first by kind, then text length."""
    media = 2 if pair.document.frames is not None else int(pair.document.image is not None)
    return media, len(pair.document.text or "") + len(pair.query.text or "")


def _check_pairs(pairs: list[ScorePair]) -> None:
    if not pairs:
        raise InvalidRequest("nothing to score: send at least one document", param="documents")
    for index, pair in enumerate(pairs):
        check_pair(pair, index)
