"""The models this server holds: resolution by name or ``role:<role>``, and loading at start-up."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig, Settings
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.embed import HFEmbedBackend
from vlmserve.engine.hf.lifecycle import ModelState
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.upstream import UpstreamBackend
from vlmserve.errors import InvalidRequest, NotFound, ServiceUnavailable
from vlmserve.registry.proxied import fits, load_backend, unload_backend, upstream_backend
from vlmserve.registry.reload import Reloader

Backend = HFChatBackend | HFEmbedBackend | UpstreamBackend
EMBEDDING = "embedding"

__all__ = ["Lease", "ModelHandle", "ModelManager"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class ModelHandle:
    name: str
    roles: list[str]
    backend: Backend
    source: str = ""
    aliases: list[str] = field(default_factory=list)
    keep_alive: float | None = None  # seconds idle before unloading; -1 never; None: default
    last_used: float = field(default_factory=time.time)
    in_flight: int = 0
    draining: bool = False
    capabilities: frozenset[str] | None = None  # from the registry; None: not declared
    deprecated: bool = False  # resolvable by name, skipped by role selection
    loading_since: float | None = None  # wall time the current load began
    reload_pending: bool = False  # its engine failed; a reload is due (``ModelManager._reload``)

    @property
    def ready(self) -> bool:
        return self.backend.state is ModelState.READY


class Lease:
    """One request's use of a model: counted in flight (no idle unload, deactivate drains it)
    until released. ``async with`` releases at the end; streams release when they finish."""

    def __init__(self, handle: ModelHandle, activity: Any = None):
        self.handle = handle
        self._released = False
        self._activity = activity  # an ActivityClock: the idle watchdog waits for us too
        handle.in_flight += 1
        handle.last_used = time.time()
        if activity is not None:
            activity.begin()

    @property
    def backend(self) -> Any:
        return self.handle.backend

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.handle.in_flight -= 1
            self.handle.last_used = time.time()
            if self._activity is not None:
                self._activity.end()

    async def __aenter__(self) -> Any:
        return self.handle.backend

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def _handle(cfg: ModelConfig, settings: Settings) -> ModelHandle:
    options = LoadOptions(
        source=cfg.source,
        device=cfg.device or settings.device,
        dtype=cfg.dtype or settings.dtype,
        attn_implementation=settings.attn_implementation,
        trust_remote_code=settings.trust_remote_code,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
    )
    backend: Backend
    if EMBEDDING in cfg.roles:
        backend = HFEmbedBackend(
            cfg.served_name,
            options,
            adapter=cfg.adapter,
            max_batch=settings.embed_max_batch_size,
            batch_wait_ms=settings.embed_batch_wait_ms,
        )
    else:
        backend = HFChatBackend(
            cfg.served_name,
            options,
            max_model_len=settings.max_model_len,
            max_queued=settings.max_queued_requests,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            vision_cache_bytes=settings.vision_cache_bytes,
            stream_interval=settings.stream_interval,
            processor_cache_bytes=settings.processor_cache_bytes,
        )
    return ModelHandle(
        name=cfg.served_name, roles=list(cfg.roles), backend=backend, source=cfg.source,
        keep_alive=cfg.keep_alive,
    )  # fmt: skip


def _registry_handles(settings: Settings) -> list[ModelHandle]:
    """Handles for the registry's entries: hf in process, openai/vllm proxied."""
    from vlmserve.registry.files import load_registry

    discovered = Path(settings.registry_discovered) if settings.registry_discovered else None
    registry = load_registry(Path(settings.registry), discovered)
    handles = []
    for entry in registry.entries:
        if entry.backend != "hf":
            handle = ModelHandle(entry.name, list(entry.roles), upstream_backend(entry, settings))
        else:
            handle = _handle(entry.to_model_config(), settings)
        handle.aliases = entry.identifiers
        handle.keep_alive = entry.keep_alive
        handle.capabilities = frozenset(entry.capabilities.enabled())
        handle.deprecated = entry.deprecated
        handles.append(handle)
    return handles


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


def _policy(settings: Settings) -> LifecyclePolicy:
    return LifecyclePolicy(
        on_demand=settings.on_demand_activation,
        max_loaded=settings.max_loaded_models,
        keep_alive=settings.keep_alive,
        drain_timeout=settings.drain_timeout_seconds,
        eager=settings.load_on_startup,
        activation_timeout=settings.activation_timeout_seconds,
    )


class ModelManager:
    def __init__(self, handles: list[ModelHandle], policy: LifecyclePolicy | None = None):
        self._handles = {h.name: h for h in handles}
        self.policy = policy or LifecyclePolicy()
        self.activity: Any = None  # the server's ActivityClock, set by build_app
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.reloader = Reloader(self._lock, self.policy)
        for handle in handles:
            self.reloader.watch(handle)

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelManager:
        handles = [_handle(cfg, settings) for cfg in settings.model_configs()]
        if settings.registry:
            handles += _registry_handles(settings)
        return cls(handles, _policy(settings))

    @property
    def handles(self) -> list[ModelHandle]:
        return list(self._handles.values())

    @property
    def ready(self) -> bool:
        """Serving: every model loaded (eager), or none failed or loading (on demand)."""
        if not self._handles:
            return False
        if self.policy.eager:
            return all(h.ready for h in self._handles.values())
        return not any(h.backend.state is ModelState.FAILED for h in self._handles.values())

    # --- resolution ------------------------------------------------------------------------
    def resolve(self, name: str) -> ModelHandle:
        """A model by served name, source, alias, or ``role:<role>``; 404 lists what exists."""
        if name.startswith("role:"):
            return self.for_role(name.removeprefix("role:"))
        for h in self._handles.values():
            if name in (h.name, h.source, *h.aliases):
                return h
        available = ", ".join(sorted(self._handles)) or "none"
        raise NotFound(
            f"model {name!r} does not exist on this server; available: {available}",
            param="model",
            code="model_not_found",
        )

    def for_role(self, role: str) -> ModelHandle:
        """The first model with ``role`` (``caption`` and others fall back to ``chat``)."""
        live = [h for h in self._handles.values() if not h.deprecated]
        found = [h for h in live if role in h.roles]
        if not found and role not in ("chat", EMBEDDING):
            found = [h for h in live if "chat" in h.roles]
        if not found:
            raise NotFound(
                f'no model with role {role!r} on this server; give one `roles = ["{role}"]` '
                "in the [[models]] config",
                param="model",
                code="model_not_found",
            )
        return found[0]

    async def acquire(
        self, name: str | None, role: str, kind: type, needs: frozenset[str] = frozenset()
    ) -> Lease:
        """Lease the model (by name, else by role) for one request; loads it on demand.
        ``needs`` (e.g. {"video"}) is checked against the registry's capabilities first."""
        handle = self.resolve(name) if name else self.for_role(role)
        if handle.reload_pending:
            self.reloader.start(handle)
        if not fits(handle.backend, kind):
            message = _kind_message(handle, kind)
            raise InvalidRequest(message, param="model", code="wrong_model_kind")
        missing = sorted(needs - handle.capabilities) if handle.capabilities is not None else []
        if missing:
            raise InvalidRequest(
                f"model {handle.name!r} does not support {', '.join(missing)} input (its "
                f"capabilities: {', '.join(sorted(handle.capabilities or ())) or 'text only'}); "
                "send it without that, or pick a model that has it",
                param="model",
                code="model_capability_missing",
            )
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
            handle.backend._require()  # raises the 503 that says why
        return lease

    async def _wait_active(self, handle: ModelHandle) -> None:
        """Wait (bounded) for the model to load; the load itself goes on regardless."""
        try:
            await asyncio.wait_for(asyncio.shield(self.activate(handle.name)),
                                   self.policy.activation_timeout)  # fmt: skip
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
            try:
                await load_backend(handle.backend)
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
            log.info("unloading %s (least recently used) to make room for %s",
                     idle[0].name, handle.name)  # fmt: skip
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
                await unload_backend(handle.backend)
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

    # --- gateway: replicas registered at run time ----------------------------------------
    async def register_replica(self, model: str, url: str, instance: str) -> dict[str, Any]:
        """Add (or refresh) a replica of an ``openai`` model; checked before it gets traffic."""
        handle = self.resolve(model)
        backend = handle.backend
        if type(backend) is not UpstreamBackend:
            raise InvalidRequest(
                f"model {handle.name!r} is not an openai (upstream) entry; replicas register "
                'only with `backend = "openai"` entries of the gateway\'s registry',
                param="model",
            )
        for other in self._handles.values():  # one instance serves one URL: moved elsewhere?
            if other is not handle and isinstance(other.backend, UpstreamBackend):
                other.backend.pool.remove(instance=instance)
        replica = backend.pool.add(url, instance)
        if handle.ready:
            await backend.admit_replica(replica)
        return {"model": handle.name, **replica.describe(time.monotonic())}

    def deregister_replica(self, instance: str) -> list[str]:
        """Remove the instance's replicas everywhere; returns the models it served."""
        return [h.name for h in self._handles.values()
                if isinstance(h.backend, UpstreamBackend)
                and h.backend.pool.remove(instance=instance)]  # fmt: skip

    def close(self) -> None:
        for handle in self._handles.values():
            handle.backend.close()

    async def aclose(self) -> None:
        """Shutdown from the event loop: upstream clients closed, subprocesses stopped."""
        for handle in self._handles.values():
            await unload_backend(handle.backend)


def _kind_message(handle: ModelHandle, kind: type) -> str:
    if kind is HFChatBackend:
        return (f"model {handle.name!r} is an embedding model; use /v1/embeddings or "
                "/encode-text and /encode-video with it")  # fmt: skip
    return (f"model {handle.name!r} is not an embedding model; give an embedding model "
            '(roles = ["embedding"])')  # fmt: skip


def _log_loaded(handle: ModelHandle) -> None:
    log.info(
        "model %s (%s) ready in %.1fs, holding %.1f MiB",
        handle.name, ", ".join(handle.roles), handle.backend.load_seconds or 0.0,
        handle.backend.memory_bytes / 2**20,
    )  # fmt: skip


def _describe(h: ModelHandle, policy: LifecyclePolicy) -> dict[str, Any]:
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
        "engine_failures": getattr(h.backend, "engine_failures", 0),
        "last_engine_error": getattr(h.backend, "last_engine_error", None),
        "backend": getattr(h.backend, "kind", "hf"),
        **({"upstream": h.backend.describe()} if isinstance(h.backend, UpstreamBackend) else {}),
    }
