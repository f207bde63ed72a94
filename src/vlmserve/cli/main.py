"""``vlmserve``: serve a model, or try the API offline with a tiny random-weight demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from vlmserve.cli import loadtest, preflight, serve, tag
from vlmserve.cli.ray import ray_app
from vlmserve.cli.registry import registry_app
from vlmserve.config import load_settings
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
app.add_typer(ray_app, name="ray")
app.command("preflight")(preflight.command)
app.command("loadtest")(loadtest.command)
app.command("tag")(tag.command)
app.command("serve")(serve.command)
console = Console(stderr=True)

ConfigOpt = Annotated[
    Optional[Path],  # noqa: UP045 - typer needs Optional on py3.10
    typer.Option("--config", "-c", help="TOML file with settings (flags and VLMSERVE_* env win)."),
]
HostOpt = Annotated[Optional[str], typer.Option(help="Address to bind (default: 127.0.0.1).")]  # noqa: UP045
PortOpt = Annotated[Optional[int], typer.Option(help="Port (default: 8000).")]  # noqa: UP045
StrictOpt = Annotated[
    bool, typer.Option("--strict-fields", help="A request field the server does not know is a 400.")
]


@app.command()
def demo(
    host: HostOpt = None,
    port: PortOpt = None,
    config: ConfigOpt = None,
    strict_fields: StrictOpt = False,
    cors_allow_origins: serve.CorsOrigins = None,
    api_key: serve.ApiKeys = None,
    admin_key: serve.AdminKeys = None,
) -> None:
    """Serve tiny RANDOM-WEIGHT models (built once, cached): try every endpoint offline.

    Two models: `tiny-qwen2-vl` (chat, caption) and `tiny-vlm2vec` (the same tiny Qwen2-VL
    with a LoRA adapter, for /v1/embeddings, /encode-text and /encode-video). The auth and
    CORS flags are those of `vlmserve serve`.
    """
    auth = serve.list_settings(
        {"cors_allow_origins": cors_allow_origins, "api_key": api_key, "admin_key": admin_key}
    )
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
        {
            "name": "tiny-vlm2vec",
            "source": str(path),
            "adapter": str(adapter),
            "roles": ["embedding"],
        },
    ]
    try:
        settings = load_settings(
            config,
            models=models,
            host=host,
            port=port,
            exit_on_load_failure=True,
            strict_fields=strict_fields or None,
            **auth,
        )
    except (ConfigError, ValueError) as exc:
        serve.fail(exc)
    serve.run(settings)


if __name__ == "__main__":
    app()
