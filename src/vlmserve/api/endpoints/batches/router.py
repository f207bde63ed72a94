"""OpenAI's Batch API: ``/v1/batches`` create, list, retrieve, cancel. The work is
``vlmserve.api.endpoints.batches.service``; every call sees only the caller's own batches."""

from __future__ import annotations

from fastapi import APIRouter, Query

from vlmserve.api.endpoints.batches.protocol import BatchCreate, BatchList, BatchObject
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import BatchesDep, OwnerDep

router = APIRouter(tags=["batches"], route_class=StrictJSONRoute)


@router.post("/v1/batches")
async def create_batch(batches: BatchesDep, owner: OwnerDep, body: BatchCreate) -> BatchObject:
    """Run the requests of an uploaded JSONL file (purpose ``batch``) in the background, below
    interactive traffic; poll ``GET /v1/batches/{id}`` for its status and result files."""
    return BatchObject.model_validate(batches.create(owner, body))


@router.get("/v1/batches")
async def list_batches(
    batches: BatchesDep,
    owner: OwnerDep,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = Query(default=None, max_length=128),
) -> BatchList:
    """The caller's batches, newest first."""
    return BatchList.model_validate(batches.list(owner, limit, after))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batches: BatchesDep, owner: OwnerDep, batch_id: str) -> BatchObject:
    return BatchObject.model_validate(batches.retrieve(owner, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batches: BatchesDep, owner: OwnerDep, batch_id: str) -> BatchObject:
    """Stop a batch: status ``cancelling``, then ``cancelled`` with the results so far."""
    return BatchObject.model_validate(await batches.cancel(owner, batch_id))
