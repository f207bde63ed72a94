"""``build_app(settings, ...) -> FastAPI``: the whole HTTP server, no globals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from vlmserve.api.errors import install_error_handlers
from vlmserve.api.middleware import BodyLimitMiddleware, RequestIdMiddleware
from vlmserve.api.routes import chat, embeddings, streams, system, worker
from vlmserve.api.serving.chat import ChatService
from vlmserve.api.serving.convert import Converter
from vlmserve.api.serving.worker import WorkerService
from vlmserve.config import Settings
from vlmserve.registry.manager import ModelManager
from vlmserve.streaming import SessionManager, build_store

__all__ = ["build_app"]

log = logging.getLogger(__name__)


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


def build_app(
    settings: Settings,
    models: ModelManager | None = None,
    sessions: SessionManager | None = None,
) -> FastAPI:
    owns_models = models is None  # a manager passed in (tests, embedding) outlives the app
    models = models or ModelManager.from_settings(settings)
    sessions = sessions or build_sessions(settings)

    async def load() -> None:
        failures = await models.load_all()
        if failures and settings.exit_on_load_failure:
            app.state.fatal_error = failures[0]
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down; the CLI exits non-zero

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load())  # /ready is 503 until it is done
        try:
            yield
        finally:
            loading.cancel()
            await sessions.close()
            if owns_models:
                models.close()

    app = FastAPI(
        title="vlmserve",
        version="0.1.0",
        summary="OpenAI-compatible server for vision-language models",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.models = models
    app.state.sessions = sessions
    app.state.started_at = int(time.time())
    app.state.fatal_error = None
    converter = Converter.from_settings(settings)
    app.state.chat = ChatService(models, converter, sessions)
    app.state.worker = WorkerService(models, converter)
    install_error_handlers(app)
    for router in (system.router, chat.router, streams.router, embeddings.router, worker.router):
        app.include_router(router)
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_allow_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    return app
