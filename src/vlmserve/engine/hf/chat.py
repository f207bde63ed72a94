"""The ``hf`` chat backend: a transformers model in this process, one generation at a time.

Generation runs in a dedicated worker thread so the event loop stays free; tokens are
handed back with ``loop.call_soon_threadsafe``. Closing the async generator returned by
``generate`` sets a cancel flag that the model checks after every decode step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from vlmserve.engine.hf.generation import run_generation
from vlmserve.engine.hf.inputs import Prepared, build_inputs, render_prompt
from vlmserve.engine.hf.lifecycle import HFModel, ModelState
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import ChatMessage, Chunk, GenerateRequest
from vlmserve.errors import InvalidRequest, Overloaded

__all__ = ["HFChatBackend", "ModelState"]

log = logging.getLogger(__name__)
_END = object()


class HFChatBackend(HFModel):
    thread_prefix = "generate"

    def __init__(
        self,
        model_id: str,
        options: LoadOptions,
        *,
        max_model_len: int,
        max_queued: int,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 8192,
        vision_cache_bytes: int = 0,
    ):
        super().__init__(model_id, options)
        self.max_model_len = max_model_len
        self.max_queued = max_queued
        self.max_num_seqs = max_num_seqs  # sequences decoded together (continuous batching)
        self.max_num_batched_tokens = max_num_batched_tokens  # prompt tokens per prefill step
        self.vision_cache_bytes = vision_cache_bytes  # vision-tower outputs kept by content hash
        self.tokens_generated = 0  # every token the model produced, all requests
        self.in_flight = 0
        self._grammars: Any = None  # engine.hf.grammar.GrammarCompiler, built on first use

    # --- requests ------------------------------------------------------------------------
    def render_prompt(self, messages: list[ChatMessage]) -> str:
        return render_prompt(self._require().processor, messages)

    async def prepare(self, request: GenerateRequest) -> Prepared:
        """Run the chat template and processor (off the loop); check the context length."""
        loaded = self._require()
        prepared = await asyncio.to_thread(build_inputs, loaded.processor, request)
        total = prepared.prompt_tokens + request.sampling.max_tokens - len(request.prefix_token_ids)
        if total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({prepared.prompt_tokens} tokens) plus max_tokens "
                f"({request.sampling.max_tokens}) exceeds the context limit of "
                f"{self.max_model_len} tokens (VLMSERVE_MAX_MODEL_LEN); shorten the input, use "
                "fewer or smaller images, or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if request.response_format is not None:
            prepared.grammar = await asyncio.to_thread(self._compile, request.response_format)
        return prepared

    def _compile(self, response_format: dict[str, Any]) -> Any:
        """The response format's grammar (400 for schema features it cannot enforce)."""
        from vlmserve.engine.hf.grammar import GrammarCompiler  # xgrammar only when asked for

        if self._grammars is None:
            loaded = self._require()
            self._grammars = GrammarCompiler(
                loaded.processor.tokenizer,
                vocab_size=loaded.model.config.get_text_config().vocab_size,
            )
        return self._grammars.compile(response_format)

    async def generate(self, prepared: Prepared) -> AsyncIterator[Chunk]:
        loaded = self._require()
        if self.in_flight >= self.max_queued:
            raise Overloaded(
                f"{self.in_flight} requests are already queued for {self.model_id!r} "
                "(VLMSERVE_MAX_QUEUED_REQUESTS); retry later"
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def emit(chunk: Chunk) -> None:
            self.tokens_generated += len(chunk.token_ids)
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        def job() -> None:
            try:
                run_generation(
                    loaded.model, loaded.processor.tokenizer, prepared, emit, cancel, loaded.device
                )
            except BaseException as exc:  # handed to the consumer, which re-raises it
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        self.in_flight += 1
        future = loop.run_in_executor(self._executor, job)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            self.in_flight -= 1
            future.add_done_callback(lambda f: f.exception())  # never "exception never retrieved"
