"""HTTP layer: FastAPI app factory, wire protocol, routes."""

from vlmserve.api.app import build_app

__all__ = ["build_app"]
