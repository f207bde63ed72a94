"""A real server process whose one chat model is ``LogprobsBackend`` (no weights): the CLI's
own server (``vlmserve.cli.serve.run``: its HTTP protocol, its settings from ``VLMSERVE_*``)
around an answer that is as large as a request asks, at once.

    python -m vlmserve.testing.scripted_server --served-model-name tiny --port 8000
"""

from __future__ import annotations

import argparse

from vlmserve.cli.serve import run
from vlmserve.config import Settings
from vlmserve.registry.handles import ModelHandle
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.scripted_backend import LogprobsBackend

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--served-model-name", default="scripted")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    settings = Settings(host=args.host, port=args.port)
    name = args.served_model_name
    handle = ModelHandle(name=name, roles=["chat"], backend=LogprobsBackend(name))
    run(settings, ModelManager([handle]))


if __name__ == "__main__":
    main()
