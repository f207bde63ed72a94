"""The help of ``vlmserve serve``'s flags: each setting's text and the ``--help`` panel it
shows in, with the setting's default added (``opt``)."""

from __future__ import annotations

from typing import Any

import typer

from vlmserve.config import Settings

__all__ = ["CONFIG_HELP", "ENGINE", "HELP", "LIFECYCLE", "MODEL", "REQUESTS", "SERVER", "opt"]

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


# setting -> (help panel, text); ``opt`` adds the setting's default to the text
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
    "max_num_batched_tokens": (
        ENGINE,
        "Prompt tokens computed per engine step; a longer prompt runs in chunks with the "
        "running streams decoding between them (default 2048 on CPU, 8192 on CUDA).",
    ),
    "decode_share": (
        ENGINE,
        "While streams decode and prompts wait, the least share of the engine's time the "
        "streams get: a prefill step of S seconds is followed by S x share / (1 - share) "
        "seconds of decode-only steps before the next (default 1/3; 0 = prefill whenever a "
        "prompt waits). Not applied while as many prompts wait as streams decode.",
    ),
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
        "replaying its CUDA graph; on CPU: decode attention gathers each "
        "row's blocks instead of the C kernel (slower; for debugging).",
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
        "(default: half the cores, 1-4). With the engine in its own process, as many "
        "again preprocess its Qwen-VL images there, from the first image on.",
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


def with_default(field: str, text: str) -> str:
    value = Settings.model_fields[field].get_default(call_default_factory=True)
    if value is None or isinstance(value, (bool, list)):
        return text
    if field.endswith("_bytes") and value >= 2**20:
        value = f"{value / 2**20:g} MiB"
    return f"{text.removesuffix('.')} (default: {value})."


def opt(field: str, *names: str) -> Any:
    """The flag for setting ``field``: its help (with the default) in its panel."""
    panel, text = HELP[field]
    return typer.Option(*names, help=with_default(field, text), rich_help_panel=panel)
