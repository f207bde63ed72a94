"""Deprecated: ``vlmserve.deploy.ray:app`` is ``vlmserve.ray_serve.app:app``.

Kept for one release so that ``serve run`` command lines and KubeRay ``RayService`` files that
name the old import path keep working; importing it warns once with the new path.
"""

from __future__ import annotations

import warnings

from vlmserve.ray_serve.app import app, build_application, deployment_name, ingress_urls

__all__ = ["app", "build_application", "deployment_name", "ingress_urls"]

warnings.warn(
    "vlmserve.deploy.ray is deprecated and will be removed in the next release: "
    "use vlmserve.ray_serve.app:app",
    DeprecationWarning,
    stacklevel=2,
)
