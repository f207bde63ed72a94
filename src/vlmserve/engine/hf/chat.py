"""The ``hf`` chat backend: a transformers model in this process, requests batched continuously.

Qwen2-VL models run on the continuous-batching engine (``engine.core``, design in
docs/engine.md): requests join the running batch at step boundaries and leave the moment
they finish. Other architectures fall back to ``model.generate``, one request at a time.
Either way the model runs on one dedicated thread; tokens are handed back to the event
loop with ``loop.call_soon_threadsafe``. Closing the async generator returned by
``generate`` (``aclose``, a cancelled task, a client gone) takes the request out within
one decode step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from vlmserve.engine.admission import QueuePlaces
from vlmserve.engine.coalesce import coalesced
from vlmserve.engine.configs import ChatEngineConfig, RerankConfig
from vlmserve.engine.core.engine import END, BatchEngine
from vlmserve.engine.core.faults import describe
from vlmserve.engine.hf.capabilities import Capabilities, capabilities
from vlmserve.engine.hf.generation import eos_ids, run_generation
from vlmserve.engine.hf.inputs import Prepared, build_inputs, render_prompt
from vlmserve.engine.hf.lifecycle import HFModel, ModelState
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.hf.media_options import family_media, processor_kwargs
from vlmserve.engine.hf.preprocess import PreprocessPool
from vlmserve.engine.hf.processor_cache import CachedImageProcessor
from vlmserve.engine.hf.processor_cache import install as install_processor_cache
from vlmserve.engine.hf.score.backend import HFRerankBackend
from vlmserve.engine.hf.threads import media_executor, off_loop
from vlmserve.engine.models.architectures import supports
from vlmserve.engine.models.families._media import MediaRules
from vlmserve.engine.outputs import OutputParsers, parse_outputs
from vlmserve.engine.parsers import detect_reasoning_parser
from vlmserve.engine.types import (
    BackendStats,
    ChatMessage,
    Chunk,
    GenerateRequest,
    ImagePart,
    Scored,
    ScorePair,
    Serves,
    Tokenized,
    VideoPart,
)
from vlmserve.errors import InvalidRequest
from vlmserve.media.sampling import VideoSampling

__all__ = ["HFChatBackend", "ModelState"]

log = logging.getLogger(__name__)


class HFChatBackend(HFModel):
    thread_prefix = "generate"
    serves = Serves.CHAT

    def __init__(
        self,
        model_id: str,
        options: LoadOptions,
        config: ChatEngineConfig | None = None,
        *,
        scores: RerankConfig | None = None,
        **changes: Any,
    ):
        """``config`` (default: the settings' defaults), with ``changes`` applied to it;
        ``scores``: also score documents (the ``rerank`` role) with these settings."""
        super().__init__(model_id, options)
        self._score_config = scores
        self.scorer: HFRerankBackend | None = None  # scores on this model, when it does
        self.config = replace(config or ChatEngineConfig.defaults(), **changes)
        self._processor_cache: CachedImageProcessor | None = None
        self._preprocess: PreprocessPool | None = None  # images preprocessed elsewhere
        self._caps: Capabilities | None = None  # what the loaded model takes (image, video)
        self._media: tuple[MediaRules, VideoSampling] | None = None  # family media rules
        self._reasoning: str | None = None  # the reasoning parser (configured or detected)
        self.in_flight = 0  # requests streaming now (queued or decoding)
        self.engine: BatchEngine | None = None  # None: not loaded, or not a batchable model
        self._tokens_before = 0  # tokens produced by earlier engines and the fallback path
        self._places = QueuePlaces(model_id)  # held by admitted requests still preparing
        self._grammars: Any = None  # engine.hf.grammar.GrammarCompiler, built on first use
        # Told (on the engine's thread) when the engine failed for good, with an event loop of
        # a request it ended (or None): the model manager schedules the reload there.
        self.on_engine_failure: Callable[[Any], None] | None = None
        self.engine_failures = 0  # fatal engine errors since this backend was built
        self.last_engine_error: str | None = None  # the latest, kept across reloads

    # --- lifecycle -----------------------------------------------------------------------
    def load(self) -> None:
        super().load()
        loaded = self._require()
        self._caps = capabilities(loaded.model, loaded.processor)
        self._media = family_media(loaded.model, loaded.processor)
        template = getattr(loaded.processor, "chat_template", None)
        detected = detect_reasoning_parser(template if isinstance(template, str) else None)
        self._reasoning = self.config.reasoning_parser or detected
        if not supports(loaded.model):
            self._attach_scorer(loaded)
            log.info(
                "%s: %s is served one request at a time (no batched runner for it)",
                self.model_id,
                type(loaded.model).__name__,
            )
            return
        self.engine = self._new_engine(loaded)
        self._processor_cache = install_processor_cache(
            loaded.processor, self.config.processor_cache_bytes
        )
        self._start_preprocessing()
        self._attach_scorer(loaded)

    def _start_preprocessing(self) -> None:
        """In an engine process (``preprocess_workers``), its images' preprocessing in worker
        processes (``preprocess.py``), from the first image on."""
        cache, workers = self._processor_cache, self.config.preprocess_workers
        if cache is None or workers <= 0:
            return
        self._preprocess = PreprocessPool(cache.inner, workers, self.config.media_nice)
        cache.remote = self._preprocess  # started by the first image

    def _attach_scorer(self, loaded: Any) -> None:
        if self._score_config is not None:
            self.scorer = HFRerankBackend.beside_chat(
                self.model_id, self.options, self._score_config, loaded, self.engine
            )

    @property
    def also_serves(self) -> frozenset[Serves]:
        return frozenset({Serves.RERANK}) if self._score_config is not None else frozenset()

    async def score(self, pairs: list[ScorePair]) -> Scored:
        """Each pair's relevance, on this model's engine and vision cache (``beside_chat``)."""
        if self._score_config is None:
            return await super().score(pairs)
        self._require()  # the 503 that says why, when not loaded
        assert self.scorer is not None  # attached whenever the model is loaded
        return await self.scorer.score(pairs)

    def _new_engine(self, loaded: Any) -> BatchEngine:
        return BatchEngine(
            loaded.model,
            loaded.processor.tokenizer,
            eos_ids(loaded.model),
            self.config,
            submit=lambda fn: self._executor.submit(fn),
            model_id=self.model_id,
            on_fatal=self._engine_failed,
        )

    def capabilities(self) -> frozenset[str] | None:
        caps = self._caps if self.state is ModelState.READY else None
        return frozenset(caps.enabled()) if caps is not None else None

    def video_sampling(self) -> VideoSampling | None:
        return self._media[1] if self._media is not None else None

    def _build(self, loaded: Any, request: GenerateRequest) -> Any:
        """``build_inputs`` (off the loop) with the request's media options. With images or
        video, on the media threads below the request path's priority (``threads.py``),
        unless the image processor runs in the preprocessing workers (``preprocess.py``):
        what is left here then (the template, the tokenizer, the wait for the workers) is
        short work under the GIL, which a low-priority thread would hold while it waits for
        a busy CPU, making the request path's threads wait with it."""
        rules = self._media[0] if self._media is not None else MediaRules()
        kwargs = processor_kwargs(rules, loaded.processor, request.media)
        parts = [p for m in request.messages for p in m.content]
        video = any(isinstance(p, VideoPart) for p in parts)
        images = any(isinstance(p, ImagePart) for p in parts)
        cache = self._processor_cache
        elsewhere = not video and cache is not None and cache.preprocessed_elsewhere()
        low = video or (images and not elsewhere)
        executor = media_executor(self.config.media_nice) if low else None
        return off_loop(build_inputs, loaded.processor, request, None, kwargs, executor=executor)

    def watch_failures(self, callback: Callable[[Any], None]) -> None:
        self.on_engine_failure = callback

    def _engine_failed(self, cause: BaseException, loop: Any) -> None:
        """The engine is unusable (its requests have already been ended): the model is
        ``failed``, with the cause in ``error`` (``/health``, ``/admin/state``), until the
        model manager reloads it."""
        self.engine_failures += 1
        self.last_engine_error = describe(cause)
        self.state, self.error = ModelState.FAILED, f"engine failed: {self.last_engine_error}"
        if self.on_engine_failure is not None:
            self.on_engine_failure(loop)

    def check_progress(self, timeout: float) -> bool:
        """Fail the engine if it has had work without progress for ``timeout`` seconds (at
        least 3x its longest step so far); True when it did."""
        engine = self.engine
        if engine is None or timeout <= 0 or self.state is not ModelState.READY:
            return False  # the generate fallback is not watched
        stalled = engine.stalled_for()
        if stalled <= max(timeout, 3 * engine.longest_step):
            return False
        engine.declare_stalled(stalled)
        return True

    def close(self) -> None:
        self._processor_cache = None  # dropped with the processor
        if self._preprocess is not None:
            self._preprocess.close()
            self._preprocess = None
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        if self.engine is not None:
            self.engine.close()
            self._tokens_before += self.engine.tokens_generated
            self.engine = None
        super().close()

    @property
    def tokens_generated(self) -> int:
        """Every token the model produced, all requests, since this backend was built."""
        return self._tokens_before + (self.engine.tokens_generated if self.engine else 0)

    def vision_cache_stats(self) -> dict[str, int]:
        """Vision-tower cache counters (hits, misses, bytes, entries); zeros when unused."""
        if self.engine is None:
            return dict.fromkeys(("hits", "misses", "bytes", "entries"), 0)
        return self.engine.gauges.vision_cache_stats()

    def processor_cache_stats(self) -> dict[str, int]:
        """Image-processor cache counters (hits, misses, bytes, entries); zeros when unused."""
        if self._processor_cache is None:
            return dict.fromkeys(("hits", "misses", "bytes", "entries"), 0)
        return self._processor_cache.stats()

    def _memory_stats(self, out: BackendStats) -> None:
        loaded = self._loaded
        if loaded is None:
            return
        out.weights_bytes = self.memory_bytes
        if loaded.device.type == "cuda":
            import torch  # torch is loaded whenever a model is

            out.device_memory_bytes = int(torch.cuda.memory_allocated(loaded.device))

    def stats(self) -> BackendStats:
        """Decoding / waiting rows and KV use from the engine; the fallback path decodes one
        request at a time."""
        out = BackendStats(
            vision_cache=self.vision_cache_stats(),
            processor_cache=self.processor_cache_stats(),
            engine_failures=self.engine_failures,
            last_engine_error=self.last_engine_error,
        )
        self._memory_stats(out)
        engine = self.engine
        if engine is None:
            out.running = min(self.in_flight, 1)
            out.waiting = self.in_flight - out.running
            out.kv_usage = float(out.running)
            return out
        out.running, out.waiting = engine.gauges.running, engine.gauges.queued
        out.step_seconds = engine.gauges.step_seconds
        out.stalled_seconds, out.longest_step_seconds = engine.stalled_for(), engine.longest_step
        out.kv_usage = engine.gauges.kv_usage  # KV blocks in use
        out.preemptions = engine.gauges.preemptions
        out.prefix_cache = (engine.scheduler.prefix_queried, engine.scheduler.prefix_hits)
        out.kv_cache_bytes = engine.gauges.kv_cache_bytes
        return out

    # --- requests ------------------------------------------------------------------------
    def render_prompt(self, messages: list[ChatMessage]) -> str:
        return render_prompt(self._require().processor, messages)

    async def prepare(self, request: GenerateRequest) -> Prepared:
        """Run the chat template and processor (off the loop); check the context length."""
        loaded = self._require()
        prepared = await self._build(loaded, request)
        total = prepared.prompt_tokens + request.sampling.max_tokens - len(request.prefix_token_ids)
        if total > self.config.max_model_len:
            raise InvalidRequest(
                f"prompt ({prepared.prompt_tokens} tokens) plus max_tokens "
                f"({request.sampling.max_tokens}) exceeds the context limit of "
                f"{self.config.max_model_len} tokens (VLMSERVE_MAX_MODEL_LEN); shorten the "
                "input, use fewer or smaller images, or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        _check_logit_bias(request.sampling.logit_bias, loaded.model)
        _check_allowed(request.sampling.allowed_token_ids, loaded.model)
        prepared.parsers = self._parsers(prepared)
        if self.engine is not None:  # 400 now if the whole KV budget could never hold it
            new_tokens = request.sampling.max_tokens - len(request.prefix_token_ids)
            self.engine.gauges.check_fits(prepared.prompt_tokens, new_tokens)
        if request.response_format is not None:
            prepared.grammar = await off_loop(self._compile, request.response_format)
        return prepared

    async def tokenize(
        self, what: GenerateRequest | str, *, add_special_tokens: bool = True
    ) -> Tokenized:
        """The prompt ``prepare`` would build (the same template and processor run), or a
        plain text through the tokenizer alone."""
        loaded = self._require()
        if isinstance(what, str):
            tokenizer = loaded.processor.tokenizer
            ids = tokenizer.encode(what, add_special_tokens=add_special_tokens)
        else:
            prepared = await self._build(loaded, what)
            ids = prepared.inputs["input_ids"][0].tolist()
        return Tokenized(ids=list(ids), max_model_len=self.config.max_model_len)

    async def detokenize(self, ids: list[int]) -> str:
        tokenizer = self._require().processor.tokenizer
        vocab = len(tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside this model's vocabulary (ids 0..{vocab - 1})",
                param="tokens",
            )
        return str(tokenizer.decode(ids))

    def _parsers(self, prepared: Prepared) -> OutputParsers | None:
        """How this answer is read back (None: plain text); a resumed request's already sent
        tokens advance the parsers first."""
        request = prepared.request
        parsers = OutputParsers.build(
            request.output, self._reasoning, self.config.tool_call_parser, prepared.prompt_text
        )
        if not parsers.active:
            return None
        if request.prefix_token_ids:
            tokenizer = self._require().processor.tokenizer
            parsers.skip(tokenizer.decode(request.prefix_token_ids, skip_special_tokens=True))
        return parsers

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

    def _waiting(self) -> int:
        engine = self.engine
        return engine.gauges.queued if engine is not None else max(0, self.in_flight - 1)

    def admit(self) -> Callable[[], None]:
        """Reserve a place in the queue before any work is done (Overloaded, 429, when full).

        Requests prepare concurrently, so the place is held from here until the request
        reaches the engine: call the returned function then (or on failure; it is idempotent).
        """
        return self._places.admit(self._waiting(), self.config.max_queued)

    def generate(self, prepared: Prepared) -> AsyncIterator[Chunk]:
        """The request's chunks; a thinking model's reasoning and tool calls split out."""
        chunks = self._chunks(prepared)
        return chunks if prepared.parsers is None else parse_outputs(chunks, prepared.parsers)

    async def _chunks(self, prepared: Prepared) -> AsyncIterator[Chunk]:
        self._require()
        # callers that did not admit (worker routes)
        self._places.refuse_if_full(self._waiting(), self.config.max_queued)
        engine = self.engine
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        if engine is not None:
            seq = engine.new_sequence(prepared, loop, queue)
            engine.submit(seq)
            stop: Callable[[], None] = lambda: setattr(seq, "cancelled", True)  # noqa: E731
            crowded: Callable[[], bool] = lambda: engine.gauges.running > 1  # noqa: E731
        else:
            stop, crowded = self._start_alone(prepared, loop, queue), lambda: False
        self.in_flight += 1
        try:
            async for chunk in coalesced(queue, crowded):
                yield chunk
        finally:
            stop()  # read by the engine at its next step boundary
            self.in_flight -= 1

    def _start_alone(
        self, prepared: Prepared, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]
    ) -> Callable[[], None]:
        """Models without a batched runner: ``model.generate`` for this request alone."""
        loaded = self._require()
        cancel = threading.Event()

        def emit(chunk: Chunk) -> None:
            self._tokens_before += len(chunk.token_ids)
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        def job() -> None:
            try:
                run_generation(
                    loaded.model, loaded.processor.tokenizer, prepared, emit, cancel, loaded.device
                )
            except BaseException as exc:  # handed to the consumer, which re-raises it
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, END)

        self._executor.submit(job)
        return cancel.set


def _check_logit_bias(bias: dict[int, float], model: Any) -> None:
    """A 400 for a biased token id the model has no logit for."""
    vocab = int(model.config.get_text_config().vocab_size)
    outside = sorted(t for t in bias if not 0 <= t < vocab)
    if outside:
        raise InvalidRequest(
            f"logit_bias names token id {outside[0]}, outside the model's vocabulary of "
            f"{vocab} tokens (ids 0..{vocab - 1})",
            param="logit_bias",
        )


def _check_allowed(ids: list[int] | None, model: Any) -> None:
    """A 400 for an allowed token id the model has no logit for."""
    vocab = int(model.config.get_text_config().vocab_size)
    outside = sorted(t for t in ids or [] if not 0 <= t < vocab)
    if outside:
        raise InvalidRequest(
            f"allowed_token_ids names token id {outside[0]}, outside the model's vocabulary "
            f"of {vocab} tokens (ids 0..{vocab - 1})",
            param="allowed_token_ids",
        )
