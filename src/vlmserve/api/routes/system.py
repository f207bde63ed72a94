"""Liveness, readiness and the model list."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vlmserve.api.routing import StrictJSONRoute

router = APIRouter(route_class=StrictJSONRoute)


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """Liveness (seed 003's shape): the process answers; says whether models are ready."""
    models = request.app.state.models
    handles = models.handles
    errors = [f"{h.name}: {h.backend.error}" for h in handles if h.backend.error]
    return {
        "ok": True,
        "modelReady": models.ready,
        "modelId": handles[0].name if handles else None,
        "error": "; ".join(errors) or None,
        "models": [{"id": h.name, "state": h.backend.state.value} for h in handles],
    }


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once every model is loaded, 503 (with Retry-After) until then."""
    models = request.app.state.models
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
        "capabilities": sorted(h.capabilities) if h.capabilities is not None else None,
        "ready": h.ready,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    created = request.app.state.started_at
    data = [_model_card(h, created) for h in request.app.state.models.handles]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    """One model by served name, alias or source (OpenAI's ``client.models.retrieve``)."""
    handle = request.app.state.models.resolve(model_id)  # 404 model_not_found otherwise
    return _model_card(handle, request.app.state.started_at)
