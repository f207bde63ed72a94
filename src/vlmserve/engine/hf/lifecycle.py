"""What every in-process model shares: state, load/close, memory, and one worker thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vlmserve.engine.hf.loading import Loaded, LoadOptions, load_model, memory_bytes
from vlmserve.engine.hf.threads import model_executor, model_threads, pin
from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import ModelState
from vlmserve.errors import ServiceUnavailable

__all__ = ["HFModel", "ModelState"]

log = logging.getLogger(__name__)

RELEASE_WAIT = 10.0  # seconds an unload waits for the model's last step to end


class HFModel(Backend):
    """Base of the ``hf`` backends. Work on the model runs on one dedicated thread, so the
    event loop stays free and the model sees one batch at a time."""

    thread_prefix = "model"

    def __init__(self, model_id: str, options: LoadOptions):
        self.model_id = model_id
        self.options = options
        self.state = ModelState.UNLOADED
        self.error: str | None = None
        self.load_seconds: float | None = None
        self._loaded: Loaded | None = None
        self._executor = self._new_executor()
        self._releasing: threading.Thread | None = None  # returning the memory after close()

    def _new_executor(self) -> ThreadPoolExecutor:
        return model_executor(f"{self.thread_prefix}-{self.model_id}")

    def _load(self) -> Loaded:
        """Build the loaded model; subclasses add steps (an adapter, say)."""
        return load_model(self.options)

    def load(self) -> None:
        """Blocking load (call from a thread). Failures are kept in ``state``/``error`` and
        re-raised."""
        self.state, self.error = ModelState.LOADING, None
        started = time.perf_counter()
        try:
            loaded = self._load()
        except Exception as exc:
            self.state, self.error = ModelState.FAILED, str(exc)
            raise
        self._loaded = loaded
        self.load_seconds = time.perf_counter() - started
        # before any request's work (the executor is first in, first out)
        self._executor.submit(pin, model_threads(loaded.model, loaded.device))
        self.state = ModelState.READY

    async def aload(self) -> None:
        """Load on the model's own thread: its torch thread team is the one the steps use
        (``threads.py``)."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.load)

    async def aclose(self) -> None:
        """Unload and wait (at most ``RELEASE_WAIT``) until the memory is returned, so that a
        model loaded next (the LRU swap of ``VLMSERVE_MAX_LOADED_MODELS``) finds it free."""
        await asyncio.to_thread(self.close)
        releasing = self._releasing
        if releasing is not None:
            await asyncio.to_thread(releasing.join, RELEASE_WAIT)
            if releasing.is_alive():
                log.warning(
                    "model %s: its thread is still in a step after %.0f s; its memory is "
                    "returned when that step ends",
                    self.model_id,
                    RELEASE_WAIT,
                )

    def check_ready(self) -> None:
        self._require()

    def close(self) -> None:
        """Unload: no new work; the memory is returned once the model's thread has finished
        its last step (``release``)."""
        executor = self._executor
        executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._new_executor()  # threads start lazily: load() may follow
        device = self._loaded.device if self._loaded else None
        self._loaded = None
        self.state = ModelState.UNLOADED
        self._releasing = None
        if device is not None:
            args = (executor, device)
            self._releasing = threading.Thread(target=release, args=args, daemon=True)
            self._releasing.start()

    @property
    def memory_bytes(self) -> int:
        return memory_bytes(self._loaded.model) if self._loaded else 0

    @property
    def processor(self) -> Any:
        return self._require().processor

    def _require(self) -> Loaded:
        if self._loaded is None or self.state is not ModelState.READY:
            msg = f"model {self.model_id!r} is {self.state.value}"
            if self.error:
                msg += f": {self.error}"
            raise ServiceUnavailable(msg + "; retry shortly", retry_after=5)
        return self._loaded


def release(executor: ThreadPoolExecutor, device: torch.device) -> None:
    """Return an unloaded model's memory: once its thread's last step has ended (the engine,
    held by nothing else, goes with it), the allocator's cached blocks on CUDA."""
    executor.shutdown(wait=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
