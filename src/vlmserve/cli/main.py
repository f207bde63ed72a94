"""``vlmserve``: serve a model, or try the API offline with a tiny random-weight demo model."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from vlmserve.cli import loadtest, preflight, tag
from vlmserve.cli.registry import registry_app
from vlmserve.config import Settings, load_settings
from vlmserve.errors import ConfigError

app = typer.Typer(
    help=(
        "vlmserve: an OpenAI-compatible server for vision-language models (chat with images "
        "and video, resumable streams).\n\n"
        "Start with `vlmserve demo` (no download, tiny random model) or "
        "`vlmserve serve --model Qwen/Qwen2-VL-2B-Instruct`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(registry_app, name="registry")
app.command("preflight")(preflight.command)
app.command("loadtest")(loadtest.command)
app.command("tag")(tag.command)
console = Console(stderr=True)

ConfigOpt = Annotated[
    Optional[Path],  # noqa: UP045 - typer needs Optional on py3.10
    typer.Option("--config", "-c", help="TOML file with settings (flags and VLMSERVE_* env win)."),
]
HostOpt = Annotated[Optional[str], typer.Option(help="Address to bind (default: 127.0.0.1).")]  # noqa: UP045
PortOpt = Annotated[Optional[int], typer.Option(help="Port (default: 8000).")]  # noqa: UP045


def _run(settings: Settings) -> None:
    import uvicorn

    from vlmserve.api.app import build_app

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app_ = build_app(settings)
    # The engine thread and the event loop share the GIL. Python hands it over every 5 ms by
    # default, so after each torch call the engine could wait up to 5 ms for the loop's SSE work;
    # at 1 ms it gets it back sooner (measured: +18% output tokens/s at 8 concurrent streams).
    sys.setswitchinterval(0.001)
    uvicorn.run(
        app_,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http="h11",  # h11 caps header size; httptools (uvicorn's "auto") has no limit
        h11_max_incomplete_event_size=64 * 1024,
        timeout_graceful_shutdown=30,
    )
    if app_.state.fatal_error:
        console.print(f"[bold red]error:[/] {app_.state.fatal_error}")
        raise typer.Exit(code=1)


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(code=2)


@app.command()
def serve(
    model: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Local model directory or hub repo id (image-text-to-text model)."),
    ] = None,
    served_model_name: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Name clients put in `model` (default: the model dir's name)."),
    ] = None,
    host: HostOpt = None,
    port: PortOpt = None,
    device: Annotated[
        Optional[str], typer.Option(help="auto | cpu | cuda | cuda:N (default: auto).")  # noqa: UP045
    ] = None,
    dtype: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="auto | bfloat16 | float16 | float32 (default: auto: bf16 on GPU)."),
    ] = None,
    max_model_len: Annotated[
        Optional[int], typer.Option(help="Prompt + completion token limit.")  # noqa: UP045
    ] = None,
    attn_implementation: Annotated[
        Optional[str], typer.Option(help="sdpa | eager | flash_attention_2 (default: model's).")  # noqa: UP045
    ] = None,
    min_pixels: Annotated[
        Optional[int], typer.Option(help="Smallest image size after resizing, in pixels.")  # noqa: UP045
    ] = None,
    max_pixels: Annotated[
        Optional[int], typer.Option(help="Largest image size after resizing, in pixels.")  # noqa: UP045
    ] = None,
    max_video_frames: Annotated[
        Optional[int], typer.Option(help="Frames sampled per video (default: 16).")  # noqa: UP045
    ] = None,
    trust_remote_code: Annotated[
        Optional[bool], typer.Option(help="Run model code shipped with the checkpoint.")  # noqa: UP045
    ] = None,
    log_level: Annotated[
        Optional[str], typer.Option(help="debug | info | warning | error (default: info).")  # noqa: UP045
    ] = None,
    registry: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Registry file (TOML/JSON): hf entries load here, openai/vllm proxy."),
    ] = None,
    max_num_seqs: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Sequences decoded together (continuous batching; 1 = one at a time)."),
    ] = None,
    max_num_batched_tokens: Annotated[
        Optional[int], typer.Option(help="Prompt tokens prefilled per engine step.")  # noqa: UP045
    ] = None,
    vision_cache_bytes: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Bytes of vision-tower outputs cached by image hash (0 = off)."),
    ] = None,
    processor_cache_bytes: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Bytes of preprocessed images cached by content (0 = off)."),
    ] = None,
    stream_interval: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Tokens per stream event when 4+ requests decode (1 = every token)."),
    ] = None,
    max_queued_requests: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Requests waiting per model before 429 (default: 256)."),
    ] = None,
    api_key: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option(help="Require this Bearer key on /v1 and worker routes (repeatable)."),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Serve a model over the OpenAI API (chat completions with images and video, streams)."""
    try:
        settings = load_settings(
            config,
            model=model,
            served_model_name=served_model_name,
            host=host,
            port=port,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            attn_implementation=attn_implementation,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            max_video_frames=max_video_frames,
            trust_remote_code=trust_remote_code,
            log_level=log_level,
            registry=registry,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            vision_cache_bytes=vision_cache_bytes,
            processor_cache_bytes=processor_cache_bytes,
            stream_interval=stream_interval,
            max_queued_requests=max_queued_requests,
            api_keys=api_key or None,
            exit_on_load_failure=True,
        )
    except (ConfigError, ValueError) as exc:
        _fail(exc)
    if not settings.model_configs() and not settings.registry:
        _fail(ConfigError("no model given: pass --model PATH_OR_REPO, --registry FILE, or "
                          "[[models]] in --config"))  # fmt: skip
    _run(settings)


@app.command()
def demo(host: HostOpt = None, port: PortOpt = None, config: ConfigOpt = None) -> None:
    """Serve tiny RANDOM-WEIGHT models (built once, cached): try every endpoint offline.

    Two models: `tiny-qwen2-vl` (chat, caption) and `tiny-vlm2vec` (the same tiny Qwen2-VL
    with a LoRA adapter, for /v1/embeddings, /encode-text and /encode-video).
    """
    from vlmserve.testing.tiny import build_lora_adapter, build_qwen2_vl

    console.print("[bold]vlmserve demo[/]: building the tiny demo checkpoints (cached after once)…")
    path = build_qwen2_vl()
    adapter = build_lora_adapter(path)
    console.print(
        "[bold yellow]The demo models have RANDOM weights: their answers are gibberish.[/] "
        "They exercise the real loading and inference code, not a real model.\n"
        f"Checkpoint: {path}\nModels: [bold]tiny-qwen2-vl[/] (chat, caption), "
        "[bold]tiny-vlm2vec[/] (embedding)"
    )
    models = [
        {"name": "tiny-qwen2-vl", "source": str(path), "roles": ["chat", "caption"]},
        {"name": "tiny-vlm2vec", "source": str(path), "adapter": str(adapter),
         "roles": ["embedding"]},
    ]  # fmt: skip
    try:
        settings = load_settings(
            config, models=models, host=host, port=port, exit_on_load_failure=True
        )
    except (ConfigError, ValueError) as exc:
        _fail(exc)
    _run(settings)


if __name__ == "__main__":
    app()
