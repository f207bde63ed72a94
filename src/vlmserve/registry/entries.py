"""``ModelEntry``: one model in a registry file, exactly as users write it.

Field meanings follow the unified registry glossary:

    name             logical key for selection (unique across the merged registry)
    backend          what serves it: hf (in process), openai (upstream URL), vllm (subprocess)
    source           local directory or hub repo id of the weights (required for hf)
    adapter          PEFT adapter directory or repo id applied on top of ``source``
    served_model_id  name advertised on /v1/models (default: ``name``)
    roles            functional purposes (``caption``, ``embedding``...) for ``role:<role>``
    capabilities     modalities and features the model offers (a request needing more gets 400)
    model_aliases    fallback identifiers that also resolve to this entry
    deprecated       still resolvable by name/alias/served id, skipped by role selection
    limits           per-model caps (pixels per image, frames per video, tokens)
    keep_alive       seconds idle before unload; -1 never; unset = the server default
    backend_config   settings of the backend: free-form for hf; for openai ``OpenAIConfig``
                     (base_urls, timeout, api_key/api_key_env...), for vllm ``VllmConfig``
                     (command with a "{port}" placeholder, env, health_timeout, log_dir...)
    version_lock     sha256 of every artifact file + an aggregate (``vlmserve registry lock``)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from vlmserve.config import ModelConfig
from vlmserve.errors import ConfigError

__all__ = [
    "Backend",
    "Capabilities",
    "EntryLimits",
    "ModelEntry",
    "OpenAIConfig",
    "Timeouts",
    "VersionLock",
    "VllmConfig",
    "aggregate_digest",
]

Backend = Literal["hf", "openai", "vllm"]
ROLE_PREFIX = "role:"
_ROLE = re.compile(r"^[a-z][a-z0-9_]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def aggregate_digest(files: Mapping[str, str]) -> str:
    """sha256 over ``"<sha256>  <relpath>\\n"`` lines sorted by path (``sha256sum`` format).

    Reproducible by hand: ``find . -type f -not -path '*/.*' | sed 's|^./||' | LC_ALL=C sort
    | xargs sha256sum | sha256sum`` inside the model directory.
    """
    lines = "".join(f"{files[path]}  {path}\n" for path in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Capabilities(_Strict):
    """What a model can take and produce; a request needing a missing one is refused early."""

    vision: bool = True
    video: bool = False
    embedding: bool = False
    json_schema: bool = False

    def enabled(self) -> list[str]:
        return [name for name, on in self.model_dump().items() if on]


class EntryLimits(_Strict):
    """Per-model caps, tighter than the server's; unset means the server's limit applies."""

    max_pixels: int | None = Field(default=None, gt=0)
    max_video_frames: int | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, gt=0)
    # openai/vllm: requests admitted at once (in flight + waiting); unset: the server's
    # VLMSERVE_MAX_QUEUED_REQUESTS. More get 429.
    max_queued_requests: int | None = Field(default=None, gt=0)


class Timeouts(_Strict):
    """Seconds to connect to an upstream, and to wait for its next bytes."""

    connect: float = Field(default=5.0, gt=0)
    read: float = Field(default=600.0, gt=0)


class _UpstreamCommon(_Strict):
    timeout: float | Timeouts = Field(default_factory=Timeouts)  # a number sets both
    api_key: str | None = None  # sent upstream; the client's own key never is
    api_key_env: str | None = None  # or: the environment variable that holds it
    max_concurrency: int = Field(default=0, ge=0)  # in flight per replica; 0 = no cap
    preflight: bool = True  # run `vlmserve preflight` checks before routing to a replica

    @property
    def timeouts(self) -> Timeouts:
        if isinstance(self.timeout, Timeouts):
            return self.timeout
        return Timeouts(connect=self.timeout, read=self.timeout)

    @model_validator(mode="after")
    def _one_key(self) -> _UpstreamCommon:
        if self.api_key and self.api_key_env:
            raise ValueError("give api_key or api_key_env, not both")
        return self


class OpenAIConfig(_UpstreamCommon):
    """``backend_config`` of an ``openai`` entry: where its replicas are."""

    base_urls: list[str] = Field(default_factory=list)  # more register at run time
    base_url: str | None = None  # shorthand for one replica

    @field_validator("base_urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            _check_url(url)
        return urls

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        return None if url is None else _check_url(url)

    @property
    def urls(self) -> list[str]:
        return list(dict.fromkeys([*self.base_urls, *([self.base_url] if self.base_url else [])]))


class VllmConfig(_UpstreamCommon):
    """``backend_config`` of a ``vllm`` entry: the ``vllm serve`` argv and its surroundings."""

    command: list[str] = Field(min_length=1)  # argv, "{port}" filled with a free port
    env: dict[str, str] = Field(default_factory=dict)
    health_timeout: float = Field(default=600.0, gt=0)  # seconds to wait for /health
    stop_timeout: float = Field(default=30.0, ge=0)  # SIGTERM, then SIGKILL after this
    log_dir: str | None = None  # one log file per model; default ./logs

    @field_validator("command")
    @classmethod
    def _check_command(cls, argv: list[str]) -> list[str]:
        if not all(argv):
            raise ValueError("command holds an empty string")
        if not any("{port}" in a for a in argv):
            raise ValueError('command needs a "{port}" placeholder, e.g. "--port", "{port}"')
        return argv


def _check_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"upstream URL {url!r} must start with http:// or https://")
    return url


class VersionLock(_Strict):
    """sha256 of every artifact (relative POSIX path -> hex digest) and their aggregate."""

    files: dict[str, str]
    aggregate_sha256: str
    locked_at: str  # ISO 8601, UTC

    @field_validator("files")
    @classmethod
    def _check_files(cls, files: dict[str, str]) -> dict[str, str]:
        for path, digest in files.items():
            parts = path.split("/")
            if path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"file {path!r} is not a relative POSIX path inside the model")
            if not _SHA256.match(digest):
                raise ValueError(f"file {path!r}: {digest!r} is not a lowercase sha256 hex digest")
        return dict(sorted(files.items()))

    @model_validator(mode="after")
    def _check_aggregate(self) -> VersionLock:
        if self.aggregate_sha256 != aggregate_digest(self.files):
            raise ValueError(
                "aggregate_sha256 does not match the file hashes (edited by hand?); "
                "run `vlmserve registry lock NAME` to recompute the lock"
            )
        return self


class ModelEntry(_Strict):
    """One model of the registry (a ``[[models]]`` table in TOML, an object in JSON)."""

    name: str
    backend: Backend = "hf"
    source: str | None = None
    adapter: str | None = None
    served_model_id: str | None = None
    roles: list[str] = Field(default_factory=lambda: ["chat"])
    capabilities: Capabilities = Field(default_factory=Capabilities)
    model_aliases: list[str] = Field(default_factory=list)
    deprecated: bool = False
    limits: EntryLimits = Field(default_factory=EntryLimits)
    keep_alive: float | None = None
    backend_config: dict[str, Any] = Field(default_factory=dict)
    version_lock: VersionLock | None = None
    reasoning_parser: str | None = None  # hf entries: as --reasoning-parser, for this model
    tool_call_parser: str | None = None
    chat_template: str | None = None  # hf entries: as --chat-template (a file or the text)
    kv_cache_memory: int | str | None = None  # hf entries: this model's KV budget (bytes/size)
    enable_prefix_caching: bool | None = None  # hf entries: as --enable-prefix-caching
    # written by `registry discover` (facts about the files, for people and tools)
    architecture: str | None = None
    quantization: str | None = None
    size_bytes: int | None = Field(default=None, ge=0)

    @field_validator("name", "served_model_id")
    @classmethod
    def _check_identifier(cls, value: str | None) -> str | None:
        if value is not None:
            _check_model_id(value)
        return value

    @field_validator("model_aliases")
    @classmethod
    def _check_aliases(cls, aliases: list[str]) -> list[str]:
        for alias in aliases:
            _check_model_id(alias)
        duplicates = sorted({a for a in aliases if aliases.count(a) > 1})
        if duplicates:
            raise ValueError(f"model_aliases lists {', '.join(duplicates)} more than once")
        return aliases

    @field_validator("roles")
    @classmethod
    def _check_roles(cls, roles: list[str]) -> list[str]:
        for role in roles:
            if not _ROLE.match(role):
                raise ValueError(
                    f"role {role!r} must be a lowercase identifier (letters, digits, _), "
                    "e.g. 'caption'"
                )
        if len(set(roles)) != len(roles):
            raise ValueError(f"roles {roles} list a role more than once")
        return roles

    @field_validator("keep_alive")
    @classmethod
    def _check_keep_alive(cls, value: float | None) -> float | None:
        if value is not None and value < 0 and value != -1:
            raise ValueError("keep_alive is seconds >= 0, or -1 to never unload")
        return value

    @model_validator(mode="after")
    def _check_entry(self) -> ModelEntry:
        if self.backend == "hf" and not self.source:
            raise ValueError("an hf entry needs `source` (a local directory or hub repo id)")
        taken = {self.name, self.served_id}
        clashes = [alias for alias in self.model_aliases if alias in taken]
        if clashes:
            raise ValueError(
                f"model_aliases {clashes} repeat the entry's name or served_model_id; drop them"
            )
        if self.backend != "hf":
            self.upstream_config()
        if "embedding" in self.roles and not self.capabilities.embedding:
            raise ValueError(
                "role 'embedding' needs `capabilities.embedding = true` (or drop the role)"
            )
        return self

    def upstream_config(self) -> OpenAIConfig | VllmConfig:
        """The validated ``backend_config`` of an openai/vllm entry."""
        kind = OpenAIConfig if self.backend == "openai" else VllmConfig
        try:
            return kind.model_validate(self.backend_config)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'backend_config'}: {e['msg']}"
                for e in exc.errors()
            )
            raise ValueError(f"backend_config of a {self.backend} entry: {problems}") from None

    @property
    def served_id(self) -> str:
        """The name advertised on /v1/models."""
        return self.served_model_id or self.name

    @property
    def identifiers(self) -> list[str]:
        """Every string that resolves to this entry: name, served id, aliases (no repeats)."""
        return list(dict.fromkeys([self.name, self.served_id, *self.model_aliases]))

    def to_model_config(
        self, *, device: str | None = None, dtype: str | None = None
    ) -> ModelConfig:
        """The engine's view of an ``hf`` entry (served under ``served_id``)."""
        if self.backend != "hf" or self.source is None:
            raise ConfigError(
                f"entry {self.name!r} has backend {self.backend!r}; only hf entries load in "
                "process (openai/vllm entries are served by the gateway backends)"
            )
        return ModelConfig(
            name=self.served_id,
            source=self.source,
            adapter=self.adapter,
            roles=list(self.roles),
            device=device,
            dtype=dtype,
            reasoning_parser=self.reasoning_parser,
            tool_call_parser=self.tool_call_parser,
            chat_template=self.chat_template,
            kv_cache_memory=self.kv_cache_memory,
            enable_prefix_caching=self.enable_prefix_caching,
        )


def _check_model_id(value: str) -> None:
    if not value or value != value.strip():
        raise ValueError(f"{value!r} must be non-empty without leading or trailing spaces")
    if value.startswith(ROLE_PREFIX):
        raise ValueError(f"{value!r} must not start with {ROLE_PREFIX!r} (reserved for roles)")
