"""Client tools: ``preflight`` (is a server ready?) and ``loadtest`` (how fast is it?).

Only httpx, rich, Pillow, PyAV and the stdlib: no torch, transformers or fastapi, so the CLI
starts fast and a gateway can run a preflight in-process through an injected transport.
"""

from vlmserve.client.http import ServerUnreachable
from vlmserve.client.loadtest import LoadConfig, render_report, run_load
from vlmserve.client.preflight import CheckResult, PreflightReport, run_preflight
from vlmserve.client.stats import LoadReport, RequestRecord, Summary

__all__ = [
    "CheckResult",
    "LoadConfig",
    "LoadReport",
    "PreflightReport",
    "RequestRecord",
    "ServerUnreachable",
    "Summary",
    "render_report",
    "run_load",
    "run_preflight",
]
