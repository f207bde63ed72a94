"""The Ray Serve application: one deployment per model, and the ingress in front of them.

Run it with ``vlmserve ray serve --config vlmserve.toml``, or with Ray's own tools::

    serve run vlmserve.ray_serve.app:app config=vlmserve.toml

(``app`` is an application builder: Ray calls it with the ``key=value`` arguments; KubeRay's
``RayService`` passes them as ``args``). The file is vlmserve's usual settings plus a ``[ray]``
table (``ray_serve/config.py``) with replica counts, autoscaling and resources per model.
"""

from __future__ import annotations

import re
from pathlib import Path

from ray import serve
from ray.serve import Application

from vlmserve.ray_serve.config import RaySetup, load_ray_setup
from vlmserve.ray_serve.ingress import Ingress
from vlmserve.ray_serve.replica import ModelReplica

__all__ = ["app", "build_application", "deployment_name", "ingress_urls"]


def deployment_name(model: str) -> str:
    """The model's deployment: its served name with characters Ray refuses replaced."""
    return "model-" + re.sub(r"[^A-Za-z0-9_.-]", "-", model)


def build_application(setup: RaySetup) -> Application:
    """The bound application for ``serve.run`` (the settings travel to every replica as
    JSON, so the config file need only be readable where this runs)."""
    settings = setup.settings
    dump = settings.model_dump(mode="json")
    drain = settings.drain_timeout_seconds
    handles = {}
    for cfg in settings.model_configs():
        name = cfg.served_name
        deployment = serve.deployment(ModelReplica, name=deployment_name(name))
        options = setup.ray.model(name).options(drain, cfg.keep_alive)
        handles[name] = deployment.options(**options).bind(dump, name)
    ingress = serve.deployment(Ingress, name="ingress")
    return ingress.options(**setup.ray.ingress().options(drain)).bind(dump, handles, setup.entries)


def app(args: dict[str, str]) -> Application:
    """Ray's application builder: ``serve run vlmserve.ray_serve.app:app config=FILE``."""
    config = args.get("config")
    return build_application(load_ray_setup(Path(config) if config else None))


def ingress_urls(app_name: str, host: str | None = None) -> list[str]:
    """The base URLs of ``app_name``'s ingress replicas under direct ingress (each replica's
    own HTTP port, from Serve's target groups, what a load balancer in front routes to);
    empty when the cluster runs Ray's HTTP proxy instead, or no replica is up yet. Serve
    names each replica by its node's IP; ``host`` replaces it (a one-node cluster whose
    ``http_options`` bind a single address such as 127.0.0.1)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    urls = []
    for group in details.get("target_groups") or []:
        if group.get("app_name") != app_name or str(group.get("protocol")) not in _HTTP:
            continue
        prefix = (group.get("route_prefix") or "/").rstrip("/")
        targets = group.get("targets") or []
        urls += [f"http://{host or t['ip']}:{t['port']}{prefix}" for t in targets]
    return sorted(urls)


_HTTP = ("HTTP", "RequestProtocol.HTTP")
