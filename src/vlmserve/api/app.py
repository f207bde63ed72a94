"""``build_app(settings, ...) -> FastAPI``: the whole HTTP server, no globals."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from vlmserve import heap
from vlmserve.api.auth import AuthMiddleware
from vlmserve.api.common.warmup import warm_request_path
from vlmserve.api.docs import install_offline_docs
from vlmserve.api.endpoints.admin import router as admin
from vlmserve.api.endpoints.batches import router as batches
from vlmserve.api.endpoints.chat import router as chat
from vlmserve.api.endpoints.embeddings import router as embeddings
from vlmserve.api.endpoints.files import router as files
from vlmserve.api.endpoints.gateway import router as gateway
from vlmserve.api.endpoints.rerank import router as rerank
from vlmserve.api.endpoints.responses import router as responses
from vlmserve.api.endpoints.streams import router as streams
from vlmserve.api.endpoints.system import router as system
from vlmserve.api.endpoints.tasks import router as tasks
from vlmserve.api.endpoints.tokenize import router as tokenize
from vlmserve.api.endpoints.worker import router as worker
from vlmserve.api.errors import ERROR_RESPONSES, error_response, install_error_handlers
from vlmserve.api.media_admission import MediaAdmissionMiddleware
from vlmserve.api.metrics import Metrics, MetricsMiddleware, metrics_endpoint
from vlmserve.api.middleware import (
    BodyLimitMiddleware,
    ErrorShieldMiddleware,
    RequestIdMiddleware,
)
from vlmserve.api.resume_token import redact_tokens
from vlmserve.api.services import Services
from vlmserve.api.telemetry import fastapi_telemetry
from vlmserve.api.ui import install_console
from vlmserve.config import Settings
from vlmserve.gateway.passthrough import PassthroughMiddleware
from vlmserve.gateway.registration_worker import Registration
from vlmserve.registry.manager import ModelHandle, ModelManager
from vlmserve.streaming import SessionManager, build_store
from vlmserve.watchdog import (
    ActivityClock,
    ActivityMiddleware,
    CommandDeregisterHook,
    DeregisterHook,
    HttpDeregisterHook,
    IdleWatchdog,
)

__all__ = ["CORS_EXPOSED_HEADERS", "CORS_METHODS", "build_app"]

CORS_METHODS = ["GET", "POST", "DELETE"]
CORS_EXPOSED_HEADERS = ["X-Session-ID", "X-Request-ID", "Retry-After", "X-Resume-Token"]

log = logging.getLogger(__name__)
ROUTERS = (
    system.router,
    chat.router,
    streams.router,
    embeddings.router,
    worker.router,
    admin.router,
    tasks.router,
    gateway.router,
    responses.router,
    files.router,
    tokenize.router,
    batches.router,
    rerank.router,
)


def build_sessions(settings: Settings) -> SessionManager:
    store = build_store(
        persist=settings.persist_sessions,
        db_path=settings.sessions_db_path,
        redis_url=settings.redis_url,
        ttl=settings.sessions_ttl_seconds,
    )
    return SessionManager(
        store,
        ring_size=settings.stream_ring_size,
        cancel_after_disconnect=settings.cancel_after_disconnect_seconds,
        ttl=settings.sessions_ttl_seconds,
    )


def _deregister_hook(settings: Settings) -> DeregisterHook | None:
    if settings.deregister_url:
        return HttpDeregisterHook(
            settings.deregister_url,
            instance=settings.instance_id or socket.gethostname(),
            timeout=settings.deregister_timeout,
            headers=_bearer(settings.gateway_key),
        )
    if settings.deregister_command:
        return CommandDeregisterHook(settings.deregister_command)
    return None


def _bearer(key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {key}"} if key else None


def build_watchdog(settings: Settings, clock: ActivityClock) -> IdleWatchdog | None:
    if settings.idle_seconds is None:
        return None
    return IdleWatchdog(
        clock,
        idle_seconds=settings.idle_seconds,
        check_interval=settings.idle_check_interval,
        idle_command=settings.idle_command,
        deregister=_deregister_hook(settings),
    )


def _load_numbers(handle: ModelHandle) -> tuple[int, int, float]:
    """(decoding, waiting, KV usage) of one model. Leases held while a request prepares count
    as waiting; a proxied model (no numbers of its own) counts its in-flight calls."""
    stats = handle.backend.stats()
    if stats.running is None:
        return handle.in_flight, 0, 0.0
    waiting = max(stats.waiting or 0, handle.in_flight - stats.running)
    return stats.running, waiting, stats.kv_usage


def _scrape(metrics: Metrics, models: ModelManager) -> Any:
    """``/metrics``: gauges read from the models at scrape time."""
    for h in models.handles:
        metrics.set_model_state(h.name, "unloading" if h.draining else h.backend.state)
        metrics.set_model_load_seconds(h.name, h.backend.load_seconds or 0.0)
        running, waiting, usage = _load_numbers(h)
        metrics.set_load(h.name, running=running, waiting=waiting, usage=usage)
        stats = h.backend.stats()
        metrics.set_kv_cache(
            h.name,
            preemptions=stats.preemptions,
            nbytes=stats.kv_cache_bytes,
            prefix=stats.prefix_cache,
        )
        metrics.set_engine(
            h.name,
            step_seconds=stats.step_seconds or {},
            weights_bytes=stats.weights_bytes,
            device_memory_bytes=stats.device_memory_bytes,
            process_rss_bytes=stats.process_rss_bytes,
        )
        if stats.vision_cache is not None:
            metrics.set_vision_cache(h.name, stats.vision_cache)
        if stats.processor_cache is not None:
            metrics.set_processor_cache(h.name, stats.processor_cache)
    return metrics_endpoint(metrics)


def _lifespan(app: FastAPI, services: Services, owns_models: bool) -> Any:
    settings, models = services.settings, services.models
    clock: ActivityClock = app.state.activity
    watchdog = build_watchdog(settings, clock)
    registration = Registration.from_settings(settings)  # ConfigError without advertise_url

    async def load() -> None:
        try:
            # Before the models load, so that they stay collectable once unloaded (heap.py).
            heap.settle()
            failures = await models.load_all()
            if settings.warmup:
                key = settings.api_keys[0] if settings.api_keys else None
                await warm_request_path(app, models, services.chat.converter, key)
        finally:
            models.starting = False
        if failures and settings.exit_on_load_failure:
            app.state.fatal_error = failures[0]
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down; the CLI exits non-zero

    async def announce(loading: asyncio.Task[None]) -> None:
        await loading  # register once loaded: the gateway preflights a replica at once
        if registration is not None:
            await registration.register([h.name for h in models.handles])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with clock.busy():  # loading counts as activity (idle watchdog)
            models.starting = models.policy.eager  # lazy: nothing loads (or warms) at start
            loading = asyncio.create_task(load())  # /ready is 503 until it is done
        tasks = [
            loading,
            asyncio.create_task(models.run_keep_alive()),
            asyncio.create_task(models.run_liveness()),
            asyncio.create_task(announce(loading)),
            asyncio.create_task(services.batches.start(loading)),
        ]
        if services.media is not None:
            tasks.append(asyncio.create_task(services.media.start()))
        if watchdog is not None:
            watchdog.start()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await _shut_down(services, registration, watchdog, owns_models)

    return lifespan


async def _shut_down(
    services: Services, registration: Registration | None, watchdog: Any, owns_models: bool
) -> None:
    await services.batches.stop()  # their stored state resumes at the next start
    if registration is not None:  # a clean stop leaves the gateway's pool at once
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(registration.deregister("shutdown"), timeout=5)
    if watchdog is not None:
        await watchdog.stop()
    await services.sessions.close()
    await services.responses.close()  # store: false streams, held in memory
    if services.media is not None:
        services.media.close()
    if owns_models:
        await services.models.aclose()  # upstream clients closed, vllm process groups stopped


def _install_middleware(
    app: FastAPI, services: Services, clock: ActivityClock, console_paths: tuple[str, ...]
) -> None:
    # Outermost first: RequestId -> Metrics -> CORS -> ErrorShield -> Auth -> Activity
    # -> BodyLimit -> MediaAdmission -> Passthrough (a gateway's streams to vlmserve workers) -> app
    settings, metrics = services.settings, services.metrics
    app.add_middleware(
        PassthroughMiddleware,
        settings=settings,
        sessions=services.sessions,
        models=services.models,
        metrics=metrics,
        errors=error_response,
    )
    if services.media is not None:  # bodies admitted by size against the media memory
        app.add_middleware(MediaAdmissionMiddleware, budget=services.media.budget)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(ActivityMiddleware, clock=clock)
    app.add_middleware(
        AuthMiddleware,
        api_keys=settings.api_keys,
        admin_keys=settings.admin_keys,
        metrics_public=settings.metrics_public,
        public_paths=("/health", "/ready", *console_paths),  # the page loads before a key
    )
    app.add_middleware(ErrorShieldMiddleware)  # inside CORS: a 500 carries its headers too
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_allow_origins,
            allow_methods=CORS_METHODS,
            allow_headers=["*"],
            expose_headers=CORS_EXPOSED_HEADERS,  # page scripts read the stream's session id
            max_age=600,
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)


def build_app(
    settings: Settings,
    models: ModelManager | None = None,
    sessions: SessionManager | None = None,
) -> FastAPI:
    """The whole server. A ``models`` manager passed in (tests, embedding) outlives the app;
    one built here from ``settings`` is closed with it."""
    owns_models = models is None
    redact_tokens()  # ?token= (a stream's resume token) never reaches the access log
    services = Services.build(
        settings,
        models or ModelManager.from_settings(settings),
        sessions or build_sessions(settings),
    )
    app = FastAPI(
        title="vlmserve",
        version="0.1.0",
        summary="OpenAI-compatible server for vision-language models",
        responses=ERROR_RESPONSES,
        docs_url=None,  # served from bundled assets below: FastAPI's pages load a CDN
        redoc_url=None,
        **fastapi_telemetry(),  # FastAPI's OpenTelemetry: on only where it is set up
    )
    clock = ActivityClock(settings.activity_file)
    services.models.activity = clock  # model leases (streams outliving requests) are activity
    app.state.services = services
    app.state.activity = clock
    app.state.fatal_error = None  # set when a model cannot load and the CLI must exit 1
    app.router.lifespan_context = _lifespan(app, services, owns_models)
    install_offline_docs(app)
    console_paths = install_console(app, settings)  # the web console at /, unless --no-ui
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    scrape = functools.partial(_scrape, services.metrics, services.models)
    app.add_api_route("/metrics", scrape, methods=["GET"], include_in_schema=False)
    _install_middleware(app, services, clock, tuple(console_paths))
    return app
