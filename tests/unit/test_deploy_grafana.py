"""``deploy/grafana/``: every query of the dashboards names a series vlmserve exports (ours,
and vLLM's own dashboard: its queries are listed here, and read from the file itself when it
was fetched into ``dashboards/vllm.json``), and the compose file runs vlmserve, Prometheus and
Grafana with the datasource and dashboards provisioned."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vlmserve.api.metrics import Metrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
SERIES = re.compile(r"\b((?:vllm:|vlmserve_|process_)[a-zA-Z0-9_:]+)")
# The series vLLM's dashboard (examples/observability/prometheus_grafana/grafana.json) queries
VLLM_DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported() -> set[str]:
    """Every sample name ``/metrics`` can carry (by family type, whether or not it has data)."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def expressions(node: Any) -> list[str]:
    """Every ``expr`` of a dashboard (panels, nested rows, targets), and its variables' queries."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for item in node for e in expressions(item)]
    return []


def named(expr: str) -> set[str]:
    """The series an expression names (regex matchers on ``__name__`` name none)."""
    return set(SERIES.findall(re.sub(r'__name__\s*[!=]~\s*"[^"]*"', "", expr)))


def dashboards() -> list[Path]:
    return sorted((GRAFANA / "dashboards").glob("*.json"))


def test_vllms_dashboard_queries_only_series_we_export() -> None:
    missing = set(VLLM_DASHBOARD) - exported()
    assert not missing, f"vLLM's dashboard would show nothing for {sorted(missing)}"


@pytest.mark.parametrize("path", dashboards(), ids=lambda p: p.name)
def test_every_dashboard_query_names_an_exported_series(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    exprs = expressions(dashboard.get("panels", []))
    assert exprs, f"{path.name} has no queries"
    series = exported()
    for expr in exprs:
        unknown = named(expr) - series
        assert not unknown, f"{path.name}: {expr!r} names {sorted(unknown)}, not exported"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name"} <= variables  # what vLLM's dashboard uses too


def test_our_dashboard_has_per_model_and_media_panels() -> None:
    exprs = " ".join(
        expressions(json.loads((GRAFANA / "dashboards" / "vlmserve.json").read_text()))
    )
    assert "by(model_name)" in exprs and "vlmserve_media_" in exprs


def test_compose_runs_vlmserve_prometheus_and_grafana_with_the_dashboards_provisioned() -> None:
    compose = yaml.safe_load((GRAFANA / "compose.yaml").read_text())
    services = compose["services"]
    assert {"vlmserve", "prometheus", "grafana"} <= set(services)
    assert set(compose["volumes"]) >= {"prometheus-data", "grafana-data"}
    mounts = {}
    for service in services.values():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            mounts[target] = source
            if source.startswith("."):
                assert (GRAFANA / source).exists(), f"{source} is mounted but missing"
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/dashboards.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path] == "./dashboards"  # Grafana reads the dashboards where they are mounted
    assert mounts["/etc/grafana/provisioning/dashboards"] == "./provisioning/dashboards"
    source = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    prometheus = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["vlmserve:8000"] and "8000:8000" in services["vlmserve"]["ports"]


def test_docker_compose_accepts_the_file() -> None:
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run([docker, "compose", "version"], capture_output=True).returncode
    ):
        pytest.skip("docker compose is not installed")
    done = subprocess.run(
        [docker, "compose", "-f", str(GRAFANA / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
