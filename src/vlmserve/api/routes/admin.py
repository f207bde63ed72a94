"""Model lifecycle admin API (seed 001): activate, deactivate, state."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from vlmserve.api.routing import StrictJSONRoute

router = APIRouter(prefix="/admin", tags=["admin"], route_class=StrictJSONRoute)


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)


class DeactivateRequest(ModelRef):
    drain_timeout: float | None = Field(default=None, ge=0, le=3600)


def _one(request: Request, name: str) -> dict[str, Any]:
    models = request.app.state.models
    wanted = models.resolve(name).name
    return next(m for m in models.state() if m["name"] == wanted)


@router.post("/activate")
async def activate(request: Request, body: ModelRef) -> dict[str, Any]:
    """Load a model (waits until it is ready); unloads least-recently-used ones over the cap."""
    handle = await request.app.state.models.activate(body.model)
    return _one(request, handle.name)


@router.post("/deactivate")
async def deactivate(request: Request, body: DeactivateRequest) -> dict[str, Any]:
    """Unload a model once its in-flight requests finish (bounded by ``drain_timeout``)."""
    drained = await request.app.state.models.deactivate(body.model, body.drain_timeout)
    return {**_one(request, body.model), "drained": drained}


@router.get("/state")
async def state(request: Request) -> dict[str, Any]:
    """Every model: state, memory, in-flight requests, last use, load time, keep-alive, error."""
    return {
        "models": request.app.state.models.state(),
        "streams": {"active": request.app.state.sessions.active_count()},
    }
