"""What the routes work with, built once per app and handed to them as typed dependencies.

``build_app`` builds one ``Services`` and keeps it on ``app.state.services``; a route asks for
the part it needs (``chat: ChatDep``) instead of reaching into an untyped ``app.state``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from vlmserve.api.auth import ANONYMOUS
from vlmserve.api.common.convert import Converter
from vlmserve.api.common.keys import KeyPolicy
from vlmserve.api.endpoints.batches.lines import Endpoints
from vlmserve.api.endpoints.batches.service import BatchesService
from vlmserve.api.endpoints.chat.service import ChatService
from vlmserve.api.endpoints.files.service import FilesService
from vlmserve.api.endpoints.rerank.service import RerankService
from vlmserve.api.endpoints.responses.service import ResponsesService
from vlmserve.api.endpoints.tasks.service import TaskService
from vlmserve.api.endpoints.worker.service import WorkerService
from vlmserve.api.metrics import Metrics
from vlmserve.config import Settings
from vlmserve.media.workers.pipeline import MediaPipeline
from vlmserve.registry.manager import ModelManager
from vlmserve.streaming import SessionManager

__all__ = [
    "BatchesDep",
    "ChatDep",
    "FilesDep",
    "ModelsDep",
    "OwnerDep",
    "RerankDep",
    "ResponsesDep",
    "Services",
    "ServicesDep",
    "SessionsDep",
    "TasksDep",
    "WorkerDep",
]


@dataclass(slots=True)
class Services:
    settings: Settings
    models: ModelManager
    sessions: SessionManager
    metrics: Metrics
    chat: ChatService
    worker: WorkerService
    tasks: TaskService
    responses: ResponsesService
    files: FilesService
    batches: BatchesService
    rerank: RerankService
    started_at: int = field(default_factory=lambda: int(time.time()))
    media: MediaPipeline | None = None  # the media budget and workers

    @classmethod
    def build(cls, settings: Settings, models: ModelManager, sessions: SessionManager) -> Services:
        metrics = Metrics()
        media = MediaPipeline.from_settings(settings)
        metrics.watch_media(media.waiting, media.decodes, media.held)
        converter = Converter.from_settings(settings, metrics, media.pool)
        chat = ChatService(
            models,
            converter,
            sessions,
            metrics,
            KeyPolicy.from_settings(settings),
            per_request_metrics=settings.per_request_metrics,
        )
        worker = WorkerService(models, converter)
        files = FilesService.from_settings(settings)
        # one resumer per manager; files: input_image file_id
        responses = ResponsesService(chat, chat_resumer=chat.resume, files=files)
        batches = BatchesService(
            files,
            Endpoints(chat, responses, worker),
            models=models,
            max_concurrency=settings.batch_max_concurrency,
            max_unfinished=settings.batch_max_unfinished,
        )
        return cls(
            settings,
            models,
            sessions,
            metrics,
            chat,
            worker,
            TaskService(chat),
            responses,
            files,
            batches,
            RerankService(models, converter, files, settings.rerank_max_documents),
            media=media,
        )


def _state(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]


# The dependencies are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in its
# thread pool, a hop that cost ~0.3 ms per request on a 2-core machine (the gateway's budget: 1 ms).
async def _services(request: Request) -> Services:
    return _state(request)


async def _models(request: Request) -> ModelManager:
    return _state(request).models


async def _sessions(request: Request) -> SessionManager:
    return _state(request).sessions


async def _chat(request: Request) -> ChatService:
    return _state(request).chat


async def _worker(request: Request) -> WorkerService:
    return _state(request).worker


async def _tasks(request: Request) -> TaskService:
    return _state(request).tasks


async def _responses(request: Request) -> ResponsesService:
    return _state(request).responses


async def _files(request: Request) -> FilesService:
    return _state(request).files


async def _batches(request: Request) -> BatchesService:
    return _state(request).batches


async def _rerank(request: Request) -> RerankService:
    return _state(request).rerank


async def _owner(request: Request) -> str:
    """Who owns what this request makes or reads (files, batches): its API key's identity,
    set by the auth middleware; one anonymous owner without configured API keys."""
    return getattr(request.state, "owner", ANONYMOUS)  # type: ignore[no-any-return]


ServicesDep = Annotated[Services, Depends(_services)]
ModelsDep = Annotated[ModelManager, Depends(_models)]
SessionsDep = Annotated[SessionManager, Depends(_sessions)]
ChatDep = Annotated[ChatService, Depends(_chat)]
WorkerDep = Annotated[WorkerService, Depends(_worker)]
TasksDep = Annotated[TaskService, Depends(_tasks)]
ResponsesDep = Annotated[ResponsesService, Depends(_responses)]
FilesDep = Annotated[FilesService, Depends(_files)]
BatchesDep = Annotated[BatchesService, Depends(_batches)]
RerankDep = Annotated[RerankService, Depends(_rerank)]
OwnerDep = Annotated[str, Depends(_owner)]
