"""The models this server holds: resolution (``registry.resolve``), the lifecycle (load on
start-up or on demand, idle unload, a cap on loaded models, drain on deactivate) and state.

Backends are built in ``registry/build.py`` and used only through ``engine.protocol.Backend``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from vlmserve.config import Settings
from vlmserve.engine.types import ModelState, Serves
from vlmserve.errors import InvalidRequest, ServiceUnavailable
from vlmserve.registry.handles import Lease, ModelHandle
from vlmserve.registry.reload import Reloader
from vlmserve.registry.resolve import by_role, resolve
from vlmserve.registry.warmup import load

EMBEDDING = Serves.EMBEDDING.value

__all__ = ["EMBEDDING", "Lease", "LifecyclePolicy", "ModelHandle", "ModelManager"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LifecyclePolicy:
    on_demand: bool = True  # a request for an unloaded model loads it (else 503)
    max_loaded: int = 0  # models loaded at once; 0 = no cap (least recently used goes first)
    keep_alive: float = -1.0  # default idle seconds before unloading; -1 = never
    drain_timeout: float = 30.0  # deactivate waits this long for in-flight requests
    eager: bool = True  # load every model at start-up
    activation_timeout: float = 120.0  # how long a request waits for its model to load
    reload_attempts: int = 3  # reloads after a fatal engine error before giving up
    reload_backoff: float = 1.0  # seconds before reload attempt n: n * reload_backoff
    warmup: bool = True  # a loaded chat model answers a text and an image request first
    liveness_timeout: float = 0.0  # seconds of pending work without progress = failed; 0 off


def _policy(settings: Settings) -> LifecyclePolicy:
    return LifecyclePolicy(
        on_demand=settings.on_demand_activation,
        max_loaded=settings.max_loaded_models,
        keep_alive=settings.keep_alive,
        drain_timeout=settings.drain_timeout_seconds,
        eager=settings.load_on_startup,
        activation_timeout=settings.activation_timeout_seconds,
        warmup=settings.warmup,
        liveness_timeout=settings.liveness_timeout,
    )


class ModelManager:
    def __init__(self, handles: list[ModelHandle], policy: LifecyclePolicy | None = None):
        self._handles = {h.name: h for h in handles}
        self.policy = policy or LifecyclePolicy()
        self.activity: Any = None  # the server's ActivityClock, set by build_app
        self.starting = False  # the server's start-up (loads, warm-ups) is under way
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.reloader = Reloader(self._lock, self.policy)
        for handle in handles:
            self.reloader.watch(handle)

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelManager:
        from vlmserve.registry.build import build_handles

        return cls(build_handles(settings), _policy(settings))

    @property
    def handles(self) -> list[ModelHandle]:
        return list(self._handles.values())

    @property
    def ready(self) -> bool:
        """Serving: every model loaded and warmed up (eager), or none failed or loading (on
        demand); never before the server's start-up is done."""
        if not self._handles or self.starting:
            return False
        if self.policy.eager:
            return all(h.ready for h in self._handles.values())
        return not any(h.backend.state is ModelState.FAILED for h in self._handles.values())

    # --- resolution ------------------------------------------------------------------------
    def resolve(self, name: str) -> ModelHandle:
        """A model by served name, source, alias, or ``role:<role>``; 404 lists what exists."""
        return resolve(self.handles, name, self._lookup, "on this server")

    def _lookup(self, name: str) -> ModelHandle | None:
        return next((h for h in self._handles.values() if name in h.identifiers), None)

    def for_role(self, role: str) -> ModelHandle:
        """The first current model with ``role`` (``caption`` and others fall back to chat)."""
        return by_role(self.handles, role)

    async def acquire(
        self,
        name: str | None,
        role: str,
        serves: Serves | frozenset[Serves],
        needs: frozenset[str] = frozenset(),
    ) -> Lease:
        """Lease the model (by name, else by role) for one request; loads it on demand.
        ``serves``: the kind (or kinds) of model that can answer; ``needs`` (e.g. {"video"})
        is checked against the registry's capabilities first."""
        handle = self.resolve(name) if name else self.for_role(role)
        if handle.reload_pending:
            self.reloader.start(handle)
        kinds = serves if isinstance(serves, frozenset) else frozenset({serves})
        if handle.backend.serves not in kinds and not handle.backend.also_serves & kinds:
            message = _kind_message(handle, serves)
            raise InvalidRequest(message, param="model", code="wrong_model_kind")
        _check_inputs(handle, needs)
        if handle.draining:
            raise ServiceUnavailable(f"model {handle.name!r} is being deactivated", retry_after=5)
        if not handle.ready and handle.backend.state is not ModelState.FAILED:
            if not self.policy.on_demand and handle.backend.state is ModelState.UNLOADED:
                raise ServiceUnavailable(
                    f"model {handle.name!r} is not loaded; POST /admin/activate to load it",
                    retry_after=5,
                )
            await self._wait_active(handle)
        lease = Lease(handle, self.activity)
        if not handle.ready:  # failed to load, or unloaded while we waited
            lease.release()
            handle.backend.check_ready()  # raises the 503 that says why
        return lease

    async def _wait_active(self, handle: ModelHandle) -> None:
        """Wait (bounded) for the model to load; the load itself goes on regardless."""
        try:
            await asyncio.wait_for(
                asyncio.shield(self.activate(handle.name)), self.policy.activation_timeout
            )
        except TimeoutError as exc:
            raise ServiceUnavailable(
                f"model {handle.name!r} is loading; retry shortly "
                "(VLMSERVE_ACTIVATION_TIMEOUT_SECONDS bounds how long a request waits)",
                retry_after=5,
            ) from exc

    # --- lifecycle -------------------------------------------------------------------------
    def _lock(self, name: str) -> asyncio.Lock:
        key = (name, id(asyncio.get_running_loop()))
        return self._locks.setdefault(key, asyncio.Lock())

    async def activate(self, name: str) -> ModelHandle:
        """Load the model (waiting for a load already under way); unload LRU models over the cap."""
        handle = self.resolve(name)
        async with self._lock(handle.name):
            if handle.ready:
                handle.last_used = time.time()
                return handle
            await self._make_room(handle)
            handle.loading_since = time.time()
            try:  # and warm-up, under the lock: requests wait for both
                await load(handle, self.policy.warmup)
            except Exception as exc:
                raise ServiceUnavailable(f"model {handle.name!r} failed to load: {exc}") from exc
            finally:
                handle.loading_since = None
            handle.last_used = time.time()
            _log_loaded(handle)
            return handle

    async def _make_room(self, handle: ModelHandle) -> None:
        cap = self.policy.max_loaded
        loaded = [h for h in self._handles.values() if h.ready and h is not handle]
        while cap and len(loaded) >= cap:
            idle = sorted((h for h in loaded if h.in_flight == 0), key=lambda h: h.last_used)
            if not idle:
                raise ServiceUnavailable(
                    f"{len(loaded)} models are loaded (VLMSERVE_MAX_LOADED_MODELS={cap}) and all "
                    f"are busy; {handle.name!r} can load when one is idle",
                    retry_after=10,
                )
            log.info(
                "unloading %s (least recently used) to make room for %s", idle[0].name, handle.name
            )
            await self.deactivate(idle[0].name, drain_timeout=0)
            loaded.remove(idle[0])

    async def deactivate(self, name: str, drain_timeout: float | None = None) -> bool:
        """Unload the model after in-flight requests finish (at most ``drain_timeout``).
        Returns whether it drained cleanly."""
        handle = self.resolve(name)
        timeout = self.policy.drain_timeout if drain_timeout is None else drain_timeout
        async with self._lock(handle.name):
            handle.draining = True
            try:
                deadline = time.monotonic() + timeout
                while handle.in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                drained = handle.in_flight == 0
                await handle.backend.aclose()
            finally:
                handle.draining = False
        log.info("model %s unloaded%s", handle.name, "" if drained else " (drain timed out)")
        return drained

    def expired(self, now: float | None = None) -> list[ModelHandle]:
        """Loaded, idle models whose keep_alive has run out."""
        now = time.time() if now is None else now
        out = []
        for h in self._handles.values():
            keep = self.policy.keep_alive if h.keep_alive is None else h.keep_alive
            if h.ready and keep >= 0 and not h.in_flight and now - h.last_used >= keep:
                out.append(h)
        return out

    async def unload_expired(self) -> list[str]:
        names = [h.name for h in self.expired()]
        for name in names:
            await self.deactivate(name, drain_timeout=0)
        return names

    async def run_keep_alive(self, interval: float = 1.0) -> None:
        """Background task: unload models idle past their keep_alive (Ollama's keep_alive)."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.unload_expired()
            except Exception:
                log.exception("idle unload failed")

    def check_liveness(self) -> list[str]:
        """Fail every loaded model whose engine has had work without progress for the
        liveness timeout (its failure callback reloads it); their names."""
        timeout = self.policy.liveness_timeout
        stuck = [h for h in self._handles.values() if h.ready and h.backend.check_progress(timeout)]
        for handle in stuck:
            log.error(
                "model %s: no engine progress for over %.0f s with requests pending "
                "(VLMSERVE_LIVENESS_TIMEOUT); failed, reloading",
                handle.name,
                timeout,
            )
        return [h.name for h in stuck]

    async def run_liveness(self, interval: float = 1.0) -> None:
        """Background task: ``check_liveness`` every ``interval`` seconds."""
        if self.policy.liveness_timeout <= 0:
            return
        interval = min(interval, self.policy.liveness_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.check_liveness()
            except Exception:
                log.exception("liveness check failed")

    async def load_all(self) -> list[str]:
        """Load every model (eager start-up), one after another, off the event loop. Failures
        are logged, kept in each model's state (``/health`` reports them) and returned."""
        failures = []
        if not self.policy.eager:
            return failures
        for handle in self._handles.values():
            try:
                await self.activate(handle.name)
            except ServiceUnavailable as exc:
                log.error("%s", exc.message)
                failures.append(exc.message)
        return failures

    def state(self) -> list[dict[str, Any]]:
        return [_describe(h, self.policy) for h in self._handles.values()]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.backend.close()

    async def aclose(self) -> None:
        """Shutdown from the event loop: upstream clients closed, subprocesses stopped."""
        for handle in self._handles.values():
            await handle.backend.aclose()


def _check_inputs(handle: ModelHandle, needs: frozenset[str]) -> None:
    """400 before any work when the model is known not to take an input the request has."""
    takes = handle.inputs
    missing = sorted(needs - takes) if takes is not None else []
    if missing:
        raise InvalidRequest(
            f"model {handle.name!r} does not support {', '.join(missing)} input (its "
            f"capabilities: {', '.join(sorted(takes or ())) or 'text only'}); "
            "send it without that, or pick a model that has it",
            param="model",
            code="model_capability_missing",
        )


def _kind_message(handle: ModelHandle, serves: Serves | frozenset[Serves]) -> str:
    if isinstance(serves, frozenset):
        return (
            f"model {handle.name!r} does not score documents; give a reranker "
            '(roles = ["rerank"]) or an embedding model (roles = ["embedding"])'
        )
    if handle.backend.serves is Serves.RERANK:
        return f"model {handle.name!r} is a reranker; use /v1/rerank or /v1/score with it"
    if serves is Serves.CHAT:
        return (
            f"model {handle.name!r} is an embedding model; use /v1/embeddings or "
            "/encode-text and /encode-video with it"
        )
    return (
        f"model {handle.name!r} is not an embedding model; give an embedding model "
        '(roles = ["embedding"])'
    )


def _log_loaded(handle: ModelHandle) -> None:
    log.info(
        "model %s (%s) ready in %.1fs, holding %.1f MiB",
        handle.name,
        ", ".join(handle.roles),
        handle.backend.load_seconds or 0.0,
        handle.backend.memory_bytes / 2**20,
    )


def _describe(h: ModelHandle, policy: LifecyclePolicy) -> dict[str, Any]:
    stats = h.backend.stats()
    keep = policy.keep_alive if h.keep_alive is None else h.keep_alive
    return {
        "name": h.name,
        "state": "draining" if h.draining else h.backend.state.value,
        "roles": h.roles,
        "source": h.source,
        "memory_bytes": h.backend.memory_bytes,
        "in_flight": h.in_flight,
        "last_used": h.last_used,
        "load_seconds": h.backend.load_seconds,
        "loading_for_seconds": None if h.loading_since is None else time.time() - h.loading_since,
        "keep_alive": keep,
        "expires_at": h.last_used + keep if h.ready and keep >= 0 else None,
        "error": h.backend.error,
        "engine_failures": stats.engine_failures,
        "last_engine_error": stats.last_engine_error,
        "backend": h.backend.kind,
        **({"upstream": extra} if (extra := h.backend.describe()) else {}),
    }
