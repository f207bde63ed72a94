"""Helper of scripts/mutation.sh; runs inside the temporary copy of the tree, never in it.

    python mutation_helper.py configure MODULE...   # write [tool.mutmut] for these modules
    python mutation_helper.py report [--diff] MODULE...  # score and survivors from mutants/
    python mutation_helper.py survivors MODULE...  # their names, one a line (for --again)
    pytest -p mutation_helper ...   # (as a plugin) run unit tests before slow suites

As a pytest plugin it moves robustness/integration/e2e tests to the end: mutmut hands pytest
the tests of a mutant in no fixed order and stops at the first failure, so a mutant a unit test
kills then never pays for loading the tiny model.

``configure`` keeps the repository's ``[tool.mutmut]`` keys and adds ``only_mutate`` (the
modules) and ``pytest_add_cli_args_test_selection`` (the union of their tests, from
``TESTS_BY_MODULE`` or ``$MUTATION_TESTS``). mutmut then runs each mutant against only the
tests that executed its function, so one run serves several modules.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Module glob -> test paths (globs allowed; paths that match nothing are dropped).
# The first matching entry wins; a module with none falls back to tests/unit/<subpackage>.
TESTS_BY_MODULE: dict[str, list[str]] = {
    # the engine process's request handling (early start, held chunks, discard, cancel)
    "src/vlmserve/engine/proc/core.py": ["tests/unit/engine/proc/test_engine_core.py"],
    "src/vlmserve/media/netguard.py": [
        "tests/unit/media/test_media_netguard.py",
        "tests/robustness/test_ssrf.py",
    ],
    # tests/robustness/test_limits_auth.py starts a real uvicorn server per test: too slow here.
    "src/vlmserve/api/auth.py": [
        "tests/unit/api/test_auth*.py",
        "tests/unit/api/test_resume_token.py",
    ],
    "src/vlmserve/api/resume_token.py": ["tests/unit/api/test_resume_token.py"],
    "src/vlmserve/api/common/keys.py": ["tests/unit/api/common/test_key_policy.py"],
    # the quota and ownership of stored files (tests/integration/test_files_batches_api.py and
    # tests/robustness pin them through the app, too slow to run per mutant)
    "src/vlmserve/api/endpoints/files/service.py": [
        "tests/unit/api/endpoints/files/test_files_quota.py",
        "tests/unit/api/endpoints/files/test_files_store.py",
    ],
    "src/vlmserve/api/endpoints/files/store.py": [
        "tests/unit/api/endpoints/files/test_files_store.py",
        "tests/unit/api/endpoints/files/test_files_quota.py",
    ],
    "src/vlmserve/gateway/passthrough*.py": [
        "tests/unit/gateway/test_passthrough_relay.py",
        "tests/integration/test_gateway_passthrough.py",
    ],
    "src/vlmserve/gateway/passed.py": ["tests/unit/gateway/test_passthrough_relay.py"],
    "src/vlmserve/streaming/*.py": ["tests/unit/streaming"],
    "src/vlmserve/gateway/upstream*.py": [
        "tests/unit/gateway/test_upstream*.py",
        "tests/unit/gateway/test_proxy_bytes.py",
    ],
    "src/vlmserve/streaming/store/*.py": ["tests/unit/streaming"],
    "src/vlmserve/engine/core/faults.py": ["tests/unit/engine/core/test_batching_faults.py"],
    "src/vlmserve/engine/core/kv_cache.py": ["tests/unit/engine/core/test_paged_kv.py"],
    "src/vlmserve/engine/core/block_manager.py": [
        "tests/unit/engine/core/test_block_books.py",
        "tests/unit/engine/core/test_prefix_cache.py",
        "tests/unit/engine/core/test_paged_kv.py",
    ],
    "src/vlmserve/engine/core/prefix.py": ["tests/unit/engine/core/test_prefix_cache.py"],
    "src/vlmserve/engine/core/scheduler.py": [
        "tests/unit/engine/core/test_scheduler*.py",
        "tests/unit/engine/core/test_block_books.py",
        "tests/unit/engine/core/test_prefix_cache.py",
    ],
    "src/vlmserve/engine/core/*.py": [
        "tests/unit/engine/core/test_batching.py",
        "tests/unit/engine/core/test_sampler*.py",
        "tests/unit/engine/core/test_scheduler*.py",
    ],
}

# mutmut's exit codes (mutmut/stats.py); "no tests" counts as run and not killed.
KILLED = {1, 3, 37}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}
NOT_RUN = {None, 34, 2}  # not checked, skipped, interrupted


_SLOW_SUITES = ("tests/robustness/", "tests/integration/", "tests/e2e/")


def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: any(s in item.nodeid for s in _SLOW_SUITES))


def tests_for(module: str) -> list[str]:
    override = os.environ.get("MUTATION_TESTS", "").split()
    if override:
        return override
    patterns = next((t for m, t in TESTS_BY_MODULE.items() if fnmatch.fnmatch(module, m)), None)
    if patterns is None:
        parts = Path(module).parts  # src/vlmserve/<sub>/...
        patterns = [f"tests/unit/{parts[2]}"] if len(parts) > 3 else ["tests/unit"]
    found = [p for pattern in patterns for p in sorted(glob.glob(pattern))]
    if not found:
        sys.exit(f"mutation: no tests found for {module} (looked for {patterns})")
    return found


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to [tool.mutmut]")


def configure(modules: list[str]) -> None:
    path = Path("pyproject.toml")
    text = path.read_text()
    config = dict(tomllib.loads(text).get("tool", {}).get("mutmut", {}))
    tests = list(dict.fromkeys(t for m in modules for t in tests_for(m)))
    config["only_mutate"] = modules
    config["pytest_add_cli_args_test_selection"] = tests
    args = [*config.get("pytest_add_cli_args", []), "-p", "mutation_helper"]
    timeout = os.environ.get("MUTATION_TIMEOUT")
    if timeout:  # a mutant that hangs on an await uses no CPU, so mutmut's limit never fires
        args.append(f"--timeout={timeout}")
    config["pytest_add_cli_args"] = args
    # drop the old section (up to the next table header) and append the generated one
    text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    section = "\n".join(f"{k} = {_toml_value(v)}" for k, v in config.items())
    path.write_text(f"{text.rstrip()}\n\n[tool.mutmut]\n{section}\n")
    print(f"mutation: tests: {' '.join(tests)}")


def _results(module: str) -> dict[str, int | None] | None:
    meta = Path("mutants") / f"{module}.meta"
    return json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else None


def survivors(modules: list[str]) -> None:
    for module in modules:
        codes = _results(module) or {}
        print("\n".join(k for k, c in codes.items() if c in SURVIVED | NO_TESTS))


def report(modules: list[str], diff: bool) -> int:
    worst = 100.0
    for module in modules:
        codes = _results(module)
        if codes is None:
            print(f"{module}: no results (mutmut did not get to it)")
            worst = 0.0
            continue
        run = {k: c for k, c in codes.items() if c not in NOT_RUN}
        killed = sum(c in KILLED for c in run.values())
        timeout = sum(c in TIMEOUT for c in run.values())
        survivors = sorted(k for k, c in run.items() if c not in KILLED | TIMEOUT)
        score = 100.0 * (killed + timeout) / len(run) if run else 0.0
        worst = min(worst, score)
        print(
            f"{module}: {score:.1f}% = (killed {killed} + timeout {timeout}) / run {len(run)}"
            f"  [generated {len(codes)}, not run {len(codes) - len(run)}]"
        )
        for name in survivors:
            status = "no tests" if run[name] in NO_TESTS else "survived"
            if run[name] not in SURVIVED | NO_TESTS:
                status = f"exit code {run[name]}"
            print(f"    {status}: {name}")
            if diff:
                shown = subprocess.run(
                    [sys.executable, "-m", "mutmut", "show", name], capture_output=True, text=True
                )
                lines = shown.stdout.splitlines()
                changed = [ln for ln in lines if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
                print("\n".join(f"        {ln}" for ln in changed))
    return 0 if worst >= float(os.environ.get("MUTATION_MIN_SCORE", "0")) else 1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("configure", "report", "survivors"):
        sys.exit(__doc__)
    if argv[0] == "configure":
        configure(argv[1:])
        return 0
    if argv[0] == "survivors":
        survivors(argv[1:])
        return 0
    diff = "--diff" in argv
    return report([a for a in argv[1:] if a != "--diff"], diff)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
