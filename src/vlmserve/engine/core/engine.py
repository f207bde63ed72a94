"""The continuous-batching loop: one thread, one step at a time, rows joining and leaving.

A step (nano-vllm's ``LLMEngine.step``): drop cancelled rows -> admit waiting requests whose
KV blocks fit (``Scheduler``) and prefill them together, vision tower included -> make room
for every row's next token, preempting the newest rows when blocks run out -> one decode
forward for every running row -> sample all rows at once -> hand each row's tokens to its
consumer -> finished rows leave (their KV blocks are reused at once). A preempted row is
recomputed when readmitted (``paging.py``): its KV and next tokens are exactly those of an
uninterrupted run, and nothing is emitted twice. Outputs of a step reach each event loop in
one ``call_soon_threadsafe``. The loop runs on the model's executor thread
while there is work and returns when the engine is idle; ``submit`` restarts it.

Failures (``faults.py``): a batched forward that raises is retried row by row, so one
poison request fails alone; anything else that raises in the loop (or the loop's thread
ending with requests in flight) is fatal: every request still in flight ends with
``EngineFailed`` at once and ``on_fatal`` tells the owner, which marks the model failed and
reloads it. A failed engine refuses new requests; it is never used again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

import torch

from vlmserve.engine.configs import ChatEngineConfig, batched_tokens
from vlmserve.engine.core.choices import fork
from vlmserve.engine.core.detok_fast import fast_decoder
from vlmserve.engine.core.faults import (
    EngineFailed,
    EngineStateError,
    out_of_memory,
    request_error,
    retry_alone,
)
from vlmserve.engine.core.gauges import EngineGauges, StepTimer
from vlmserve.engine.core.handoff import Handoff
from vlmserve.engine.core.kv_cache import DEFAULT_BLOCK_SIZE
from vlmserve.engine.core.lifecycle import EngineLifecycle, weakly
from vlmserve.engine.core.outbox import END
from vlmserve.engine.core.pacing import Pacing
from vlmserve.engine.core.paging import build_paging
from vlmserve.engine.core.prefix import block_hashes
from vlmserve.engine.core.sampler import Sampler
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import SeqStatus, Sequence
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.hf.threads import model_threads
from vlmserve.engine.models.architectures import build
from vlmserve.engine.models.batch import DecodeRows, PrefillRow
from vlmserve.engine.models.vision_cache import VisionCache

__all__ = ["END", "BatchEngine"]

log = logging.getLogger(__name__)
# With this many rows decoding, outputs go to the event loops every `stream_interval` steps:
# the consumers then merge that many tokens per SSE event, dividing the event loop's per-token
# work (which shares the GIL with this thread) at the cost of tokens arriving in groups.
_BUSY_ROWS = 4
# ... but no output waits longer than this for its group: where a step takes this long (long
# contexts, a larger model) the loop's per-token work is small beside it, and grouping would
# only multiply the inter-token latency clients see
GROUP_WAIT_S = 0.010
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


class BatchEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        eos_ids: set[int],
        config: ChatEngineConfig,
        *,
        submit: Callable[[Callable[[], None]], Any],
        model_id: str = "model",
        on_fatal: Callable[[BaseException, Any], None] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        """``config``: the model's engine settings (``ChatEngineConfig``); ``submit`` runs
        a callable on the model's thread; ``on_fatal(cause, loop)``: the engine failed."""
        c = config
        self.model, self.eos_ids = model, eos_ids
        self.tokenizer = fast_decoder(tokenizer)
        self.vision_cache = VisionCache(c.vision_cache_bytes)
        self.runner, self.embedder = build(model, self.vision_cache)
        budget = batched_tokens(c.max_num_batched_tokens, self.runner.device.type)
        self.config = c = replace(c, max_num_batched_tokens=budget)
        vocab = int(model.config.get_text_config().vocab_size)
        self.vocab = vocab
        self.sampler = Sampler(vocab, eos_ids, c.logprobs_mode)
        # a prompt longer than chunk_size is computed in chunks of it, one per step
        self.chunk_size = budget
        self._threads = model_threads(model, self.runner.device)
        self.paging, self.decode_mode = build_paging(self.runner, c, block_size)
        log.info("%s: decode runs with %s", model_id, self.decode_mode)
        self.kv, self.blocks = self.paging.budget, self.paging.blocks
        self.scheduler = Scheduler(c.max_num_seqs, budget, self.blocks)
        self.pacing = Pacing(c.decode_share)  # prefill steps spaced for the streams' decode
        self.scheduler.prefix_hasher = weakly(self._block_hashes)
        self.model_id = model_id  # in messages
        self.handoff = Handoff(  # rows made, given their tokens, retired; their outputs
            self.scheduler, self.tokenizer, tokenizer, vocab, eos_ids, weakly(self._step_count)
        )
        self.lifecycle = EngineLifecycle(  # the engine thread: submit, close, the fatal path
            model_id,
            self.scheduler,
            self.handoff.outbox,
            submit=submit,
            run=weakly(self._run),
            fail=self.handoff.fail,
            flush=weakly(self._flush),
            release=weakly(self._release_cache),
            on_fatal=on_fatal,
        )
        self._forked: list[tuple[Sequence, int]] = []  # choices forked this step, first tokens
        self.steps = 0
        self.stream_interval = max(1, c.stream_interval)  # steps between outputs under load
        self.peak_running = 0  # most rows decoded in one step since start
        self.timer = StepTimer()  # step seconds by phase (/metrics)
        self.prefilled_rows = 0  # prompts prefilled (a recomputed row counts again)
        self.forked_rows = 0  # choices (n > 1) started from a copy of their head's prompt KV
        # what /metrics reads off the engine, from any thread
        inbox = self.lifecycle.inbox
        self.gauges = EngineGauges(
            self.scheduler, self.kv, self.blocks, self.vision_cache, inbox, self.timer
        )

    # --- the engine thread and its failure path (``lifecycle.py``) ---------------------------
    def submit(self, seq: Sequence) -> None:
        self.lifecycle.submit(seq)

    def close(self) -> None:
        """Stop after the current step; rows still queued or running get a 503."""
        self.lifecycle.close()

    def stalled_for(self) -> float:
        """Seconds with requests to run but no step starting or ending; 0 when idle."""
        return self.lifecycle.stalled_for()

    def declare_stalled(self, seconds: float) -> None:
        """From any thread: the engine is stuck; fail it as a fatal error would."""
        self.lifecycle.declare_stalled(seconds)

    @property
    def failure(self) -> EngineFailed | None:
        """Why the engine became unusable (set once); None while it serves."""
        return self.lifecycle.failure

    @property
    def progress_at(self) -> float:
        """When a step last started or ended, or the loop was started (monotonic s)."""
        return self.lifecycle.progress_at

    @property
    def longest_step(self) -> float:
        """The longest step so far (seconds)."""
        return self.lifecycle.longest_step

    def call(self, fn: Callable[[], _Result]) -> Future[_Result]:
        """Run ``fn`` on the engine thread between steps (``EngineLifecycle.call``): prefill-
        only work such as scoring, which shares the runner and the vision cache."""
        return self.lifecycle.call(fn)

    # --- called from event loops ---------------------------------------------------------
    def new_sequence(self, prepared: Prepared, loop: Any, queue: Any) -> Sequence:
        """Choice 0 of a request; the others ride on it until its prefill (``choices.py``)."""
        return self.handoff.new_sequence(prepared, loop, queue)

    # --- the loop (engine thread) -----------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # as HFModel pins it (engines built directly too)
        flushed = time.perf_counter()
        with torch.inference_mode():
            while self.lifecycle.take_inbox():
                self.lifecycle.run_calls()  # work queued with ``call``, between two steps
                if self.scheduler.idle:
                    continue
                self.lifecycle.run_step(self.step)
                busy = len(self.scheduler.running) >= _BUSY_ROWS
                now = time.perf_counter()
                if (
                    not busy
                    or self.steps % self.stream_interval == 0
                    or (now - flushed >= GROUP_WAIT_S)
                ):
                    self._flush()
                    flushed = now
            self._flush()

    def step(self) -> None:
        self._reap_cancelled()
        self._refuse_oversized()
        # Where the runner can (not CUDA's graph-captured decode), the rows already decoding
        # ride in the newcomers' prefill forward: room for their tokens is made first.
        mixing = self.runner.mixes and any(s.chunk_row is None for s in self.scheduler.running)
        preempted = self.scheduler.reserve_decode() if mixing else []
        decoding = [s for s in self.scheduler.running if s.chunk_row is None] if mixing else []
        streams = sum(1 for s in self.scheduler.running if s.chunk_row is None)
        chunking = len(self.scheduler.running) - streams
        held = self.pacing.hold(streams, len(self.scheduler.waiting) + chunking)
        continuing, used = self.scheduler.continuing(self.chunk_size) if not held else ([], 0)
        admitted = self.scheduler.schedule(used) if not held else []
        if admitted or continuing:
            with self.timer.phase("vision"):
                ready = self._start_rows(admitted)
            ready += [(seq, seq.chunk_row) for seq in continuing]
            if ready:
                size = self.chunk_size
                ready = [(seq, self.paging.next_chunk(seq, row, size)) for seq, row in ready]
                self.peak_running = max(self.peak_running, len(decoding))
                started = time.perf_counter()
                with self.timer.phase("prefill"):
                    items, tokens = self._forward(self._prefill_forward, [*decoding, *ready])
                self.pacing.prefilled(time.perf_counter() - started, streams)
                self.handoff.advance([_seq(item) for item in items], tokens)
                forked, self._forked = self._forked, []  # other choices of those rows (n > 1)
                self.handoff.advance([seq for seq, _ in forked], [token for _, token in forked])
                decoding = []  # they have their token of this step
            self._flush()  # first tokens out now, not after the decode step
        if not mixing:
            preempted = self.scheduler.reserve_decode()  # may preempt the newest rows
            decoding = [seq for seq in self.scheduler.running if seq.chunk_row is None]
        running = [s for s in decoding if s.status is SeqStatus.RUNNING]
        if running:
            self.peak_running = max(self.peak_running, len(running))
            started = time.perf_counter()
            with self.timer.phase("decode"):
                decoded = self._forward(self._decode_forward, running)
            self.pacing.decoded(time.perf_counter() - started)
            self.handoff.advance(*decoded)
        elif not (admitted or continuing or preempted or held) and self.scheduler.waiting:
            raise EngineStateError(
                f"the scheduler admitted none of {len(self.scheduler.waiting)} waiting "
                "requests while no row runs"
            )
        self._check()
        self.steps += 1

    def _check(self) -> None:
        """Running rows are slots 0..B-1, in order, each RUNNING once (O(B) per step)."""
        for i, seq in enumerate(self.scheduler.running):
            if seq.slot != i or seq.status is not SeqStatus.RUNNING:
                raise EngineStateError(
                    f"running row {i} holds slot {seq.slot} in state {seq.status.value}"
                )

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self.scheduler.waiting if s.cancelled_now]:
            self.scheduler.drop_waiting(seq)
            if seq.output_ids:  # preempted after streaming: its stream ends as any other
                self.handoff.finish(seq, cancelled=True)
            else:
                self.handoff.end(seq)
        for seq in [s for s in self.scheduler.running if s.cancelled_now]:
            self.handoff.finish(seq, cancelled=True)

    def _refuse_oversized(self) -> None:
        for seq, exc in self.paging.oversized(self.scheduler.waiting):
            self.scheduler.drop_waiting(seq)
            self.handoff.fail(seq, exc)

    def _start_rows(self, admitted: list[Sequence]) -> list[tuple[Sequence, PrefillRow]]:
        """Embed each admitted prompt (vision tower included); a row whose input fails here
        fails alone."""
        ready: list[tuple[Sequence, PrefillRow]] = []
        for seq in admitted:
            if seq.max_new <= 0:  # a resumed stream that had already reached max_tokens
                self.handoff.finish(seq)
                continue
            try:
                started = time.perf_counter()
                seq.scheduled_at = seq.scheduled_at or started
                built = self.embedder.build(seq.prepared.inputs, seq.slot)
                seq.vision_s += time.perf_counter() - started
                seq.rope_delta = built.rope_delta
                seq.prefilled = seq.cached  # the prompt is computed from here on
                if not seq.output_ids:  # a recomputed row keeps its RNG, grammar, penalty
                    seq.start_sampling(self.vocab, self.runner.device)
            except Exception as exc:
                log.exception("request %s: its input failed to embed", _rid(seq))
                self.handoff.fail(seq, request_error(exc))
                continue
            ready.append((seq, built.row))
        return ready

    def _forward(
        self, forward: Callable[[list[_Item]], list[int]], items: list[_Item]
    ) -> tuple[list[Any], list[int]]:
        """A batched forward + sampling -> (rows, their tokens); on an error, each row
        alone (``faults.retry_alone``): a row that fails alone too fails by itself."""
        try:
            return items, forward(items)
        except Exception as exc:
            self._after_oom(exc)
            return retry_alone(forward, items, exc, self._fail_alone)

    def _after_oom(self, exc: BaseException) -> None:
        """After a failed allocation on CUDA, give the allocator's cached blocks back so the
        retries (each row alone) start from unfragmented memory."""
        if out_of_memory(exc) and self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fail_alone(self, item: Any, exc: BaseException) -> bool:
        """Fail a row found to be the cause; False when it had already left the batch."""
        self._after_oom(exc)
        seq = item[0] if isinstance(item, tuple) else item
        if seq.status is not SeqStatus.RUNNING:
            return False
        log.error("request %s fails alone too: failing it", _rid(seq), exc_info=exc)
        self.handoff.fail(seq, request_error(exc))
        return True

    def _block_hashes(self, seq: Sequence) -> list[bytes]:
        """The prefix-cache keys of ``seq``'s full prompt blocks (``prefix.py``)."""
        inputs = seq.prepared.inputs
        media = self.embedder.media_signature(inputs)
        salt = seq.prepared.request.cache_salt
        return block_hashes(inputs["input_ids"][0].tolist(), self.blocks.block_size, media, salt)

    def _prefill_forward(self, items: list[Sequence | tuple[Sequence, PrefillRow]]) -> list[int]:
        """Prompts (or this step's chunks of long ones), and running rows (``Sequence``
        items, first) decoding in the same forward -> the decode rows' next tokens and the
        first tokens of the rows whose prompt this completes (``NOT_SAMPLED`` for others)."""
        decode = [item for item in items if isinstance(item, Sequence)]
        prefill = [item for item in items if not isinstance(item, Sequence)]
        if not prefill:  # a decode row retried alone
            return self._decode_forward(decode)
        for seq, row in prefill:
            row.slots = self.paging.prompt_slots(seq)
        logits = self.runner.step([row for _, row in prefill], self._decode_rows(decode))
        seqs = [seq for seq, _ in prefill]
        b = len(decode)
        heads = [i for i, seq in enumerate(seqs) if seq.pending and not seq.prefilling]
        # [h, V]: the sampler edits logits
        shared = logits[[b + i for i in heads]].clone() if heads else None
        tokens = self.paging.sample(self.sampler, logits, [*decode, *seqs])
        for seq in decode:  # only now: a failed attempt leaves nothing to undo
            self.paging.after_decode(seq)
        for seq in seqs:
            if self.paging.chunk_done(seq):  # its whole prompt is in: it decodes next step
                self.prefilled_rows += 1
                self.paging.prompt_done(seq)
        if shared is not None:  # start their other choices; first tokens accepted in `step`
            heads_ = [seqs[i] for i in heads]
            forked, failed = fork(self.scheduler, self.paging, self.sampler, heads_, shared)
            for seq, exc in failed:
                self.handoff.fail(seq, request_error(exc))
            self.forked_rows += len(forked)
            self._forked.extend(forked)
        return tokens

    def _decode_rows(self, running: list[Sequence]) -> DecodeRows | None:
        if not running:
            return None
        return DecodeRows(
            [s.next_token for s in running],
            [s.length + s.rope_delta for s in running],
            [s.length for s in running],
            [s.block_table for s in running],
        )

    def _decode_forward(self, running: list[Sequence]) -> list[int]:
        self.paging.clear_fresh()
        rows = self._decode_rows(running)
        assert rows is not None
        logits = self.runner.decode(rows.tokens, rows.positions, rows.lengths, rows.tables)
        tokens = self.paging.sample(self.sampler, logits, running)
        for seq in running:  # only now: a failed attempt leaves nothing to undo
            self.paging.after_decode(seq)
        return tokens

    # --- output (``handoff.py`` collects a step's, ``_flush`` delivers them) -----------------
    @property
    def tokens_generated(self) -> int:
        """Tokens handed to consumers since start."""
        return self.handoff.tokens_generated

    def _flush(self) -> None:
        """Deliver this step's outputs: one wake-up per event loop, not one per token."""
        self.lifecycle.delivered(self.handoff.outbox.flush())

    def _step_count(self) -> int:
        return self.steps

    def _release_cache(self) -> None:
        if self.runner.cache is not None:
            self.runner.cache.release()


def _seq(item: Sequence | tuple[Sequence, Any]) -> Sequence:
    return item if isinstance(item, Sequence) else item[0]


def _rid(seq: Sequence) -> str:
    return seq.prepared.request.request_id
