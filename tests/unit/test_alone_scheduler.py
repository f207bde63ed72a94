"""The suite's scheduler (tests/alone.py): a test listed as alone runs with no other beside it.

Workers are simulated as pytest-xdist's are: a worker runs the next test it was sent only once
it knows the one after it, or has been told to stop (it needs ``nextitem`` for teardown).
"""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

import alone
from alone import AloneLastScheduling, check_entries


class Worker:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.queue: deque[int] = deque()
        self.shutting_down = False
        self.stopped = False

    def send_runtest_some(self, indices: list[int]) -> None:
        assert not self.shutting_down, "work sent to a worker told to stop"
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True

    def can_run(self) -> bool:
        return len(self.queue) >= 2 or (self.shutting_down and bool(self.queue))

    def __repr__(self) -> str:
        return str(self.gateway.id)


COLLECTION = [
    "tests/unit/test_a.py::test_1",
    "tests/unit/test_a.py::test_2",
    "tests/e2e/test_timed.py::test_fast_path",
    "tests/e2e/test_timed.py::test_latency[json]",
    "tests/e2e/test_timed.py::test_latency[sse]",
    "tests/unit/test_b.py::test_1",
    "tests/integration/test_first.py::test_1",
    "tests/integration/test_first.py::test_2",
    "tests/ray/test_cluster.py::test_1",
    "tests/unit/test_c.py::test_1",
    "tests/unit/test_c.py::test_2",
    "tests/unit/test_c.py::test_3",
]
LISTED = {
    "tests/e2e/test_timed.py::test_latency": "a latency bound",
    "tests/integration/test_first.py": "a deadline",
}


def run(workers: int, seed: int, collection: list[str] = COLLECTION) -> list[tuple[str, str]]:
    """Runs the collection to the end, in a random interleaving of the workers; returns (worker,
    test id) in the order run, and checks each alone test ran with no other worker active."""
    config = SimpleNamespace(getvalue=lambda name: {"tx": [f"{workers}*popen"]}[name])
    sched = AloneLastScheduling(config)  # type: ignore[arg-type]
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)  # type: ignore[arg-type]
        sched.add_node_collection(node, collection)  # type: ignore[arg-type]
    sched.schedule()
    rng = random.Random(seed)
    ran: list[tuple[str, str]] = []
    while any(n.queue for n in nodes) or not sched.tests_finished:
        if sched.tests_finished:  # as pytest-xdist's controller: stop every worker
            for n in nodes:
                n.shutdown()
        # a stopped worker with nothing left tears its fixtures down (a while), then ends
        ending = [n for n in nodes if n.shutting_down and not n.queue and n in sched.nodes]
        for n in ending:
            if rng.random() < 0.3:
                sched.remove_node(n)  # type: ignore[arg-type]
        ready = [n for n in nodes if n.can_run()]
        if not ready:
            assert ending, f"no worker can run: {[(n, list(n.queue)) for n in nodes]}"
            continue
        node = rng.choice(ready)
        index = node.queue.popleft()
        nodeid = collection[index]
        if alone.alone_entry(nodeid):
            others = [n for n in sched.nodes if n is not node]
            assert not others, f"{nodeid} ran while {others} had not ended"
        ran.append((str(node), nodeid))
        sched.mark_test_complete(node, index)  # type: ignore[arg-type]
    return ran


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("seed", range(20))
def test_alone_tests_run_last_on_one_worker_with_no_other_running(
    monkeypatch: pytest.MonkeyPatch, workers: int, seed: int
) -> None:
    monkeypatch.setattr(alone, "ALONE", LISTED)
    ran = run(workers, seed)
    assert sorted(nodeid for _, nodeid in ran) == sorted(COLLECTION)  # each test once
    first_alone = next(i for i, (_, nodeid) in enumerate(ran) if alone.alone_entry(nodeid))
    tail = ran[first_alone:]
    assert all(alone.alone_entry(nodeid) for _, nodeid in tail)  # every shared test before
    assert len({worker for worker, _ in tail}) == 1


def test_the_heavy_folders_go_out_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(alone, "ALONE", {})
    ran = run(1, 0)
    files = list(dict.fromkeys(nodeid.split("::")[0] for _, nodeid in ran))
    assert files[:3] == [
        "tests/ray/test_cluster.py",
        "tests/e2e/test_timed.py",
        "tests/integration/test_first.py",
    ]


def test_a_run_of_only_alone_tests_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(alone, "ALONE", LISTED)
    only = [nodeid for nodeid in COLLECTION if alone.alone_entry(nodeid)]
    for seed in range(5):
        assert sorted(nodeid for _, nodeid in run(2, seed, only)) == sorted(only)


def test_a_listed_test_that_is_gone_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("async def test_here():\n    pass\n")
    monkeypatch.setattr(alone, "ALONE", {"tests/test_x.py::test_here": "why"})
    check_entries(tmp_path)
    for gone in ("tests/test_x.py::test_renamed", "tests/test_y.py", "tests/test_x.py::test_her"):
        monkeypatch.setattr(alone, "ALONE", {gone: "why"})
        with pytest.raises(pytest.UsageError, match="do not exist"):
            check_entries(tmp_path)
