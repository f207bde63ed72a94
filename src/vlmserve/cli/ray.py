"""``vlmserve ray serve``: run vlmserve as a Ray Serve application (``ray_serve/app.py``).

Ray is imported only when the command runs: vlmserve works without the ``ray`` extra.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from vlmserve.errors import ConfigError

__all__ = ["ray_app"]

console = Console(stderr=True)
ray_app = typer.Typer(
    help="Scale out on Ray Serve: one deployment per model, the OpenAI API in front "
    "(the ray extra: pip install 'vlmserve\\[ray]').",
    no_args_is_help=True,
)


@ray_app.command("serve")
def serve_command(
    config: Annotated[
        Path,
        typer.Option(
            "--config", "-c", help="vlmserve.toml with \\[\\[models]] and a \\[ray] table."
        ),
    ],
    address: Annotated[
        Optional[str],  # noqa: UP045 - typer needs Optional on py3.10
        typer.Option(
            help="Ray cluster to join (auto, ray://HOST:10001); default: "
            "RAY_ADDRESS, else a new local cluster."
        ),
    ] = None,
    host: Annotated[Optional[str], typer.Option(help="HTTP address.")] = None,  # noqa: UP045
    port: Annotated[Optional[int], typer.Option(help="HTTP port.")] = None,  # noqa: UP045
    direct_ingress: Annotated[
        bool,
        typer.Option(
            "--direct-ingress",
            help="Ray Serve's direct ingress (experimental in Ray): each ingress replica "
            "serves HTTP on a port of its own (30000-31000), no Ray HTTP proxy in between "
            "(~8 ms less TTFT); put your load balancer in front of the URLs printed. For a "
            "new local cluster; a joined cluster needs RAY_SERVE_ENABLE_DIRECT_INGRESS=1 "
            "where it was started.",
        ),
    ] = False,
) -> None:
    """Deploy the models of --config on Ray Serve and serve the API until stopped."""
    from vlmserve.ray_serve.config import load_ray_setup

    try:
        setup = load_ray_setup(config, host=host, port=port)
    except (ConfigError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(code=2) from None
    _default_fast_path(address)
    if direct_ingress:
        _direct_ingress(address)
    try:
        import ray
        from ray import serve
    except ImportError:
        console.print("[bold red]error:[/] Ray is not installed: pip install 'vlmserve\\[ray]'")
        raise typer.Exit(code=2) from None
    from vlmserve.ray_serve.app import build_application

    ray.init(address=address)
    settings = setup.settings
    serve.start(http_options={"host": settings.host, "port": settings.port})
    name, prefix = setup.ray.app_name, setup.ray.route_prefix
    # with direct ingress Ray still runs its proxy on the head node (a fallback route)
    console.print(f"vlmserve on Ray Serve: http://{settings.host}:{settings.port}{prefix}")
    application = build_application(setup)
    serve.run(application, name=name, route_prefix=prefix, blocking=not direct_ingress)
    if direct_ingress:
        _serve_direct(name, settings.host)


def _direct_ingress(address: str | None) -> None:
    """Set before Ray is imported (its processes read the flag when they start)."""
    from vlmserve.ray_serve.config import DIRECT_INGRESS_ENV

    if address is not None or os.environ.get("RAY_ADDRESS"):
        if os.environ.get(DIRECT_INGRESS_ENV) != "1":
            console.print(
                f"[yellow]note:[/] a joined cluster serves direct ingress only if it was "
                f"started with {DIRECT_INGRESS_ENV}=1"
            )
        return
    os.environ[DIRECT_INGRESS_ENV] = "1"


def _serve_direct(name: str, host: str) -> None:
    """Print each ingress replica's URL, then serve until Ctrl-C (as ``blocking=True``)."""
    from ray import serve

    from vlmserve.ray_serve.app import ingress_urls

    # the replicas bind the HTTP host; one that is not every interface is where they answer
    urls = ingress_urls(name, None if host in ("0.0.0.0", "::", "") else host)
    if not urls:
        console.print(
            "[yellow]note:[/] no ingress replica serves its own port (is direct "
            "ingress on in this cluster?)"
        )
    for url in urls:
        console.print(f"vlmserve on Ray Serve (direct ingress): {url}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


def _default_fast_path(address: str | None) -> None:
    """A new local cluster runs Ray Serve's throughput-optimized mode unless the environment
    says otherwise (``RAY_SERVE_THROUGHPUT_OPTIMIZED=0`` opts out). Measured on 2 cores: TTFT
    added over ``vlmserve serve`` 12.6 ms instead of 19.6, one replica's tok/s +19% at c=1 and
    +28% at c=8 (docs/performance.md). A cluster joined by address keeps its own environment.
    Set before Ray is imported: Serve reads it into its constants then."""
    if address is None and not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
