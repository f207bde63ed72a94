"""The ``vllm`` backend: a ``vllm serve`` subprocess started on activation, then proxied.

Activation starts the entry's command under a ``Supervisor`` and routes to it like an
``openai`` upstream with one replica; deactivation (and idle keep_alive) stops the process
group. A child that dies on its own turns the model ``failed`` with its exit status and log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from vlmserve.engine.types import ModelState
from vlmserve.gateway.supervisor import Supervisor
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig

__all__ = ["VllmBackend"]

log = logging.getLogger(__name__)


class VllmBackend(UpstreamBackend):
    kind = "vllm"

    @property
    def accepts_replicas(self) -> bool:
        return False  # its one replica is the process it runs

    def __init__(
        self,
        model_id: str,
        config: UpstreamConfig,
        supervisor: Supervisor,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        watch_interval: float = 1.0,
    ):
        super().__init__(model_id, config)
        self._transport = transport  # the supervisor's readiness probe (tests)
        self.supervisor = supervisor
        self.watch_interval = watch_interval
        self.exit_status: int | None = None  # the child's status when it died on its own
        self._watch: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        self.exit_status = None
        url = await self.supervisor.start(self._transport)
        self.pool.replicas.clear()
        self.pool.add(url, instance=f"{self.model_id}-process")
        await super()._start()
        self._watch = asyncio.create_task(self._watch_child())

    async def _watch_child(self) -> None:
        while not self.supervisor.exited():
            await asyncio.sleep(self.watch_interval)
        self.exit_status = self.supervisor.returncode
        self.error = (
            f"the {self.kind} process exited with status {self.exit_status}; "
            f"{self.supervisor._tail()}"
        )
        log.error("model %s: %s", self.model_id, self.error)
        self.state = ModelState.FAILED
        for replica in self.pool.replicas:
            self.pool.checked(replica, False, "process exited")

    async def _stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        await super()._stop()
        await asyncio.to_thread(self.supervisor.stop)
        self.pool.replicas.clear()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        super().close()
        self.supervisor.stop()
        self.pool.replicas.clear()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "process": {**self.supervisor.describe(), "exit_status": self.exit_status},
        }
