"""The ``hf`` embedding backend: VLM2Vec-style vectors from a vision-language model (+ LoRA).

Embedding = the final layer's hidden state (after the final norm) at the last token,
L2-normalised, float32. Items are rendered through the model's own chat template and run
in left-padded batches of ``max_batch``; padding does not change any vector:

- text-only batches get explicit position ids that start at each row's first real token;
- batches with images or video leave positions to the model: Qwen2-VL's ``get_rope_index``
  computes the multimodal (t, h, w) positions from the real tokens of each row only (it
  takes the attention mask), so a left-padded row gets the same positions as alone;
- the vision tower encodes each image/video separately (``cu_seqlens``), unaffected by others.

Concurrent ``embed`` calls share forward passes: a ``MicroBatcher`` holds each request up to
``batch_wait_ms`` (or until ``max_batch`` items wait), runs them together on the model's
thread and hands every request its own rows. When a shared batch fails, each request is run
again alone, so only the request at fault gets the error.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import torch

from vlmserve.engine.configs import EmbedConfig
from vlmserve.engine.hf.adapters import apply_adapter
from vlmserve.engine.hf.embed_batcher import MicroBatcher, shared_passes
from vlmserve.engine.hf.embed_inputs import (
    EmbedInput,
    EmbedPrompts,
    build_batch,
    check_input,
    render,
    text_positions,
)
from vlmserve.engine.hf.lifecycle import HFModel
from vlmserve.engine.hf.loading import Loaded, LoadOptions, load_model
from vlmserve.engine.hf.score.prompts import cut_text
from vlmserve.engine.types import Scored, ScorePair, Serves
from vlmserve.errors import InvalidRequest

__all__ = ["EmbedInput", "EmbedPrompts", "HFEmbedBackend"]

_MEDIA_KEYS = ("pixel_values", "pixel_values_videos")


def final_hidden_states(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The last layer's output after the final norm: [B, L, H] (= ``hidden_states[-1]``).

    The inner ``model.model`` (vision tower + language model, no LM head) returns exactly
    that as ``last_hidden_state`` without computing logits or keeping every layer's states.
    """
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module):
        return inner(**inputs, use_cache=False).last_hidden_state
    return model(**inputs, use_cache=False, output_hidden_states=True).hidden_states[-1]


def last_token_states(loaded: Loaded, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, H]: each row's final hidden state at its last token, from one forward over the
    left-padded ``batch`` (call it under ``torch.inference_mode``). Text-only batches get
    position ids that start at each row's first real token; with media the model computes
    them from the attention mask."""
    inputs = {k: v.to(loaded.device) for k, v in batch.items()}
    if not any(k in inputs for k in _MEDIA_KEYS):
        inputs["position_ids"] = text_positions(inputs["attention_mask"])
    hidden = final_hidden_states(loaded.model, inputs)  # [B, L, H]
    return hidden[:, -1, :]  # left padding: every row's last real token


class HFEmbedBackend(HFModel):
    thread_prefix = "embed"
    serves = Serves.EMBEDDING

    def __init__(
        self,
        model_id: str,
        options: LoadOptions,
        *,
        adapter: str | None = None,
        prompts: EmbedPrompts = EmbedPrompts(),
        config: EmbedConfig | None = None,
        max_batch: int | None = None,
        batch_wait_ms: float | None = None,
    ):
        """``config`` (default: the settings' defaults); ``max_batch``/``batch_wait_ms``
        override it."""
        config = config or EmbedConfig.defaults()
        max_batch = config.max_batch if max_batch is None else max_batch
        batch_wait_ms = config.batch_wait_ms if batch_wait_ms is None else batch_wait_ms
        super().__init__(model_id, options)
        self.adapter = adapter
        self.prompts = prompts
        self.forward_passes = 0  # model forward passes run, all requests together
        self._batcher: MicroBatcher[EmbedInput, np.ndarray] = MicroBatcher.for_model(
            self._run_groups, model_id, max_batch, batch_wait_ms
        )

    @property
    def max_batch(self) -> int:
        """Most items in one forward pass (and in one gathered batch of requests)."""
        return self._batcher.max_items

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        self._batcher.max_items = value

    @property
    def batch_wait_ms(self) -> float:
        """How long a request waits for others to join its forward pass."""
        return self._batcher.wait_s * 1000

    @batch_wait_ms.setter
    def batch_wait_ms(self, value: float) -> None:
        self._batcher.wait_s = value / 1000

    def _load(self) -> Loaded:
        """The base model, then the adapter: checked against the base, applied, merged."""
        loaded = load_model(self.options)
        if self.adapter:
            loaded.model = apply_adapter(loaded.model, self.adapter, self.options.source)
            loaded.model.eval()
        return loaded

    @property
    def dim(self) -> int:
        """Embedding size: the language model's hidden size (1536 for Qwen2-VL-2B)."""
        return int(self._require().model.config.get_text_config().hidden_size)

    # --- requests ------------------------------------------------------------------------
    def render(self, item: EmbedInput) -> str:
        """The exact prompt text for ``item`` (chat template applied)."""
        check_input(item)
        return render(self._require().processor, item, self.prompts)

    def count_tokens(self, items: list[EmbedInput]) -> int:
        tokenizer = self._require().processor.tokenizer
        return sum(len(tokenizer(self.render(item))["input_ids"]) for item in items)

    async def decode_tokens(self, arrays: list[list[int]]) -> list[str]:
        """Token arrays are ids of this model's own tokenizer (as vLLM reads them): checked
        against its vocabulary, then embedded as the text they decode to."""
        tokenizer = self._require().processor.tokenizer
        vocab = len(tokenizer)
        for i, ids in enumerate(arrays):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"input[{i}] holds token id {bad}, outside this model's vocabulary of "
                    f"{vocab}: token arrays must be ids of the served model's own tokenizer. "
                    "Send the text instead (LangChain's OpenAIEmbeddings sends "
                    "OpenAI-tokenizer ids unless you set check_embedding_ctx_length=False)",
                    param="input",
                    code="invalid_token_ids",
                )
        return [tokenizer.decode(ids) for ids in arrays]

    async def score(self, pairs: list[ScorePair]) -> Scored:
        """Cosine similarity of each pair's embeddings (a bi-encoder's relevance): each
        distinct query is embedded once; a document's text is cut to ``max_doc_tokens``."""
        tokenizer = self._require().processor.tokenizer
        queries = list({id(p.query): p.query for p in pairs}.values())
        documents = [
            EmbedInput(cut_text(tokenizer, p.document.text, p.max_doc_tokens), *_media(p.document))
            for p in pairs
        ]
        vectors = await self.embed([*queries, *documents])
        where = {id(q): i for i, q in enumerate(queries)}
        rows = vectors[[where[id(p.query)] for p in pairs]]
        scores = np.sum(rows * vectors[len(queries) :], axis=1)
        return Scored([float(s) for s in scores], self.count_tokens([*queries, *documents]))

    def embed_sync(self, items: list[EmbedInput]) -> np.ndarray:
        """Blocking: [len(items), dim] float32 unit vectors, computed in batches of max_batch."""
        _check_items(items)
        loaded = self._require()
        out = np.empty((len(items), self.dim), dtype=np.float32)
        for start in range(0, len(items), self.max_batch):
            chunk = items[start : start + self.max_batch]
            out[start : start + len(chunk)] = self._embed_batch(loaded, chunk)
        return out

    async def embed(self, items: list[EmbedInput]) -> np.ndarray:
        """Like ``embed_sync``, on the model's thread, sharing forward passes with concurrent
        calls. Bad items are refused here, before the request joins anyone else's batch."""
        _check_items(items)
        self._require()
        return await self._batcher.submit(items)

    async def _run_groups(self, groups: list[list[EmbedInput]]) -> list[np.ndarray | BaseException]:
        """Every request's vectors from shared forward passes (``shared_passes``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, shared_passes, self.embed_sync, groups, _by_request, "embedding"
        )

    def _embed_batch(self, loaded: Loaded, items: list[EmbedInput]) -> np.ndarray:
        batch = build_batch(loaded.processor, items, self.prompts)
        self.forward_passes += 1
        with torch.inference_mode():
            last = last_token_states(loaded, batch).float()
            vectors = torch.nn.functional.normalize(last, dim=-1)
        return vectors.cpu().numpy()


def _by_request(vectors: np.ndarray, offsets: list[int]) -> list[np.ndarray]:
    return [vectors[start:end] for start, end in itertools.pairwise(offsets)]


def _media(item: EmbedInput) -> tuple[Any, Any]:
    return item.image, item.frames


def _check_items(items: list[EmbedInput]) -> None:
    if not items:
        raise InvalidRequest(
            "nothing to embed: send at least one text, image or video", param="input"
        )
    for index, item in enumerate(items):
        check_input(item, index)
