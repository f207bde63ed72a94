"""The ``[ray]`` table, the replica wire and the import boundary: plain Python, no Ray needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vlmserve.errors import ConfigError, InvalidRequest, Overloaded, ServiceUnavailable
from vlmserve.ray_serve.config import load_ray_setup
from vlmserve.ray_serve.wire import decode_error, encode_error

ROOT = Path(__file__).parents[2]
MODELS = '[[models]]\nname = "tiny"\nsource = "/models/tiny"\nkeep_alive = 90\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vlmserve.toml"
    path.write_text(text)
    return path


def test_the_ray_table_sets_replicas_resources_and_drain(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'device = "cpu"\ndrain_timeout_seconds = 12\n'
        + MODELS
        + (
            "[ray]\ningress_replicas = 3\n[ray.models.tiny]\nnum_gpus = 1\nnum_cpus = 4\n"
            "autoscaling = { min_replicas = 0, max_replicas = 5 }\n"
        ),
    )
    setup = load_ray_setup(path)
    assert setup.settings.device == "cpu"
    assert [m.served_name for m in setup.settings.model_configs()] == ["tiny"]
    assert setup.ray.ingress().options(12)["num_replicas"] == 3
    opts = setup.ray.model("tiny").options(12, keep_alive=90)
    assert opts["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}
    assert opts["graceful_shutdown_timeout_s"] == 12  # running streams drain on scale-down
    assert "num_replicas" not in opts  # autoscaling instead
    # the model's keep_alive is how long an idle replica stays before scale-down
    assert opts["autoscaling_config"]["downscale_delay_s"] == 90
    assert opts["autoscaling_config"]["min_replicas"] == 0


def test_flags_and_environment_win_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "port = 7000\nmax_tokens = 5\n" + MODELS)
    monkeypatch.setenv("VLMSERVE_MAX_TOKENS", "9")
    setup = load_ray_setup(path, port=7100)
    assert (setup.settings.port, setup.settings.max_tokens) == (7100, 9)
    assert setup.ray.model("tiny").num_replicas == 1  # no [ray] table: one of each


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (MODELS + "[ray.models.other]\nnum_replicas = 2\n", "other"),
        (MODELS + "[ray]\ningress_replica = 2\n", "ingress_replica"),
        (MODELS + "[ray.models.tiny]\nnum_replicas = 0\n", "num_replicas"),
        (MODELS + "[ray]\nbogus_setting = 1\n", "bogus_setting"),
        ("[ray]\ningress_replicas = 2\n", "no model"),
    ],
)
def test_a_bad_ray_table_is_a_config_error_naming_it(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_ray_setup(write(tmp_path, text))


def test_the_kuberay_example_config_is_valid(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/ray/rayservice.yaml").read_text()))
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["vlmserve.toml"]
    setup = load_ray_setup(write(tmp_path, config))
    service = next(d for d in docs if d["kind"] == "RayService")
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "vlmserve.ray_serve.app:app"
    assert set(setup.ray.models) == {m.served_name for m in setup.settings.model_configs()}


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest("prompt too long", param="messages", code="context_length_exceeded"),
        Overloaded("queue full", retry_after=3.0),
        ServiceUnavailable("loading", retry_after=7.0),
    ],
)
def test_replica_errors_reach_the_client_with_their_status_and_fields(error: Exception) -> None:
    back = decode_error(encode_error(error))  # type: ignore[arg-type]
    assert type(back) is type(error)
    assert (back.status_code, back.message, back.param, back.code) == (
        error.status_code,
        error.message,
        error.param,
        error.code,
    )  # type: ignore[attr-defined]
    assert getattr(back, "retry_after", None) == getattr(error, "retry_after", None)


def test_vlmserve_imports_and_says_what_to_install_without_ray(tmp_path: Path) -> None:
    config = write(tmp_path, MODELS)
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import vlmserve.api.app, vlmserve.cli.main, vlmserve.ray_serve.config\n"
        "from typer.testing import CliRunner\n"
        f"r = CliRunner().invoke(vlmserve.cli.main.app, ['ray', 'serve', '-c', {str(config)!r}])\n"
        "print(r.exit_code); print(r.output)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    exit_code, output = done.stdout.split("\n", 1)
    assert exit_code == "2"
    assert "pip install 'vlmserve[ray]'" in " ".join(output.split())


@pytest.mark.parametrize(
    ("address", "env", "expected"),
    [
        (None, {}, "1"),  # a new local cluster: Ray Serve's fast path
        (None, {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}, "0"),  # the user opted out
        ("auto", {}, None),  # a joined cluster keeps its own environment
        (None, {"RAY_ADDRESS": "ray://head:10001"}, None),
    ],
)
def test_a_new_local_cluster_defaults_to_the_throughput_optimized_mode(
    monkeypatch: pytest.MonkeyPatch,
    address: str | None,
    env: dict[str, str],
    expected: str | None,
) -> None:
    from vlmserve.cli.ray import _default_fast_path

    for name in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _default_fast_path(address)
    assert os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == expected


@pytest.mark.parametrize(
    ("address", "env", "expected", "note"),
    [
        (None, {}, "1", False),  # a new local cluster starts with direct ingress
        ("auto", {}, None, True),  # a joined cluster decided when it started: say so
        (None, {"RAY_ADDRESS": "ray://head:10001"}, None, True),
        ("auto", {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}, "1", False),
    ],
)
def test_direct_ingress_is_set_for_a_new_local_cluster_and_explained_for_a_joined_one(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    address: str | None,
    env: dict[str, str],
    expected: str | None,
    note: bool,
) -> None:
    from vlmserve.cli.ray import _direct_ingress

    for name in ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _direct_ingress(address)
    assert os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == expected
    said = " ".join(capsys.readouterr().err.split())
    assert ("started with RAY_SERVE_ENABLE_DIRECT_INGRESS=1" in said) is note


REGISTRY = """
[[models]]
name = "reg-embed"
source = "/models/tiny"
roles = ["embedding"]
model_aliases = ["embed-alias"]
keep_alive = 45
[models.capabilities]
vision = true
embedding = true

[[models]]
name = "remote-chat"
backend = "openai"
served_model_id = "Qwen/Qwen2-VL-7B-Instruct"
roles = ["chat"]
[models.backend_config]
base_urls = ["http://10.0.0.9:8000"]
preflight = false
"""


def test_registry_entries_deploy_under_ray(tmp_path: Path) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text(REGISTRY)
    path = write(
        tmp_path,
        f'registry = "{registry}"\n' + MODELS + "[ray.models.reg-embed]\nnum_replicas = 2\n",
    )
    setup = load_ray_setup(path)
    configs = {m.served_name: m for m in setup.settings.model_configs()}
    assert list(configs) == ["tiny", "reg-embed"]  # the hf entry is a deployment
    assert configs["reg-embed"].roles == ["embedding"] and configs["reg-embed"].keep_alive == 45
    assert setup.settings.registry is None  # replicas never need the file
    assert setup.ray.model("reg-embed").options(5)["num_replicas"] == 2
    assert [e["name"] for e in setup.entries] == ["reg-embed", "remote-chat"]

    from vlmserve.ray_serve.ingress import ray_models

    models = ray_models(setup.settings, {"tiny": object(), "reg-embed": object()}, setup.entries)
    embed = models.resolve("embed-alias")  # the entry's alias resolves to its deployment
    assert embed.name == "reg-embed" and embed.backend.kind == "ray"
    assert embed.capabilities is not None and "vision" in embed.capabilities
    assert embed.keep_alive == -1  # Ray scales replicas; the ingress never unloads
    remote = models.resolve("remote-chat")
    assert remote.backend.kind == "openai"  # proxied from the ingress replicas


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (
            'name = "local-vllm"\nbackend = "vllm"\n[models.backend_config]\n'
            'command = "vllm serve x --port {port}"\n',
            "local-vllm",
        ),
        ('name = "tiny"\nsource = "/models/other"\n', "have the names of [[models]]"),
    ],
)
def test_registry_entries_ray_cannot_deploy_are_refused(
    tmp_path: Path, entry: str, says: str
) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text("[[models]]\n" + entry)
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_ray_setup(write(tmp_path, f'registry = "{registry}"\n' + MODELS))


def test_a_single_model_flag_and_a_registry_deploy_together(tmp_path: Path) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text(REGISTRY)
    path = write(tmp_path, f'registry = "{registry}"\n')
    setup = load_ray_setup(path, model="/models/tiny", served_model_name="flagged")
    assert [m.served_name for m in setup.settings.model_configs()] == ["flagged", "reg-embed"]


def test_the_old_import_path_still_serves_the_application_and_warns() -> None:
    """``vlmserve.deploy.ray:app`` (RayService files written before the rename) keeps
    working for one release, and says which path replaces it."""
    pytest.importorskip("ray.serve")
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from vlmserve.deploy.ray import app\n"
        "import vlmserve.ray_serve.app as new\n"
        "assert app is new.app\n"
        "print([str(w.message) for w in caught if w.category is DeprecationWarning])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "use vlmserve.ray_serve.app:app" in done.stdout
