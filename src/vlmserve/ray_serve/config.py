"""The ``[ray]`` table of ``vlmserve.toml``: how many replicas of what, on which resources.

The rest of the file is vlmserve's usual settings (``config.Settings``, which forbids unknown
keys), so the table is taken out before the settings are read and validated here on its own::

    [ray]
    ingress_replicas = 2            # HTTP replicas: the OpenAI API, sessions, media decoding
    ingress_num_cpus = 0.5

    [ray.models.tiny-qwen2-vl]      # one deployment per [[models]] entry, by served name
    num_replicas = 2                # or autoscaling below
    num_cpus = 1
    num_gpus = 0
    max_ongoing_requests = 64       # Ray routes no more to a replica; then it queues
    autoscaling = { min_replicas = 1, max_replicas = 4, target_ongoing_requests = 16 }
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vlmserve.config import Settings, load_settings, settings_over
from vlmserve.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DIRECT_INGRESS_ENV", "DeploymentConfig", "RayConfig", "RaySetup", "load_ray_setup"]

# Ray Serve's direct ingress (Ray 2.60, experimental): each ingress replica serves HTTP on a
# port of its own (30000-31000 by default), no HTTP proxy in between. Ray's processes read it
# when they start, so it must be in the environment of the cluster's first ``ray.init``
# (``deploy/ray.ingress_urls`` lists the replicas' URLs).
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Autoscaling(_Strict):
    """Ray Serve's ``autoscaling_config`` (the common keys; Ray checks the values)."""

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = None
    target_ongoing_requests: float = Field(default=8.0, gt=0)
    upscale_delay_s: float | None = None
    downscale_delay_s: float | None = None  # default: the model's keep_alive when it has one


class DeploymentConfig(_Strict):
    """Replicas and resources of one deployment (a model, or the ingress)."""

    num_replicas: int = Field(default=1, ge=1)
    autoscaling: Autoscaling | None = None
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    memory: int | None = None  # bytes Ray reserves for each replica
    max_ongoing_requests: int = Field(default=64, ge=1)
    # requests waiting for a replica (per caller) before a 429; -1 = no bound
    max_queued_requests: int = -1

    def options(self, drain_seconds: float, keep_alive: float | None = None) -> dict[str, Any]:
        """Keyword arguments of ``serve.deployment(...).options``: Ray waits up to
        ``drain_seconds`` for a replica's running requests (streams) on scale-down."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            actor["memory"] = self.memory
        opts: dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "graceful_shutdown_timeout_s": drain_seconds,
            "graceful_shutdown_wait_loop_s": 1.0,
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
        }
        if self.autoscaling is None:
            opts["num_replicas"] = self.num_replicas
            return opts
        scaling = self.autoscaling.model_dump(exclude_none=True)
        if "downscale_delay_s" not in scaling and keep_alive is not None and keep_alive > 0:
            scaling["downscale_delay_s"] = keep_alive  # the registry's idle unload, per replica
        opts["autoscaling_config"] = scaling
        return opts


class RayConfig(_Strict):
    ingress_replicas: int = Field(default=1, ge=1)
    ingress_num_cpus: float = Field(default=1.0, ge=0)
    ingress_max_ongoing_requests: int = Field(default=256, ge=1)
    route_prefix: str = "/"
    app_name: str = "vlmserve"
    models: dict[str, DeploymentConfig] = Field(default_factory=dict)

    def ingress(self) -> DeploymentConfig:
        return DeploymentConfig(
            num_replicas=self.ingress_replicas,
            num_cpus=self.ingress_num_cpus,
            max_ongoing_requests=self.ingress_max_ongoing_requests,
        )

    def model(self, name: str) -> DeploymentConfig:
        return self.models.get(name) or DeploymentConfig()


@dataclass(slots=True)
class RaySetup:
    """What a Ray application is built from: vlmserve's settings, the ``[ray]`` table and the
    registry file's entries (read where the application is built: replicas need not see it)."""

    settings: Settings
    ray: RayConfig
    entries: list[dict[str, Any]] = field(default_factory=list)  # ModelEntry dumps (JSON)


def load_ray_setup(config_file: Path | None, **overrides: Any) -> RaySetup:
    """Read ``config_file`` (settings + ``[ray]``); flags in ``overrides`` win as usual."""
    table: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config file {config_file} does not exist")
        try:
            rest = tomllib.loads(config_file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{config_file} is not valid TOML: {exc}") from exc
        table = rest.pop("ray", {})
    try:
        ray = RayConfig.model_validate(table)
    except ValidationError as exc:
        raise ConfigError(f"[ray] in {config_file}: {exc}") from exc
    if config_file is not None:
        settings = _settings(rest, overrides)
    else:
        settings = load_settings(None, **overrides)
    settings, entries = _with_registry(settings)
    names = {m.served_name for m in settings.model_configs()}
    unknown = sorted(set(ray.models) - names)
    if unknown:
        raise ConfigError(
            f"[ray.models] names {unknown} that are not served models "
            f"(the [[models]] names are {sorted(names)})"
        )
    if not names:
        raise ConfigError(
            "no model to deploy: give [[models]] (or model = ...) or an hf registry entry"
        )
    return RaySetup(settings, ray, entries)


def _with_registry(settings: Settings) -> tuple[Settings, list[dict[str, Any]]]:
    """The registry file's entries under Ray: each ``hf`` entry becomes a model deployment
    (as a ``[[models]]`` table would), ``openai`` entries are proxied by the ingress replicas,
    and ``vllm`` entries are refused (every ingress replica would start its own vLLM)."""
    if not settings.registry:
        return settings, []
    from vlmserve.registry.files import load_registry

    found = Path(settings.registry_discovered) if settings.registry_discovered else None
    entries = load_registry(Path(settings.registry), found).entries
    vllm = [e.name for e in entries if e.backend == "vllm"]
    if vllm:
        raise ConfigError(
            f"registry entries {vllm} start a vLLM process; under Ray, serve the model as an "
            "hf entry (a deployment) or point an openai entry at a vLLM service"
        )
    hf = [
        e.to_model_config().model_copy(update={"keep_alive": e.keep_alive})
        for e in entries
        if e.backend == "hf"
    ]  # keep_alive: Ray's scale-down
    given = settings.model_configs()  # [[models]], or the single --model
    clash = sorted({m.served_name for m in hf} & {m.served_name for m in given})
    if clash:
        raise ConfigError(f"registry entries {clash} have the names of [[models]] entries")
    update = {"models": [*given, *hf], "registry": None, "registry_discovered": None}
    return settings.model_copy(update=update), [e.model_dump(mode="json") for e in entries]


def _settings(rest: dict[str, Any], overrides: dict[str, Any]) -> Settings:
    """The settings of the file without its ``[ray]`` table: flags, then ``VLMSERVE_*``
    variables, then the file win, exactly as ``load_settings`` orders them."""
    try:
        return settings_over(rest, overrides)
    except ValidationError as exc:
        raise ConfigError(str(exc)) from exc
