"""Settings, built once (flags > VLMSERVE_* environment > TOML file > defaults), passed down.

Nothing reads the environment at import time; ``load_settings`` is the one place that does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from vlmserve.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

__all__ = ["ModelConfig", "Settings", "load_settings", "parse_size", "settings_over"]

MiB = 2**20
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def default_media_memory() -> int:
    """A quarter of the RAM, at most 4 GiB (2 GiB where the RAM size is unknown)."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 2 * 2**30
    return min(ram // 4, 4 * 2**30)


def parse_size(text: str) -> int:
    """``"4GiB"`` -> 4294967296; plain digits are bytes; k/M/G are powers of 10, KiB/MiB/GiB
    powers of 2 (``"4G"`` = 4e9)."""
    raw = text.strip().replace(" ", "").replace("_", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = _UNITS.get(raw[len(digits) :].lower())
    try:
        number = float(digits)
    except ValueError:
        number = -1.0
    if unit is None or number < 0:
        raise ValueError(f"{text!r} is not a size; write bytes, or e.g. 512MiB, 4GiB, 8G")
    return int(number * unit)


class ModelConfig(BaseSettings):
    """One model the server holds (``[[models]]`` in the TOML file, or ``--model``)."""

    model_config = SettingsConfigDict(extra="forbid")

    name: str | None = None  # served name; default: the source's last path component
    source: str  # local directory or hub repo id
    adapter: str | None = None  # PEFT adapter directory or repo id
    roles: list[str] = Field(default_factory=lambda: ["chat"])
    device: str | None = None  # None: the server's --device
    dtype: str | None = None
    keep_alive: float | None = None  # idle seconds before unloading; -1 never; None: server's
    reasoning_parser: str | None = None  # None: the server's --reasoning-parser
    tool_call_parser: str | None = None
    chat_template: str | None = None  # a .jinja file or the template; None: the server's
    kv_cache_memory: int | None = Field(default=None, ge=0)  # this model's KV budget; 0 auto
    enable_prefix_caching: bool | None = None  # None: the server's --enable-prefix-caching

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        return parse_size(value) if isinstance(value, str) else value

    @property
    def served_name(self) -> str:
        return self.name or self.source.rstrip("/").split("/")[-1]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VLMSERVE_", extra="forbid")
    # the lowest-precedence source: a config file's table (``settings_over``)
    file_table: ClassVar[dict[str, Any] | None] = None

    # --- model -------------------------------------------------------------------------
    model: str | None = None
    served_model_name: str | None = None
    models: list[ModelConfig] = Field(default_factory=list)
    registry: str | None = None  # curated registry file (TOML/JSON); its hf entries are served
    registry_discovered: str | None = None  # discovered layer (curated wins by name)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    attn_implementation: str | None = None  # sdpa | eager | flash_attention_2
    trust_remote_code: bool = False
    min_pixels: int | None = None  # image processor bounds; None: the model's own
    max_pixels: int | None = None
    max_model_len: int = 32768  # prompt + completion tokens
    # the most characters one token can stand for: a prompt with more text characters than
    # max_model_len * this is refused before it is tokenised (tokenising it could take minutes)
    max_chars_per_token: float = Field(default=64.0, gt=0)
    # vLLM's --reasoning-parser (qwen3, deepseek_r1): thinking goes to `reasoning`; None:
    # detected from the chat template. --tool-call-parser: how tool calls are read (hermes)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # vLLM's --chat-template: a .jinja file (or the template text) replacing the checkpoint's
    chat_template: str | None = None

    # --- server --------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    cors_allow_origins: list[str] = Field(default_factory=list)
    max_queued_requests: int = 256
    # `vlmserve serve` sets this: a model that cannot load ends start-up (exit code 1)
    exit_on_load_failure: bool = False

    # --- model lifecycle -----------------------------------------------------------------
    load_on_startup: bool = True  # eager; False: models load on their first request
    on_demand_activation: bool = True  # a request for an unloaded model loads it (else 503)
    max_loaded_models: int = 0  # 0 = no cap; over the cap the least recently used unloads
    keep_alive: float = -1.0  # idle seconds before a model unloads; -1 = never
    drain_timeout_seconds: float = 30.0
    activation_timeout_seconds: float = 120.0  # a request waits this long for its model to load
    # a loaded chat model answers one text and one image request of its own before /ready
    warmup: bool = True
    # seconds an engine may have requests without a step starting or ending before the model
    # counts as failed (/health) and is reloaded; never below 3x the longest step it ran. The
    # default is above the longest step at the default max_num_batched_tokens; 0 = off
    liveness_timeout: float = Field(default=300.0, ge=0)

    # --- hf engine: continuous batching, caches ---------------------------------------
    max_num_seqs: int = Field(default=32, ge=1)  # decoded together; 1 = one at a time
    # prompt tokens computed per engine step (a longer prompt runs in chunks, the running
    # rows decoding between them); None: 2,048 on CPU, 8,192 on CUDA, as vLLM's API server
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    # while streams decode and prompts wait, a step that prefilled for S seconds is followed
    # by S x share / (1 - share) seconds of decode-only steps (engine/core/pacing.py); 0 =
    # prefill whenever a prompt waits
    decode_share: float = Field(default=1 / 3, ge=0, lt=1)
    # logprobs from the raw logits (vLLM's default raw_logprobs) or after grammar masks,
    # penalties and temperature (processed; the generate fallback always reports raw)
    logprobs_mode: Literal["raw", "processed"] = "raw"
    vision_cache_bytes: int = Field(default=256 * MiB, ge=0)  # vision-tower outputs; 0 = off
    # preprocessed images by content (vLLM's --mm-processor-cache-gb); 0 = off
    processor_cache_bytes: int = Field(default=256 * MiB, ge=0)
    # vLLM's --stream-interval: with 4+ sequences decoding, tokens go out in groups of up to
    # this many per stream event (fewer, larger events keep the API responsive); 1 = each token
    stream_interval: int = Field(default=4, ge=1)
    # KV cache budget per model, in bytes (or "4GiB", "512MiB"); 0 = auto: on CPU a share of
    # the RAM (docs/engine.md), on GPU what --gpu-memory-utilization leaves after the weights
    kv_cache_memory: int = Field(default=0, ge=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # reuse the K/V of a prompt's cached full blocks (vLLM's default too)
    enable_prefix_caching: bool = True
    # CUDA: decode attention reads the paged cache in place (a Triton kernel) and each step
    # replays a CUDA graph. Off until a GPU run has shown it correct: decode gathers blocks
    cuda_graphs: bool = False
    # with cuda_graphs: the paged step runs eagerly, without graphs (vLLM's --enforce-eager)
    enforce_eager: bool = False
    # each hf chat model's engine in its own process (vLLM V1's EngineCore split): the API's
    # HTTP, media and stream work and the engine share no GIL; a crashed engine is reloaded.
    # False: in this process (embedded use; the tests that reach into the engine)
    engine_process: bool = True
    embed_max_batch_size: int = Field(default=16, ge=1)  # embedding items in one forward pass
    embed_batch_wait_ms: float = Field(default=5.0, ge=0)  # wait for concurrent requests
    # /v1/rerank and /v1/score: documents (pairs) per request; more get a 400
    rerank_max_documents: int = Field(default=100, ge=1)
    rerank_max_batch_size: int = Field(default=16, ge=1)  # query-document pairs per forward

    # --- gateway: upstream replicas -----------------------------------------------------
    upstream_health_interval: float = 5.0  # seconds between active health checks
    upstream_max_failures: int = 3  # consecutive failures that eject a replica
    upstream_eject_seconds: float = 30.0  # cool-down before an ejected replica is retried
    # streamed chat to vlmserve workers passes through as bytes (gateway/passthrough.py); off, or
    # with a durable store (persist_sessions, redis_url), the gateway runs its own sessions
    gateway_passthrough: bool = True
    register_url: str | None = None  # worker: POST {model, url, instance} here on start
    advertise_url: str | None = None  # worker: the base URL a gateway should call
    gateway_key: str | None = None  # worker: Bearer key sent to register/deregister_url

    # --- generation defaults (a request may override) ----------------------------------
    max_tokens: int = 256
    temperature: float = 0.7

    # --- limits, checked before work ---------------------------------------------------
    max_body_bytes: int = 64 * MiB
    # seconds from connect (or a kept-alive request's first byte) to the end of the request
    # head; a slower head gets 408 and its connection is closed (slow-loris clients)
    request_head_timeout: float = Field(default=10.0, gt=0)
    max_media_per_request: int = 8
    max_media_bytes: int = 20 * MiB
    max_image_pixels: int = 4096 * 4096
    max_video_frames: int = 16
    max_video_pixels: int = 3840 * 2160  # per frame, checked from the header before decoding
    max_video_decode_frames: int = 20000
    media_image_formats: list[str] = Field(
        default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF", "BMP"]
    )
    media_fetch_timeout: float = 10.0
    media_max_redirects: int = 3
    allowed_local_media_path: list[str] = Field(default_factory=list)
    media_allow_private_networks: bool = False
    # bytes of media in flight (bodies as received and parsed, decoded pixels) until the engine
    # takes them; a body that does not fit waits in a queue of media_queue requests, then 429
    media_memory: int = Field(default_factory=lambda: default_media_memory(), ge=1)
    media_queue: int = Field(default=32, ge=0)  # requests waiting for media memory
    # worker processes that read and decode media; None: half the cores (1-4); 0: a thread of
    # the API process (no workers)
    media_workers: int | None = Field(default=None, ge=0)
    media_worker_nice: int = Field(default=10, ge=0, le=19)  # media work's priority below requests'
    media_timeout: float = Field(default=60.0, gt=0)  # seconds to read + decode a request's media
    # media by reference: a part's `uuid` keeps its decoded media this many minutes after
    # last use, within this many bytes (least recently used first); 0 bytes: off
    media_uuid_ttl: float = Field(default=10.0, gt=0)
    media_uuid_cache_bytes: int = Field(default=256 * MiB, ge=0)
    # choices (`n`) one chat completion may ask for; above it a 400. On the batched engine
    # the n choices share one prefill; choice i samples with seed + i
    max_n: int = Field(default=8, ge=1)
    # a request field this server does not know: False = accepted and named in the log (as
    # vLLM does), True = a 400 naming it. Fields that change the answer and are not served
    # are a 400 either way (api/common/fields.py)
    strict_fields: bool = False

    # --- auth and metrics ----------------------------------------------------------------
    api_keys: list[str] = Field(default_factory=list)  # Bearer keys for /v1/*; empty: open
    admin_keys: list[str] = Field(default_factory=list)  # for /admin/*; empty: admin closed
    metrics_public: bool = True
    # every single-choice answer carries its timings (vLLM's --enable-per-request-metrics)
    per_request_metrics: bool = False
    # with API keys: "key" salts prefix-cache blocks by key (no key shares cached blocks with
    # another), "global" shares them between keys
    prefix_cache_scope: Literal["key", "global"] = "key"
    max_concurrent_per_key: int = Field(default=0, ge=0)  # generations at once per key; 0: no cap
    ui: bool = True  # the web console at / (static files in the package); --no-ui: API only

    # --- idle watchdog (a GPU box that stops itself when idle) ------------------------------
    idle_seconds: float | None = None  # None: off; a GPU box that bills by the hour: 480
    idle_check_interval: float = 30.0
    idle_command: list[str] | None = None  # argv, never a shell: ["sudo", "shutdown", "-h", "now"]
    activity_file: str | None = None  # e.g. /tmp/vlm2vec_last_activity for older tools
    deregister_url: str | None = None  # POSTed {"instance", "reason"} before the idle command
    deregister_command: list[str] | None = None  # or an argv run before the idle command
    instance_id: str | None = None
    deregister_timeout: float = 10.0

    # --- resumable streams -------------------------------------------------------------
    persist_sessions: bool = False
    sessions_db_path: str = "sessions.db"
    sessions_ttl_seconds: float = 600.0
    cancel_after_disconnect_seconds: float = 3600.0  # 0 = never auto-cancel
    stream_ring_size: int = 2048
    redis_url: str | None = None  # set to share streams between server replicas

    # --- files and batches (/v1/files, /v1/batches) --------------------------------------
    # uploaded files, batch results and their SQLite index (files.db); None: vlmserve-data/
    # next to sessions_db_path. Nothing is created before the first upload.
    files_dir: str | None = None
    # one upload's bytes; the whole request is also under max_body_bytes, so keep this below it
    files_max_bytes: int = Field(default=48 * MiB, ge=1)
    # per API key: its files, batch output files and the results of its unfinished batches
    files_quota_bytes: int = Field(default=10 * 2**30, ge=0)  # 0 = none
    files_ttl_seconds: float = Field(default=30 * 86400.0, ge=0)  # files and batches; 0 = keep
    batch_max_concurrency: int = Field(default=1, ge=1)  # batch lines in flight, all batches
    batch_max_unfinished: int = Field(default=16, ge=1)  # per API key: batches not yet finished

    @property
    def files_path(self) -> Path:
        """Where files and batches live (``files_dir``, or vlmserve-data/ by sessions.db)."""
        if self.files_dir:
            return Path(self.files_dir)
        return Path(self.sessions_db_path).parent / "vlmserve-data"

    @field_validator("idle_command", "deregister_command", mode="before")
    @classmethod
    def _argv(cls, value: object) -> object:
        if isinstance(value, str) and not value.lstrip().startswith("["):
            raise ValueError(
                'must be an argv list, e.g. VLMSERVE_IDLE_COMMAND=\'["sudo", "shutdown", '
                '"-h", "now"]\' (it never runs through a shell)'
            )
        return value

    @field_validator(
        "kv_cache_memory", "files_max_bytes", "files_quota_bytes", "media_memory", mode="before"
    )
    @classmethod
    def _size(cls, value: object) -> object:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        ok = value in ("auto", "cpu", "cuda", "mps") or value.startswith("cuda:")
        if not ok:
            raise ValueError(f"device {value!r} is not one of auto, cpu, cuda, cuda:N, mps")
        return value

    def model_configs(self) -> list[ModelConfig]:
        """The models to serve: ``[[models]]`` entries, or the single ``--model``."""
        if self.models:
            return list(self.models)
        if self.model:
            return [ModelConfig(name=self.served_model_name, source=self.model)]
        return []

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags, then ``VLMSERVE_*`` variables, then a config file's table (no .env file, no
        secrets directory)."""
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        table = getattr(settings_cls, "file_table", None)
        return sources if table is None else (*sources, InitSettingsSource(settings_cls, table))


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings; ``overrides`` (CLI flags) whose value is None are ignored."""
    if config_file is None:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    if not config_file.is_file():
        raise ConfigError(f"config file {config_file} does not exist")
    return settings_over(tomllib.loads(config_file.read_text()), overrides)


def settings_over(table: dict[str, Any], overrides: dict[str, Any]) -> Settings:
    """The settings of a config file's ``table``, under the ``VLMSERVE_*`` variables, under
    the flags in ``overrides`` (those whose value is None are ignored)."""
    given = {k: v for k, v in overrides.items() if v is not None}

    class _FileSettings(Settings):
        file_table = table

    return Settings.model_validate(_FileSettings(**given).model_dump())
