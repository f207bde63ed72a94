"""Liveness, readiness and the model list."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import ModelsDep, ServicesDep

router = APIRouter(route_class=StrictJSONRoute)


@router.get("/health")
async def health(models: ModelsDep) -> dict[str, Any]:
    """Liveness: the process answers; says whether models are ready. A model whose engine has
    work but made no progress for the liveness timeout is failed here (and reloaded)."""
    models.check_liveness()
    handles = models.handles
    errors = [f"{h.name}: {h.backend.error}" for h in handles if h.backend.error]
    return {
        "ok": True,
        "modelReady": models.ready,
        "modelId": handles[0].name if handles else None,
        "error": "; ".join(errors) or None,
        "models": [{"id": h.name, "state": h.backend.state.value} for h in handles],
        "resumableStreams": True,  # a gateway in front passes this server's streams through
    }


@router.get("/ready")
async def ready(models: ModelsDep) -> JSONResponse:
    """Readiness: 200 once every model is loaded, 503 (with Retry-After) until then."""
    body = {
        "ready": models.ready,
        "models": {h.name: h.backend.state.value for h in models.handles},
    }
    if models.ready:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


def _model_card(h: Any, created: int) -> dict[str, Any]:
    return {
        "id": h.name,
        "object": "model",
        "created": created,
        "owned_by": "vlmserve",
        "root": h.source,
        "roles": h.roles,
        "aliases": h.aliases,
        "capabilities": sorted(h.inputs) if h.inputs is not None else None,
        "scores": _scores(h.backend),  # /v1/rerank, /v1/score
        "ready": h.ready,
    }


def _scores(backend: Any) -> bool:
    kinds = {backend.serves, *backend.also_serves}
    return any(kind.value in ("rerank", "embedding") for kind in kinds)


@router.get("/v1/models")
async def list_models(services: ServicesDep) -> dict[str, Any]:
    created = services.started_at
    data = [_model_card(h, created) for h in services.models.handles]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(services: ServicesDep, model_id: str) -> dict[str, Any]:
    """One model by served name, alias or source (OpenAI's ``client.models.retrieve``)."""
    handle = services.models.resolve(model_id)  # 404 model_not_found otherwise
    return _model_card(handle, services.started_at)
