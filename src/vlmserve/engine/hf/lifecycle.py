"""What every in-process model shares: state, load/close, memory, and one worker thread."""

from __future__ import annotations

import asyncio
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
        await asyncio.to_thread(self.close)

    def check_ready(self) -> None:
        self._require()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._new_executor()  # threads start lazily: load() may follow
        device = self._loaded.device if self._loaded else None
        self._loaded = None
        self.state = ModelState.UNLOADED
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()

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
