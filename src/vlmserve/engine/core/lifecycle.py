"""The engine's thread and its failure path: start the loop on submit, stop on close, and
end every request at once when the engine fails (``faults.py`` says what is fatal).

``EngineLifecycle`` is a part of ``BatchEngine`` (``engine.lifecycle``), built with the
callables it drives: the engine's step loop (``run``), failing one request (``fail``),
delivering a step's outputs (``flush``) and freeing the KV cache (``release``). It owns the
state the engine thread shares with the event loops (the inbox, the requests in flight, the
failure) behind one lock; the step logic is in ``engine.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from vlmserve.engine.core.faults import EngineFailed, EngineStalled
from vlmserve.engine.core.outbox import END, Outbox, deliver
from vlmserve.engine.core.scheduler import Scheduler
from vlmserve.engine.core.sequence import SeqStatus, Sequence
from vlmserve.errors import ServiceUnavailable

__all__ = ["EngineLifecycle", "weakly"]

log = logging.getLogger("vlmserve.engine.core.engine")


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) called through a weak reference to its object.

    The engine's parts call back into it (its step loop, the prefix hasher, the step count);
    held strongly, those callbacks close a reference cycle around the engine, and with it the
    model and the KV cache, which only a full collection of the heap frees: seconds on a large
    heap, and maybe long after an unload. Held weakly, an unloaded engine is freed as soon as
    its last step ends."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError("the engine was freed")
        return bound(*args, **kwargs)

    return call


class EngineLifecycle:
    """Thread and failure handling of one engine; ``run`` is its step loop."""

    def __init__(
        self,
        model_id: str,
        scheduler: Scheduler,
        outbox: Outbox,
        *,
        submit: Callable[[Callable[[], None]], Any],
        run: Callable[[], None],
        fail: Callable[[Sequence, BaseException], None],
        flush: Callable[[], None],
        release: Callable[[], None],
        on_fatal: Callable[[BaseException, Any], None] | None = None,
    ) -> None:
        """``submit`` runs a callable on the model's executor thread; ``run`` steps until
        ``take_inbox`` finds the engine idle; ``on_fatal(cause, loop)`` tells the owner
        that the engine failed (``loop``: an event loop of a failed request, or None)."""
        self.model_id = model_id  # in messages
        self._scheduler, self._outbox = scheduler, outbox
        self._submit, self._run, self._fail = submit, run, fail
        self._flush, self._release, self._on_fatal = flush, release, on_fatal
        self._lock = threading.Lock()
        self.inbox: deque[Sequence] = deque()  # submitted, not yet taken by the engine thread
        # work besides the steps (``call``), run on the engine thread between steps
        self.calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._live: set[Sequence] = set()  # END not yet delivered: a fatal error ends these
        self._active = False
        self._closed = False
        self.failure: EngineFailed | None = None  # set once, when the engine became unusable
        # liveness: when a step last started or ended (or the loop was started), and the
        # longest step so far (monotonic seconds; written by the engine thread)
        self.progress_at = 0.0
        self.longest_step = 0.0

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            self._check_open()
            self.inbox.append(seq)
            self._live.add(seq)
            start = self._activate()
        if start:
            self._start()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the engine thread between two steps (at once when idle): work that
        shares the engine's model state (its vision cache) without a lock. Its result, or the
        error it raised, goes to the future; an engine that fails or closes first fails it."""
        future: Future[Any] = Future()
        with self._lock:
            self._check_open()
            self.calls.append((fn, future))
            start = self._activate()
        if start:
            self._start()
        return future

    def _check_open(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise ServiceUnavailable("the model is unloading; retry shortly", retry_after=5)

    def _activate(self) -> bool:
        """(Under the lock) mark the loop active; True when it has to be started."""
        start, self._active = not self._active, True
        if start:
            self.progress_at = time.monotonic()  # the loop's first step is due now
        return start

    def _start(self) -> None:
        try:
            future = self._submit(self._loop)
        except Exception as exc:  # the executor is shut down: nothing will ever run
            self._die(exc)
            raise self.failure or exc from exc
        if hasattr(future, "add_done_callback"):
            future.add_done_callback(self._loop_ended)

    def stalled_for(self) -> float:
        """Seconds the engine has had requests to run without a step starting or ending
        (a step in progress counts as progress until then); 0 when it has none."""
        if not self._active or self._closed or self.failure is not None:
            return 0.0
        return time.monotonic() - self.progress_at

    def declare_stalled(self, seconds: float) -> None:
        """From any thread: the engine is stuck; fail it as a fatal error would (its
        requests end with a 503, the owner reloads the model)."""
        self._die(EngineStalled(seconds, self.longest_step))

    def close(self) -> None:
        """Stop after the current step; rows still queued or running get a 503."""
        with self._lock:
            self._closed = True
            idle = not self._active and self.failure is None  # a failed engine ended them all
        if idle:
            self._abort_all(_unloaded())

    # --- called by the step loop (engine thread) ---------------------------------------------
    def take_inbox(self) -> bool:
        """Move submitted requests to the scheduler; False (and inactive) when idle."""
        with self._lock:
            while self.inbox:
                self._scheduler.add(self.inbox.popleft())
            if self._closed or (self._scheduler.idle and not self.calls):
                self._active = False
                return False
            return True

    def run_calls(self) -> None:
        """Run the ``call``s queued so far (engine thread); each counts as a step for the
        liveness check."""
        while True:
            with self._lock:
                if not self.calls:
                    return
                fn, future = self.calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            self.progress_at = time.monotonic()
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's error, not the engine's
                future.set_exception(exc)
            self.progress_at = time.monotonic()

    def run_step(self, step: Callable[[], None]) -> None:
        """Run one step, recording its progress for the liveness check."""
        self.progress_at = started = time.monotonic()
        step()
        self.progress_at = time.monotonic()
        self.longest_step = max(self.longest_step, self.progress_at - started)

    def delivered(self, seqs: Iterable[Sequence]) -> None:
        """These requests' ``END`` went out: a fatal error no longer has them to end."""
        for seq in seqs:
            self._live.discard(seq)

    # --- the loop's start and end, and failing -----------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
            if self._closed:
                self._release()
                self._abort_all(_unloaded())
        except ReferenceError:
            if not self._closed:
                raise
            # unloaded with rows still in it (a stream stopped a moment before), and the
            # engine freed meanwhile: they end as an unload, not as a failure
            self._end_live(_unloaded())
        except BaseException as exc:  # outside a forward: the engine's state is not trusted
            self._die(exc)

    def _loop_ended(self, future: Any) -> None:
        """The loop's future is done. ``_loop`` handles its own errors, so this only acts
        when the loop never ran (cancelled by an executor shutdown) or escaped anyway."""
        cause = RuntimeError("the engine loop was cancelled before it ran")
        if not future.cancelled():
            cause = future.exception()
            if cause is None:
                return
        if self._closed:
            self._abort_all(_unloaded())
        else:
            self._die(cause)

    def _abort_all(self, exc: BaseException) -> None:
        with self._lock:
            pending = list(self.inbox) + list(self._scheduler.waiting)
            self.inbox.clear()
            _fail_calls(self.calls, exc)
            self._scheduler.waiting.clear()
        for seq in pending + list(self._scheduler.running):
            self._fail(seq, exc)
        self._flush()

    def _die(self, cause: BaseException) -> None:
        """Fatal: end every request in flight with ``EngineFailed`` now, refuse new ones and
        tell the owner. Touches nothing but the lock and the requests' queues, since the
        rest of the engine may be what broke."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = EngineFailed(self.model_id, cause)
            self._active = False
            live = [*self._live]
        log.error(
            "%s: the engine failed; ending its %d requests",
            self.model_id,
            len(live),
            exc_info=cause,
        )
        if self._on_fatal is not None and not self._closed:  # closing: no reload wanted
            try:  # first, so that a client retrying at once finds the model failed
                self._on_fatal(cause, live[0].loop if live else None)
            except Exception:
                log.exception("%s: the engine failure handler failed", self.model_id)
        self._end_live(self.failure)
        with contextlib.suppress(Exception):
            self._release()

    def _end_live(self, error: BaseException) -> None:
        """End every request in flight with ``error`` through its own queue only (nothing of
        the engine is touched: it may be broken or freed); calls not run fail with it."""
        with self._lock:
            self._active = False
            live = [*self._live]
            self._live.clear()
            self.inbox.clear()
            _fail_calls(self.calls, error)
        self._outbox.clear()
        for seq in live:
            seq.status = SeqStatus.FINISHED
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                seq.loop.call_soon_threadsafe(deliver, [(seq.queue, error), (seq.queue, END)])


def _unloaded() -> ServiceUnavailable:
    return ServiceUnavailable("the model was unloaded; retry", retry_after=5)


def _fail_calls(calls: deque[tuple[Callable[[], Any], Future[Any]]], exc: BaseException) -> None:
    """(Under the lock) fail the ``call``s that have not run."""
    while calls:
        _, future = calls.popleft()
        if future.set_running_or_notify_cancel():
            future.set_exception(exc)
