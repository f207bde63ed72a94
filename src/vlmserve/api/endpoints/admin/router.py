"""Model lifecycle admin API: activate, deactivate, state."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import ModelsDep, ServicesDep
from vlmserve.registry.manager import ModelManager

router = APIRouter(prefix="/admin", tags=["admin"], route_class=StrictJSONRoute)


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)


class DeactivateRequest(ModelRef):
    drain_timeout: float | None = Field(default=None, ge=0, le=3600)


def _one(models: ModelManager, name: str) -> dict[str, Any]:
    wanted = models.resolve(name).name
    return next(m for m in models.state() if m["name"] == wanted)


@router.post("/activate")
async def activate(models: ModelsDep, body: ModelRef) -> dict[str, Any]:
    """Load a model (waits until it is ready); unloads least-recently-used ones over the cap."""
    handle = await models.activate(body.model)
    return _one(models, handle.name)


@router.post("/deactivate")
async def deactivate(models: ModelsDep, body: DeactivateRequest) -> dict[str, Any]:
    """Unload a model once its in-flight requests finish (bounded by ``drain_timeout``)."""
    drained = await models.deactivate(body.model, body.drain_timeout)
    return {**_one(models, body.model), "drained": drained}


@router.get("/state")
async def state(services: ServicesDep) -> dict[str, Any]:
    """Every model: state, memory, in-flight requests, last use, load time, keep-alive, error."""
    return {
        "models": services.models.state(),
        "streams": {"active": services.sessions.active_count()},
    }
