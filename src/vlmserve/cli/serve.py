"""``vlmserve serve``: its flags, and running the server they configure.

Each flag is named after the setting it sets (``--max-num-seqs`` sets ``max_num_seqs``;
``--api-key`` and ``--admin-key`` add to ``api_keys`` and ``admin_keys``; ``--lazy-load`` sets
``load_on_startup`` false), so the command passes them on by name. Settings without a flag
are listed in ``ENV_ONLY``: they are set with ``VLMSERVE_*`` variables or the ``--config``
TOML file, and a unit test keeps the flags and that list covering every setting.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from vlmserve.cli.serve_help import CONFIG_HELP, HELP, SERVER
from vlmserve.cli.serve_help import opt as _opt
from vlmserve.config import Settings, load_settings
from vlmserve.errors import ConfigError

if TYPE_CHECKING:
    from vlmserve.registry.manager import ModelManager

__all__ = [
    "ENV_ONLY",
    "INTERNAL",
    "AdminKeys",
    "ApiKeys",
    "CorsOrigins",
    "command",
    "fail",
    "list_settings",
    "run",
]

console = Console(stderr=True)

# Set by the CLI itself, never by users.
INTERNAL = ("exit_on_load_failure", "models")
# Settings with no flag: VLMSERVE_<NAME> or the --config TOML file.
ENV_ONLY = (
    "registry_discovered",
    "on_demand_activation",
    "drain_timeout_seconds",
    "activation_timeout_seconds",
    "embed_max_batch_size",
    "embed_batch_wait_ms",
    "rerank_max_batch_size",
    "rerank_max_documents",
    "upstream_health_interval",
    "upstream_max_failures",
    "upstream_eject_seconds",
    "gateway_passthrough",
    "register_url",
    "advertise_url",
    "gateway_key",
    "max_video_pixels",
    "max_video_decode_frames",
    "media_image_formats",
    "media_fetch_timeout",
    "media_max_redirects",
    "media_queue",
    "media_worker_nice",
    "media_allow_private_networks",
    "media_uuid_ttl",
    "media_uuid_cache_bytes",
    "max_n",
    "logprobs_mode",
    "metrics_public",
    "idle_seconds",
    "idle_check_interval",
    "idle_command",
    "activity_file",
    "deregister_url",
    "deregister_command",
    "instance_id",
    "deregister_timeout",
    "sessions_db_path",
    "sessions_ttl_seconds",
    "cancel_after_disconnect_seconds",
    "stream_ring_size",
    "files_dir",
    "files_max_bytes",
    "files_quota_bytes",
    "files_ttl_seconds",
    "batch_max_concurrency",
    "max_concurrent_per_key",
    "batch_max_unfinished",
    "request_head_timeout",
    "max_chars_per_token",
)
# Repeatable flags whose values may also be comma lists, and the setting each adds to.
LIST_FLAGS = {
    "api_key": "api_keys",
    "admin_key": "admin_keys",
    "cors_allow_origins": "cors_allow_origins",
    "allowed_local_media_path": "allowed_local_media_path",
}

Str = Optional[str]  # noqa: UP045 - typer needs Optional on py3.10
Int = Optional[int]  # noqa: UP045
Float = Optional[float]  # noqa: UP045
Bool = Optional[bool]  # noqa: UP045
Strs = Optional[list[str]]  # noqa: UP045

# The auth and CORS flags: `vlmserve demo` takes the very same ones.
CorsOrigins = Annotated[Strs, _opt("cors_allow_origins")]
ApiKeys = Annotated[Strs, _opt("api_keys")]
AdminKeys = Annotated[Strs, _opt("admin_keys")]


def list_settings(flags: dict[str, Any]) -> dict[str, Any]:
    """The repeatable flags in ``flags`` (``LIST_FLAGS``) popped and returned under their
    settings' names, each value split on commas; an unset flag gives None (not set)."""
    out: dict[str, Any] = {}
    for flag, field in LIST_FLAGS.items():
        values = flags.pop(flag, None)
        out[field] = [v.strip() for item in values for v in item.split(",")] if values else None
    return out


def command(
    model: Annotated[Str, _opt("model")] = None,
    served_model_name: Annotated[Str, _opt("served_model_name")] = None,
    registry: Annotated[Str, _opt("registry")] = None,
    device: Annotated[Str, _opt("device")] = None,
    dtype: Annotated[Str, _opt("dtype")] = None,
    attn_implementation: Annotated[Str, _opt("attn_implementation")] = None,
    trust_remote_code: Annotated[Bool, _opt("trust_remote_code", "--trust-remote-code")] = None,
    min_pixels: Annotated[Int, _opt("min_pixels")] = None,
    max_pixels: Annotated[Int, _opt("max_pixels")] = None,
    max_model_len: Annotated[Int, _opt("max_model_len")] = None,
    reasoning_parser: Annotated[Str, _opt("reasoning_parser")] = None,
    tool_call_parser: Annotated[Str, _opt("tool_call_parser")] = None,
    chat_template: Annotated[Str, _opt("chat_template")] = None,
    host: Annotated[Str, _opt("host")] = None,
    port: Annotated[Int, _opt("port")] = None,
    log_level: Annotated[Str, _opt("log_level")] = None,
    cors_allow_origins: CorsOrigins = None,
    api_key: ApiKeys = None,
    admin_key: AdminKeys = None,
    max_queued_requests: Annotated[Int, _opt("max_queued_requests")] = None,
    prefix_cache_scope: Annotated[Str, _opt("prefix_cache_scope")] = None,
    max_num_seqs: Annotated[Int, _opt("max_num_seqs")] = None,
    max_num_batched_tokens: Annotated[Int, _opt("max_num_batched_tokens")] = None,
    decode_share: Annotated[Float, _opt("decode_share")] = None,
    vision_cache_bytes: Annotated[Int, _opt("vision_cache_bytes")] = None,
    processor_cache_bytes: Annotated[Int, _opt("processor_cache_bytes")] = None,
    stream_interval: Annotated[Int, _opt("stream_interval")] = None,
    kv_cache_memory: Annotated[Str, _opt("kv_cache_memory")] = None,
    gpu_memory_utilization: Annotated[Float, _opt("gpu_memory_utilization")] = None,
    enable_prefix_caching: Annotated[
        Bool, _opt("enable_prefix_caching", "--enable-prefix-caching")
    ] = None,
    no_prefix_caching: Annotated[
        Bool,
        typer.Option(
            "--no-enable-prefix-caching",
            help="Compute every prompt whole (prefix caching off).",
            rich_help_panel=HELP["enable_prefix_caching"][0],
        ),
    ] = None,
    cuda_graphs: Annotated[Bool, _opt("cuda_graphs", "--cuda-graphs")] = None,
    enforce_eager: Annotated[Bool, _opt("enforce_eager", "--enforce-eager")] = None,
    no_engine_process: Annotated[Bool, _opt("engine_process", "--no-engine-process")] = None,
    max_tokens: Annotated[Int, _opt("max_tokens")] = None,
    temperature: Annotated[Float, _opt("temperature")] = None,
    max_body_bytes: Annotated[Int, _opt("max_body_bytes")] = None,
    max_media_per_request: Annotated[Int, _opt("max_media_per_request")] = None,
    max_media_bytes: Annotated[Int, _opt("max_media_bytes")] = None,
    max_image_pixels: Annotated[Int, _opt("max_image_pixels")] = None,
    max_video_frames: Annotated[Int, _opt("max_video_frames")] = None,
    media_memory: Annotated[Str, _opt("media_memory")] = None,
    media_workers: Annotated[Int, _opt("media_workers")] = None,
    media_timeout: Annotated[Float, _opt("media_timeout")] = None,
    allowed_local_media_path: Annotated[Strs, _opt("allowed_local_media_path")] = None,
    strict_fields: Annotated[Bool, _opt("strict_fields", "--strict-fields")] = None,
    lazy_load: Annotated[Bool, _opt("load_on_startup", "--lazy-load")] = None,
    no_ui: Annotated[Bool, _opt("ui", "--no-ui")] = None,
    per_request_metrics: Annotated[
        Bool, _opt("per_request_metrics", "--per-request-metrics")
    ] = None,
    keep_alive: Annotated[Float, _opt("keep_alive")] = None,
    no_warmup: Annotated[Bool, _opt("warmup", "--no-warmup")] = None,
    liveness_timeout: Annotated[Float, _opt("liveness_timeout")] = None,
    max_loaded_models: Annotated[Int, _opt("max_loaded_models")] = None,
    persist_sessions: Annotated[Bool, _opt("persist_sessions", "--persist-sessions")] = None,
    redis_url: Annotated[Str, _opt("redis_url")] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help=CONFIG_HELP,
            rich_help_panel=SERVER,
        ),
    ] = None,
) -> None:
    """Serve a model over the OpenAI API (chat completions with images and video, streams).

    Flags override VLMSERVE_* variables, which override the --config file (docs/operations.md).
    """
    # first statement: locals() is exactly the parameters, each named after its setting
    flags: dict[str, Any] = {k: v for k, v in locals().items() if k != "config"}
    flags["load_on_startup"] = False if flags.pop("lazy_load") else None
    flags["ui"] = False if flags.pop("no_ui") else None
    flags["engine_process"] = False if flags.pop("no_engine_process") else None
    if flags.pop("no_prefix_caching"):
        flags["enable_prefix_caching"] = False
    flags["warmup"] = False if flags.pop("no_warmup") else None
    flags.update(list_settings(flags))
    try:
        settings = load_settings(config, **flags, exit_on_load_failure=True)
    except (ConfigError, ValueError) as exc:
        fail(exc)
    if not settings.model_configs() and not settings.registry:
        fail(
            ConfigError(
                "no model given: pass --model PATH_OR_REPO, --registry FILE, or "
                "[[models]] in --config"
            )
        )
    run(settings)


def fail(exc: Exception) -> NoReturn:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    raise typer.Exit(code=2)


def run(settings: Settings, models: ModelManager | None = None) -> None:
    """Serve until stopped; exit 1 with the reason when a model fails to load at start-up.
    ``models``: the manager to serve (default: the one ``settings`` describe)."""
    from vlmserve import heap

    heap.pause()  # until the app is built and imported: heap.py
    import uvicorn

    from vlmserve.api.app import build_app
    from vlmserve.media.workers.memory import API, set_malloc_policy

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = build_app(settings, models)  # a bad model entry (parser, template, key) fails here
    except ConfigError as exc:
        fail(exc)
    # The engine thread and the event loop share the GIL. Python hands it over every 5 ms by
    # default, so after each torch call the engine could wait up to 5 ms for the loop's SSE work;
    # at 1 ms it gets it back sooner (measured: +18% output tokens/s at 8 concurrent streams).
    sys.setswitchinterval(0.001)
    set_malloc_policy(API)  # a media burst's large buffers leave RSS when freed
    # httptools (C) with the request head capped here: h11 (pure Python) capped it itself but
    # cost ~1.7x the CPU per request and per SSE event (cli/http_protocol.py has the figures).
    from vlmserve.cli.http_protocol import with_head_timeout

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=with_head_timeout(settings.request_head_timeout),
        timeout_graceful_shutdown=30,
    )
    _serve(config)
    if app.state.fatal_error:
        console.print(f"[bold red]error:[/] {escape(str(app.state.fatal_error))}", highlight=False)
        raise typer.Exit(code=1)


def _serve(config: Any) -> None:
    """``uvicorn.Server(config).run()``, except that the SIGTERM the app sends itself when a
    model fails at start-up is not raised again after shutdown: uvicorn re-raises the signals
    it caught, which would kill the process (exit 143) before the CLI says why and exits 1."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if config.app.state.fatal_error:
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    Server(config).run()
