"""OpenAI's Batch API: JSONL files of chat, responses or embeddings requests, run in the
background below interactive traffic (``batches_run``), each batch owned by its API key.

A batch must finish within its completion window (``24h``, the only one OpenAI offers; its
``expires_at``); what has not run by then is ``batch_expired`` and the batch ``expired``
(``batches_run``), also when the server was down at that time.

The batch object is stored (``FilesStore``) at every change of state; ``request_counts`` are
read from the stored line results, so they are right while it runs and after a restart.
``start`` (the app's start-up) resumes every unfinished batch; ``stop`` cancels the runs and
leaves their stored state for the next start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from vlmserve.api.endpoints.batches.lines import Endpoints
from vlmserve.api.endpoints.batches.protocol import BatchCreate
from vlmserve.api.endpoints.batches.run import TERMINAL, BatchRun, Priority, stop_runs
from vlmserve.api.endpoints.files.service import FilesService
from vlmserve.errors import InvalidRequest, NotFound
from vlmserve.registry.manager import ModelManager

__all__ = ["WINDOW_SECONDS", "BatchesService"]

log = logging.getLogger(__name__)

WINDOW_SECONDS = {"24h": 24 * 3600.0}  # completion_window -> seconds
_SWEEP_SECONDS = 300.0


def interactive_waiting(models: ModelManager, batch_lines: int) -> bool:
    """True while more requests wait for a model (queued, or admitted but not yet decoding)
    than there are batch lines in flight: an interactive request is waiting."""
    waiting = 0
    for handle in models.handles:
        stats = handle.backend.stats()
        if stats.running is not None:
            waiting += max(stats.waiting or 0, handle.in_flight - stats.running)
    return waiting > batch_lines


class BatchesService:
    def __init__(
        self,
        files: FilesService,
        endpoints: Endpoints,
        *,
        max_concurrency: int,
        models: ModelManager | None = None,
        max_unfinished: int = 16,
    ):
        self.files = files
        self.store = files.store
        self.endpoints = endpoints
        self.window_seconds = dict(WINDOW_SECONDS)  # shorter in tests of expiry
        self._max_concurrency = max_concurrency
        self.max_unfinished = max_unfinished  # per owner
        self._models = models
        self._priority: Priority | None = None  # made on the app's event loop
        self._runs: dict[str, tuple[BatchRun, asyncio.Task[None]]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.on_line: Callable[[str, str], None] | None = None  # (batch id, custom_id): tests

    # -- the runs ---------------------------------------------------------------------------

    def _priority_now(self) -> Priority:
        if self._priority is None:
            models = self._models
            busy = None if models is None else functools.partial(interactive_waiting, models)
            self._priority = Priority(self._max_concurrency, busy)
        return self._priority

    def _launch(self, owner: str, batch_id: str) -> None:
        run = BatchRun(
            owner, batch_id, self.files, self.endpoints, self._priority_now(), on_line=self.on_line
        )
        task = asyncio.create_task(run.run(), name=f"batch {batch_id}")
        self._runs[batch_id] = (run, task)
        task.add_done_callback(lambda _: self._runs.pop(batch_id, None))

    async def start(self, ready: Awaitable[Any] | None = None) -> None:
        """Resume the unfinished batches (after ``ready``: the models' loading)."""
        if ready is not None:
            await ready
        for owner, batch in self.store.unfinished_batches():
            if batch["id"] not in self._runs:
                log.info("resuming batch %s (%s)", batch["id"], batch["status"])
                self._launch(owner, batch["id"])
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            self.files.sweep()
            await asyncio.sleep(_SWEEP_SECONDS)

    async def stop(self) -> None:
        tasks = [task for _, task in self._runs.values()]
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        await stop_runs(tasks)
        self._runs.clear()
        self.store.close()

    async def wait(self, batch_id: str) -> None:
        """Until the batch's run (if any, here) has ended."""
        found = self._runs.get(batch_id)
        if found is not None:
            await asyncio.shield(found[1])

    # -- the API ----------------------------------------------------------------------------

    def create(self, owner: str, body: BatchCreate) -> dict[str, Any]:
        source = self.files.get(owner, body.input_file_id, param="input_file_id")
        if source.purpose != "batch":
            raise InvalidRequest(
                f"file {source.id!r} has purpose {source.purpose!r}; a batch's input file is "
                "uploaded with purpose 'batch'",
                param="input_file_id",
            )
        unfinished = self.store.unfinished_count(owner)
        if unfinished >= self.max_unfinished:
            raise InvalidRequest(
                f"this API key has {unfinished} unfinished batches, the limit "
                f"(VLMSERVE_BATCH_MAX_UNFINISHED); wait for one to finish or cancel one",
                code="batch_quota_exceeded",
            )
        self.files.check_room(owner)
        now = int(time.time())
        window = self.window_seconds[body.completion_window]
        batch = {
            "id": f"batch_{uuid.uuid4().hex}",
            "object": "batch",
            "endpoint": body.endpoint,
            "errors": None,
            "input_file_id": source.id,
            "completion_window": body.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + int(window),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.metadata,
        }
        self.store.pin(batch["id"], source.id)  # deleting the file loses none of its lines
        self.store.put_batch(owner, batch, self.files.expires_at(now))
        self._launch(owner, batch["id"])
        return batch

    def _get(self, owner: str, batch_id: str) -> dict[str, Any]:
        found = self.store.batch(batch_id, owner) if len(batch_id) <= 128 else None
        if found is None:
            raise NotFound(
                f"no batch {batch_id!r} (unknown, expired, or another API key's)",
                param="batch_id",
                code="batch_not_found",
            )
        return self._counted(found[1])

    def _counted(self, batch: dict[str, Any]) -> dict[str, Any]:
        if batch["status"] in ("in_progress", "finalizing", "cancelling"):
            completed, failed = self.store.line_counts(batch["id"])
            batch["request_counts"] = {
                **batch["request_counts"],
                "completed": completed,
                "failed": failed,
            }
        return batch

    def retrieve(self, owner: str, batch_id: str) -> dict[str, Any]:
        return self._get(owner, batch_id)

    def list(self, owner: str, limit: int, after: str | None) -> dict[str, Any]:
        rows = [self._counted(b) for b in self.store.batches(owner, limit + 1, after)]
        data = rows[:limit]
        return {
            "object": "list",
            "data": data,
            "has_more": len(rows) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    async def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        """Stop dispatching lines; lines in flight are stopped; the results so far are kept
        (output and error files), then ``cancelled``. A finished batch is returned as is."""
        batch = self._get(owner, batch_id)
        if batch["status"] in (*TERMINAL, "cancelling"):
            return batch
        batch = {**batch, "status": "cancelling", "cancelling_at": int(time.time())}
        self.store.save_batch(batch)
        found = self._runs.get(batch_id)
        if found is not None:
            found[0].cancel()
        else:  # not running here (never started, or its run ended): finish the cancel now
            self._launch(owner, batch_id)
        return batch
