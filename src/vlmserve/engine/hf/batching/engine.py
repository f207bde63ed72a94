"""The continuous-batching loop: one thread, one step at a time, rows joining and leaving.

A step (nano-vllm's ``LLMEngine.step``): drop cancelled rows -> admit waiting requests that
fit (``Scheduler``) and prefill them together, vision tower included -> one decode forward
for every running row -> sample all rows at once -> hand each row's tokens to its consumer
-> finished rows leave (their KV slot is reused at once). Outputs of a step reach each
event loop in one ``call_soon_threadsafe``. The loop runs on the model's executor thread
while there is work and returns when the engine is idle; ``submit`` restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from vlmserve.engine.hf.batching.detok_fast import fast_decoder
from vlmserve.engine.hf.batching.runner import PrefillRow, Qwen2VLRunner
from vlmserve.engine.hf.batching.sampler import Sampler
from vlmserve.engine.hf.batching.scheduler import Scheduler
from vlmserve.engine.hf.batching.sequence import SeqStatus, Sequence
from vlmserve.engine.hf.batching.vision import PromptEmbedder
from vlmserve.engine.hf.batching.vision_cache import VisionCache
from vlmserve.engine.hf.generation import _Run
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.types import Chunk, FinishReason
from vlmserve.errors import ServiceUnavailable

__all__ = ["END", "BatchEngine"]

log = logging.getLogger(__name__)
END = object()  # the last item a consumer receives
# With this many rows decoding, outputs go to the event loops every `stream_interval` steps:
# the consumers then merge that many tokens per SSE event, dividing the event loop's per-token
# work (which shares the GIL with this thread) at the cost of tokens arriving in groups.
_BUSY_ROWS = 4
_SMALL_MODEL_PARAMS = 50_000_000  # below this a decode step's matmuls take microseconds
# An idle engine keeps a KV cache up to this size for the next request (allocating and zeroing
# it again cost ~1 ms a request at one-at-a-time traffic); a larger one goes back at once.
_KEEP_IDLE_CACHE_BYTES = 64 * 2**20


class BatchEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        eos_ids: set[int],
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        vision_cache_bytes: int,
        submit: Callable[[Callable[[], None]], Any],
        stream_interval: int = 4,
    ):
        self.model, self.eos_ids = model, eos_ids
        self.tokenizer = fast_decoder(tokenizer)
        self.runner = Qwen2VLRunner(model)
        self.vision_cache = VisionCache(vision_cache_bytes)
        self.embedder = PromptEmbedder(model, self.runner, self.vision_cache)
        vocab = int(model.config.get_text_config().vocab_size)
        self.vocab = vocab
        self.sampler = Sampler(vocab, eos_ids, self.runner.device)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens)
        self._submit = submit  # runs a callable on the model's executor thread
        self._lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._active = False
        self._closed = False
        self._out: list[tuple[Sequence, Any]] = []
        self._threads = 1 if _small(model) and self.runner.device.type == "cpu" else 0
        self.tokens_generated = 0
        self.steps = 0
        self.stream_interval = max(1, stream_interval)  # steps between outputs under load
        self.peak_running = 0  # most rows decoded in one step since start

    # --- called from event loops ---------------------------------------------------------
    def new_sequence(self, prepared: Prepared, loop: Any, queue: Any) -> Sequence:
        req = prepared.request
        seq = Sequence(prepared, loop, queue, req.sampling.max_tokens - len(req.prefix_token_ids))
        seq.run = _Run(prepared, self.tokenizer, lambda chunk: self._emit(seq, chunk))
        return seq

    @property
    def queued(self) -> int:
        """Requests not yet admitted to the running batch."""
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            if self._closed:
                raise ServiceUnavailable("the model is unloading; retry shortly", retry_after=5)
            self._inbox.append(seq)
            start, self._active = not self._active, True
        if start:
            self._submit(self._loop)

    def close(self) -> None:
        """Stop after the current step; rows still queued or running get a 503."""
        with self._lock:
            self._closed = True
            idle = not self._active
        if idle:
            self._abort_all(ServiceUnavailable("the model was unloaded; retry", retry_after=5))

    # --- the loop (engine thread) -----------------------------------------------------------
    def _loop(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        with torch.inference_mode():
            while self._take_inbox():
                try:
                    self.step()
                except Exception as exc:  # a bug or OOM: fail what was in flight, keep serving
                    log.exception("engine step failed; failing %d requests", self.running)
                    self._fail_running(exc)
                busy = len(self.scheduler.running) >= _BUSY_ROWS
                if not busy or self.steps % self.stream_interval == 0:
                    self._flush()
            self._flush()
        if self._closed:
            self.runner.cache.release()
            self._abort_all(ServiceUnavailable("the model was unloaded; retry", retry_after=5))

    def _take_inbox(self) -> bool:
        """Move submitted requests to the scheduler; False (and inactive) when idle."""
        with self._lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
            if self._closed or self.scheduler.idle:
                self._active = False
                if self.runner.cache.nbytes > _KEEP_IDLE_CACHE_BYTES:
                    self.runner.cache.release()  # memory back while idle
                return False
            return True

    def step(self) -> None:
        self._reap_cancelled()
        admitted = self.scheduler.schedule()
        if admitted:
            self._prefill(admitted)
            self._flush()  # first tokens out now, not after the decode step
        running = self.scheduler.running
        if running:
            self.peak_running = max(self.peak_running, len(running))
            self._decode(running)
        self.steps += 1

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self.scheduler.waiting if s.cancelled]:
            self.scheduler.drop_waiting(seq)
            self._out.append((seq, END))
        for seq in [s for s in self.scheduler.running if s.cancelled]:
            self._finish(seq, cancelled=True)

    def _prefill(self, admitted: list[Sequence]) -> None:
        rows: list[PrefillRow] = []
        ready: list[Sequence] = []
        for seq in admitted:
            if seq.max_new <= 0:  # a resumed stream that had already reached max_tokens
                self._finish(seq)
                continue
            try:
                built = self.embedder.build(seq.prepared.inputs, seq.slot)
            except Exception as exc:
                self._fail(seq, exc)
                continue
            seq.rope_delta = built.rope_delta
            self._init_row(seq)
            rows.append(built.row)
            ready.append(seq)
        if not ready:
            return
        for seq, row in zip(ready, rows, strict=True):
            row.slot = seq.slot  # a failed row may have moved the others
        logits = self.runner.prefill(rows)
        for seq in ready:
            seq.length = seq.prompt_len
        self._advance(ready, self.sampler.sample(logits, ready))

    def _init_row(self, seq: Sequence) -> None:
        req = seq.prepared.request
        device = self.runner.device
        if req.sampling.seed is not None and not req.sampling.greedy:
            seq.generator = torch.Generator(device=device)
            seq.generator.manual_seed(req.sampling.seed)
        if req.sampling.repetition_penalty != 1.0:
            seq.seen = torch.zeros(self.vocab, dtype=torch.bool, device=device)
            seq.seen[seq.prepared.inputs["input_ids"][0].to(device)] = True
        if seq.prepared.grammar is not None:
            seq.matcher = seq.prepared.grammar.matcher(prefix=req.prefix_token_ids)

    def _decode(self, running: list[Sequence]) -> None:
        logits = self.runner.decode(
            [s.next_token for s in running],
            [s.length + s.rope_delta for s in running],
            [s.slot for s in running],
            [s.length for s in running],
        )
        for seq in running:
            seq.length += 1
        self._advance(list(running), self.sampler.sample(logits, running))

    def _advance(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Record each row's new token, stream it, and retire rows that are done."""
        for seq, token in zip(seqs, tokens, strict=True):
            try:
                done = self._accept(seq, token)
            except Exception as exc:  # the grammar refused a token: this row only
                self._fail(seq, exc)
                continue
            if done:
                self._finish(seq)

    def _accept(self, seq: Sequence, token: int) -> bool:
        seq.generated += 1
        seq.next_token = token
        if seq.matcher is not None:
            seq.matcher.accept(token)
            seq.grammar_done = seq.matcher.is_terminated()
        if seq.seen is not None:
            seq.seen[token] = True
        seq.run.on_token(token)
        eos = token in self.eos_ids and not seq.sampling.ignore_eos
        return seq.run.stopped or seq.grammar_done or eos or seq.generated >= seq.max_new

    # --- leaving ------------------------------------------------------------------------------
    def _finish(self, seq: Sequence, cancelled: bool = False) -> None:
        seq.run.finish(cancelled, self.eos_ids)
        self._retire(seq)
        self._out.append((seq, END))

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self._retire(seq)
        self._out.append((seq, exc))
        self._out.append((seq, END))

    def _retire(self, seq: Sequence) -> None:
        seq.finished_step = self.steps
        if seq.status is not SeqStatus.RUNNING:
            seq.status = SeqStatus.FINISHED
            return
        old_last = len(self.scheduler.running) - 1
        moved = self.scheduler.remove(seq)
        if moved is not None and moved.length > 0:
            self.runner.cache.move(old_last, moved.slot, moved.length)

    def _fail_running(self, exc: BaseException) -> None:
        for seq in list(self.scheduler.running):
            self._fail(seq, exc)
        self.runner.cache.release()

    def _abort_all(self, exc: BaseException) -> None:
        with self._lock:
            pending = list(self._inbox) + list(self.scheduler.waiting)
            self._inbox.clear()
            self.scheduler.waiting.clear()
        for seq in pending + list(self.scheduler.running):
            self._fail(seq, exc)
        self._flush()

    # --- output -------------------------------------------------------------------------------
    def _emit(self, seq: Sequence, chunk: Chunk) -> None:
        if seq.grammar_done and chunk.finish_reason is not None and not seq.cancelled:
            chunk.finish_reason = FinishReason.STOP  # the grammar is complete
        self.tokens_generated += len(chunk.token_ids)
        self._out.append((seq, chunk))

    def _flush(self) -> None:
        """Deliver this step's outputs: one wake-up per event loop, not one per token."""
        if not self._out:
            return
        by_loop: dict[Any, list[tuple[Any, Any]]] = {}
        for seq, item in self._out:
            by_loop.setdefault(seq.loop, []).append((seq.queue, item))
        self._out = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_deliver, items)

    def vision_cache_stats(self) -> dict[str, int]:
        return self.vision_cache.stats()


def _deliver(items: list[tuple[Any, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _small(model: Any) -> bool:
    """Tiny models: one intra-op thread (fork/join costs more than such matmuls save, and a
    spinning second thread takes the core the event loop needs)."""
    return sum(p.numel() for p in model.parameters()) < _SMALL_MODEL_PARAMS
