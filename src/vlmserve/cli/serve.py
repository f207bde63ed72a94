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

CONFIG_HELP = "TOML file with settings (flags and VLMSERVE_* variables win)."
MODEL, SERVER, ENGINE, REQUESTS, LIFECYCLE = (
    "Model",
    "Server and auth",
    "Engine",
    "Requests: defaults and limits",
    "Lifecycle and streams",
)


def _key_help(what: str, env: str) -> str:
    return (
        f"{what} (repeatable). A flag shows in `ps`: in production prefer "
        f"{env}='[\"...\"]' in the environment."
    )


# setting -> (help panel, text); ``_opt`` adds the setting's default to the text
HELP = {
    "model": (MODEL, "Local model directory, or hub repo id ORG/NAME."),
    "served_model_name": (MODEL, "Name clients put in `model` (default: the directory's name)."),
    "registry": (
        MODEL,
        "Registry file (TOML/JSON): hf entries load here, openai/vllm entries are proxied.",
    ),
    "device": (MODEL, "auto | cpu | cuda | cuda:N."),
    "dtype": (MODEL, "auto | bfloat16 | float16 | float32; auto: bf16 on GPU, fp32 on CPU."),
    "attn_implementation": (MODEL, "sdpa | eager | flash_attention_2 (default: the model's)."),
    "trust_remote_code": (MODEL, "Run model code shipped with the checkpoint."),
    "min_pixels": (MODEL, "Smallest image size after resizing, in pixels (default: the model's)."),
    "max_pixels": (MODEL, "Largest image size after resizing, in pixels (default: the model's)."),
    "max_model_len": (MODEL, "Prompt + completion token limit."),
    "reasoning_parser": (
        MODEL,
        "qwen3 | deepseek_r1: a thinking model's reasoning goes to "
        "`reasoning` (default: detected from the chat template).",
    ),
    "tool_call_parser": (
        MODEL,
        "hermes: how tool calls are read from the answer (default: "
        "hermes, for requests with `tools`).",
    ),
    "chat_template": (
        MODEL,
        "Chat template replacing the checkpoint's: a .jinja file or the "
        "template text (checked when the model loads).",
    ),
    "host": (SERVER, "Address to bind."),
    "port": (SERVER, "Port."),
    "log_level": (SERVER, "debug | info | warning | error."),
    "cors_allow_origins": (
        SERVER,
        "Browser origin allowed to call the API, e.g. "
        "http://localhost:3000 (repeatable or a comma list; default: "
        "none).",
    ),
    "api_keys": (
        SERVER,
        _key_help("Key required on /v1 and the worker routes", "VLMSERVE_API_KEYS"),
    ),
    "admin_keys": (
        SERVER,
        _key_help("Key that opens /admin (closed without one)", "VLMSERVE_ADMIN_KEYS"),
    ),
    "max_queued_requests": (SERVER, "Requests waiting per model before 429."),
    "prefix_cache_scope": (
        SERVER,
        "key | global: with API keys, prefix-cache blocks shared "
        "only within a key, or between keys.",
    ),
    "ui": (SERVER, "Serve the web console at / (--no-ui: the API only)."),
    "per_request_metrics": (
        SERVER,
        "Every single-choice answer carries its timings (`metrics`, as vLLM's "
        "--enable-per-request-metrics); one request asks with include_metrics.",
    ),
    "max_num_seqs": (
        ENGINE,
        "Sequences decoded together (continuous batching); 1 = one at a time.",
    ),
    "max_num_batched_tokens": (ENGINE, "Prompt tokens prefilled per engine step."),
    "vision_cache_bytes": (ENGINE, "Vision-tower outputs cached by image content; 0 = off."),
    "processor_cache_bytes": (ENGINE, "Preprocessed images cached by content; 0 = off."),
    "stream_interval": (ENGINE, "Tokens per stream event when 4+ requests decode; 1 = each token."),
    "kv_cache_memory": (
        ENGINE,
        "KV cache budget per model: bytes or a size (512MiB, 4GiB); "
        "0 = auto (docs/engine.md). A prompt that can never fit is a "
        "400.",
    ),
    "gpu_memory_utilization": (
        ENGINE,
        "Share of the GPU a model may use: weights, KV cache "
        "and a prefill's activations (measured at load).",
    ),
    "enable_prefix_caching": (
        ENGINE,
        "Reuse the K/V of prompts' cached full blocks (a shared "
        "system prompt, the same image again): less prefill. On by default, as in vLLM.",
    ),
    "cuda_graphs": (
        ENGINE,
        "CUDA (experimental): decode attention reads the paged KV cache "
        "in place and each decode step replays a CUDA graph.",
    ),
    "enforce_eager": (
        ENGINE,
        "With --cuda-graphs: run each decode step eagerly instead of "
        "replaying its CUDA graph (slower; for debugging).",
    ),
    "engine_process": (
        ENGINE,
        "Each chat model's engine in its own process: HTTP and "
        "streaming do not share its GIL, a crashed one is restarted "
        "(--no-engine-process: in this process).",
    ),
    "max_tokens": (REQUESTS, "`max_tokens` of a request that gives none."),
    "temperature": (REQUESTS, "`temperature` of a request that gives none."),
    "max_body_bytes": (REQUESTS, "Request body limit (413 before parsing)."),
    "max_media_per_request": (REQUESTS, "Images + videos per request."),
    "max_media_bytes": (REQUESTS, "Bytes per image or video."),
    "max_image_pixels": (REQUESTS, "Width x height per image, checked before decoding."),
    "max_video_frames": (REQUESTS, "Frames sampled per video."),
    "media_memory": (
        REQUESTS,
        "Bytes of media in flight (bodies, decoded pixels), a size (256MiB, "
        "4GiB); over it a body waits, then 429. Default: 1/4 of RAM, at most 4 GiB.",
    ),
    "media_workers": (
        REQUESTS,
        "Processes that read and decode media; 0 = a thread of the API process "
        "(default: half the cores, 1-4).",
    ),
    "media_timeout": (REQUESTS, "Seconds to read and decode one request's media (408)."),
    "allowed_local_media_path": (
        REQUESTS,
        "Directory that local media paths may be read from (repeatable; default: none).",
    ),
    "strict_fields": (
        REQUESTS,
        "A request field this server does not know is a 400 (default: "
        "accepted and named in the log).",
    ),
    "load_on_startup": (LIFECYCLE, "Load models on their first request, not at start-up."),
    "keep_alive": (LIFECYCLE, "Idle seconds before a model unloads; -1 = never."),
    "warmup": (
        LIFECYCLE,
        "Each chat model answers a text and an image request of its own before /ready "
        "(--no-warmup: ready as soon as loaded).",
    ),
    "liveness_timeout": (
        LIFECYCLE,
        "Seconds an engine may have requests without a step starting or ending before its "
        "model is failed (/health) and reloaded; at least 3x its longest step; 0 = off.",
    ),
    "max_loaded_models": (
        LIFECYCLE,
        "Models loaded at once (the least recently used unloads first); 0 = no cap.",
    ),
    "persist_sessions": (
        LIFECYCLE,
        "Keep stream events in SQLite: streams resume after a restart.",
    ),
    "redis_url": (LIFECYCLE, "redis://HOST:PORT/DB: share streams between server replicas."),
}


def _with_default(field: str, text: str) -> str:
    value = Settings.model_fields[field].get_default(call_default_factory=True)
    if value is None or isinstance(value, (bool, list)):
        return text
    if field.endswith("_bytes") and value >= 2**20:
        value = f"{value / 2**20:g} MiB"
    return f"{text.removesuffix('.')} (default: {value})."


def _opt(field: str, *names: str) -> Any:
    """The flag for setting ``field``: its help (with the default) in its panel."""
    panel, text = HELP[field]
    return typer.Option(*names, help=_with_default(field, text), rich_help_panel=panel)


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
    import uvicorn

    from vlmserve.api.app import build_app
    from vlmserve.media.workers.memory import return_large_buffers

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
    return_large_buffers()  # a media burst's buffers leave RSS when freed (media/workers)
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
