"""Helpers for the Ray Serve tests: the cluster's config and a handle on the running app.

Imported only after ``pytest.importorskip("ray")`` (it imports Ray).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray

from vlmserve.ray_serve.app import deployment_name
from vlmserve.ray_serve.ingress import REPLICA_HEADER

MODEL = "tiny"
EMBEDDER = "tiny-embed"  # the same checkpoint as an embedding model (last-token vectors)
EMBEDDER_ALIAS = "tiny-embed-alias"  # the registry entry's alias
ADMIN_KEY = "ray-test-admin"

# Serve's proxies and direct-ingress replicas wait out a minimum draining period (30 s) when
# stopped, for load balancers to notice, even with no request left: each test module's
# ``serve.shutdown()`` took 31 s. Read by the processes ``ray.init`` starts after this.
for _kind in ("PROXY", "DIRECT_INGRESS"):
    os.environ.setdefault(f"RAY_SERVE_{_kind}_MIN_DRAINING_PERIOD_S", "1")


@dataclass
class RayServe:
    url: str
    startup_seconds: float

    def kill_replica(self, deployment: str, replica: str) -> None:
        """Kill the actor of a replica by its Ray id (Serve starts a new one)."""
        name = f"SERVE_REPLICA::vlmserve#{deployment}#{replica}"
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def kill_model_replica(self, replica: str) -> None:
        self.kill_replica(deployment_name(MODEL), replica)

    def model_state(self) -> list[dict[str, Any]]:
        """The model's ``/admin/state`` entry from each ingress replica."""
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        answers = self.per_ingress("/admin/state", headers=auth)
        assert len(answers) == 2, "both ingress replicas should answer"
        return [
            next(m for m in r.json()["models"] if m["name"] == MODEL)["upstream"]
            for r in answers.values()
        ]

    def continued(self) -> int:
        """Streams the ingress replicas continued on another model replica, all together."""
        return sum(state["continued"] for state in self.model_state())

    def continuations_logged(self) -> int:
        """ "died mid-stream" warnings in every ingress replica's log, the replaced ones too
        (their ``/admin/state`` counters are gone with them)."""
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        logs = (session / "logs" / "serve").glob("replica_vlmserve_ingress_*.log")
        return sum(path.read_text(errors="replace").count("died mid-stream") for path in logs)

    def streams_by_model_replica(self) -> dict[str, int]:
        """Model replica id -> the streams it serves now (all ingress replicas together)."""
        counts: dict[str, int] = {}
        for state in self.model_state():
            for replica, n in state["streams_by_replica"].items():
                counts[replica] = counts.get(replica, 0) + n
        return counts

    def busiest_model_replica(self) -> tuple[str, int]:
        """The model replica serving the most streams now, and how many."""
        return max(self.streams_by_model_replica().items(), key=lambda item: item[1])

    def model_replicas(self, running: int, timeout: float = 90) -> list[str]:
        return self.replicas(deployment_name(MODEL), running, timeout)

    def replicas(self, deployment: str, running: int, timeout: float = 90) -> list[str]:
        """Ids of a deployment's replicas, once Serve reports ``running`` of them running and
        no other (a replacement still starting, a removed one still draining)."""
        from ray import serve

        prefix = f"SERVE_REPLICA::vlmserve#{deployment}#"
        deadline = time.monotonic() + timeout
        while True:
            states = serve.status().applications["vlmserve"].deployments[deployment]
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
            ids = [n.removeprefix(prefix) for n in names if n.startswith(prefix)]
            settled = dict(states.replica_states) == {"RUNNING": running} and len(ids) == running
            if settled or time.monotonic() > deadline:
                return ids
            time.sleep(0.5)

    def per_ingress(self, path: str, **kwargs: Any) -> dict[str, httpx.Response]:
        """``GET path`` answered by each ingress replica (asked until both have answered)."""
        answers: dict[str, httpx.Response] = {}
        with httpx.Client(base_url=self.url, timeout=30) as client:
            for _ in range(40):
                response = client.get(path, **kwargs)
                answers[response.headers[REPLICA_HEADER]] = response
                if len(answers) == 2:
                    break
        return answers


def write_config(
    tmp: Path, tiny_dir: Path, redis_url: str, *, model_replicas: int = 2, embedder: bool = True
) -> Path:
    """The chat model in ``[[models]]``, 2 ingress replicas; with ``embedder``, the embedder
    in a registry file (with an alias)."""
    registry = tmp / "registry.toml"
    registry.write_text(f"""
[[models]]
name = "{EMBEDDER}"
source = "{tiny_dir}"
roles = ["embedding"]
model_aliases = ["{EMBEDDER_ALIAS}"]
[models.capabilities]
embedding = true
""")
    top = f'registry = "{registry}"' if embedder else ""
    tail = f"[ray.models.{EMBEDDER}]\nnum_replicas = 1\nnum_cpus = 0\n" if embedder else ""
    path = tmp / "vlmserve.toml"
    path.write_text(f"""
device = "cpu"
redis_url = "{redis_url}"
admin_keys = ["{ADMIN_KEY}"]
max_num_seqs = 16
{top}

[[models]]
name = "{MODEL}"
source = "{tiny_dir}"

[ray]
ingress_replicas = 2
ingress_num_cpus = 0

[ray.models.{MODEL}]
num_replicas = {model_replicas}
num_cpus = 0

{tail}""")
    return path
