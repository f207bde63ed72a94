"""The work of one batch, as a task on the app's event loop.

    validating   the input file (the batch's pinned copy) is checked line by line in a worker
                 thread, keeping each line's offset (a bad file: failed)
    in_progress  the lines without a stored result run, at most ``batch_max_concurrency`` in
                 flight across all batches; each result is stored as its line finishes
    finalizing   the output and error files are written from the stored results, row by row
                 in a worker thread
    completed    (or cancelled, after cancelling; failed for a bad input file; expired when
                 ``expires_at``, the end of the 24h completion window, passes first: the lines
                 in flight are stopped, and every line without a result is a ``batch_expired``
                 entry of the error file, as OpenAI writes them)

Started again from the stored state when the server starts: the lines already done are not
run again, and the output files have ids derived from the batch's, so writing them twice is
harmless. Transient refusals (a model loading: 503, a full queue: 429) are retried with a
back-off, not written as errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmserve.api.endpoints.batches.input import (
    BatchLine,
    LineIndex,
    LineRequest,
    read_request,
    scan_input,
)
from vlmserve.api.endpoints.batches.lines import Endpoints, error_result, expired_result, ok_result
from vlmserve.api.endpoints.files.service import FilesService
from vlmserve.api.endpoints.files.store import LineResult
from vlmserve.errors import Overloaded, ServiceUnavailable, VlmserveError

__all__ = ["TERMINAL", "BatchRun", "Priority", "stop_runs"]

log = logging.getLogger(__name__)

_RETRIES = 6  # tries of a line refused with 503/429 before it is an error line
TERMINAL = ("completed", "failed", "cancelled", "expired")


@dataclass(slots=True)
class Priority:
    """Batch lines run below interactive traffic: at most ``limit`` in flight (all batches),
    and while ``busy(batch_lines_in_flight)`` says interactive requests are waiting for a
    model, a line about to start waits (up to ``max_wait`` seconds) for them to go first."""

    limit: int
    busy: Callable[[int], bool] | None = None
    max_wait: float = 2.0
    in_flight: int = 0
    slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.limit)

    async def admit(self) -> None:
        await self.slots.acquire()
        deadline = time.monotonic() + self.max_wait
        try:
            while self.busy is not None and self.busy(self.in_flight):
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.02)
        except BaseException:
            self.slots.release()
            raise
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self.slots.release()


class BatchRun:
    def __init__(
        self,
        owner: str,
        batch_id: str,
        files: FilesService,
        endpoints: Endpoints,
        priority: Priority,
        on_line: Callable[[str, str], None] | None = None,
    ) -> None:
        self.owner, self.batch_id = owner, batch_id
        self.files, self.store = files, files.store
        self.endpoints, self.priority = endpoints, priority
        self.on_line = on_line  # (batch id, custom_id) after each line that ran: tests, metrics
        self.cancelling = asyncio.Event()
        self.path = Path()  # the input file, once validated

    def _batch(self) -> dict[str, Any]:
        found = self.store.batch(self.batch_id)
        if found is None:
            raise LookupError(self.batch_id)
        return found[1]

    def update(self, **changes: Any) -> dict[str, Any]:
        batch = {**self._batch(), **changes}
        self.store.save_batch(batch)
        return batch

    async def run(self) -> None:
        try:
            batch = self._batch()
            if batch["status"] == "cancelling":
                await self._finalize("cancelled")
                return
            lines = await self._validate(batch)
            if lines is None:
                return
            deadline = float(batch.get("expires_at") or "inf")
            expired = await self._run_lines(batch["endpoint"], lines, deadline)
            if self.cancelling.is_set():
                await self._finalize("cancelled")
            elif expired:
                await self._expire(lines)
                await self._finalize("expired")
            else:
                await self._finalize("completed")
        except asyncio.CancelledError:  # the server stops: the stored state is resumed later
            raise
        except Exception as exc:  # a bug must not leave a batch in_progress for ever
            log.exception("batch %s failed", self.batch_id)
            error = {
                "code": "internal_error",
                "message": f"the batch failed: {exc!r}",
                "param": None,
                "line": None,
            }
            self.update(
                status="failed",
                failed_at=int(time.time()),
                errors={"object": "list", "data": [error]},
            )

    def _input(self, batch: dict[str, Any]) -> Path:
        """The batch's pinned input; a batch made before pinning reads the owner's file."""
        pinned = self.store.pinned(self.batch_id)
        if pinned.exists():
            return pinned
        return self.files.path(self.owner, batch["input_file_id"])

    async def _validate(self, batch: dict[str, Any]) -> LineIndex | None:
        try:
            self.path = self._input(batch)
            lines, errors = await asyncio.to_thread(scan_input, self.path, batch["endpoint"])
        except (VlmserveError, OSError) as exc:
            message = exc.message if isinstance(exc, VlmserveError) else "the input file is gone"
            lines, errors = (
                LineIndex(),
                [
                    {
                        "code": "input_file_unavailable",
                        "message": message,
                        "param": "input_file_id",
                        "line": None,
                    }
                ],
            )
        if errors:
            self.update(
                status="failed",
                failed_at=int(time.time()),
                errors={"object": "list", "data": errors},
            )
            return None
        if batch["status"] == "validating":
            counts = {"total": len(lines), "completed": 0, "failed": 0}
            self.update(
                status="in_progress", in_progress_at=int(time.time()), request_counts=counts
            )
        return lines

    async def _admit(self, deadline: float) -> bool:
        """A slot for the next line; False (no slot held) once ``deadline`` has passed."""
        left = deadline - time.time()
        if left <= 0:
            return False
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (stop)
            async with asyncio.timeout(min(left, 1e9)):
                await self.priority.admit()
        except TimeoutError:
            return False
        if time.time() >= deadline:
            self.priority.release()
            return False
        return True

    async def _run_lines(self, endpoint: str, lines: LineIndex, deadline: float) -> bool:
        """Run the lines without a stored result; True when ``deadline`` came first."""
        done = self.store.done_lines(self.batch_id)
        running: set[asyncio.Task[None]] = set()
        cancelled = asyncio.create_task(self.cancelling.wait())
        try:
            for line in lines:
                if line.line in done:
                    continue
                if not await self._admit(deadline):
                    return True
                if self.cancelling.is_set():
                    self.priority.release()
                    break
                task = asyncio.create_task(self._line(endpoint, line))
                running.add(task)
                task.add_done_callback(running.discard)
            while running and not self.cancelling.is_set():
                left = deadline - time.time()
                if left <= 0:
                    return True
                await asyncio.wait(
                    {*running, cancelled},
                    timeout=min(left, 1e9),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            return False
        finally:
            cancelled.cancel()
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    async def _line(self, endpoint: str, line: BatchLine) -> None:
        try:
            request_id = f"{self.batch_id}-{line.line}"
            request = await asyncio.to_thread(read_request, self.path, line)
            result = await self._answer(endpoint, request, request_id)
            self.store.add_line(self.batch_id, result)
            if self.on_line is not None:
                self.on_line(self.batch_id, request.custom_id)
        finally:
            self.priority.release()

    async def _answer(self, endpoint: str, request: LineRequest, request_id: str) -> LineResult:
        for attempt in range(_RETRIES):
            try:
                body = await self.endpoints.run(endpoint, request.body, request_id, self.owner)
                return ok_result(request, request_id, body)
            except (ServiceUnavailable, Overloaded) as exc:
                if attempt == _RETRIES - 1:
                    return error_result(request, request_id, exc)
                await asyncio.sleep(min(2.0**attempt, exc.retry_after * 2))
            except VlmserveError as exc:
                return error_result(request, request_id, exc)
            except Exception:
                log.exception("batch %s line %d failed", self.batch_id, request.line)
                failure = VlmserveError(
                    "the request failed; the server log has the details", code="internal_error"
                )
                return error_result(request, request_id, failure)
        raise AssertionError("unreachable: the last attempt returns")

    async def _expire(self, lines: LineIndex) -> None:
        """Every line without a result becomes a ``batch_expired`` error line."""
        done = self.store.done_lines(self.batch_id)
        for line in lines:
            if line.line not in done:
                request = await asyncio.to_thread(read_request, self.path, line)
                self.store.add_line(self.batch_id, expired_result(request))
        log.info("batch %s expired: its completion window ended", self.batch_id)

    async def _finalize(self, status: str) -> None:
        batch = self.update(status="finalizing", finalizing_at=int(time.time()))
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        stem = self.batch_id.removeprefix("batch_")
        for ok, key, suffix in (
            (True, "output_file_id", "output"),
            (False, "error_file_id", "error"),
        ):
            file_id = f"file-{stem}-{suffix}"
            name = f"{self.batch_id}_{suffix}.jsonl"
            if await self.files.write_results(self.owner, file_id, name, self.batch_id, ok):
                ids[key] = file_id
        completed, failed = self.store.line_counts(self.batch_id)
        counts = {**batch["request_counts"], "completed": completed, "failed": failed}
        when = {"cancelled": "cancelled_at", "expired": "expired_at"}.get(status, "completed_at")
        self.update(status=status, request_counts=counts, **ids, **{when: int(time.time())})
        self.store.unpin(self.batch_id)

    def cancel(self) -> None:
        self.cancelling.set()


async def stop_runs(tasks: list[asyncio.Task[None]]) -> None:
    """Stop the runs (the server stops); their stored state is resumed at the next start."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
