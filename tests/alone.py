"""The suite on two pytest-xdist workers, with the tests that time things run alone at the end.

``pytest`` runs the suite on two worker processes (``-n 2`` in pyproject.toml): most tests
spend their time waiting on sockets, subprocesses and model loads, and two workers keep a
2-core machine busy. A few test files measure time (a latency bound under load, a deadline,
a kill -9 and restart within a wait) or fill the machine on purpose; with another test using
half of the CPU beside them they would fail at random. Those are listed in ``ALONE``: the
scheduler below runs them last, one after another on one worker, once every other test has
ended and the other workers have stopped.

The scheduler sees test ids only (pytest-xdist collects in the workers), so ``ALONE`` names
files and tests by id; an entry whose file or test function is gone is a usage error, so
the list cannot go stale. ``pytest -n 0`` runs everything in one process, in file order.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

# A test file, or one test (``file::name``, parametrized cases included) -> what in it cannot
# share the machine.
ALONE: dict[str, str] = {
    "tests/integration/test_first_chunk.py": "the first chunk's time against the prefill's",
    "tests/robustness/test_limits_auth.py::test_absurd_requests_are_refused_in_under_50ms": (
        "a refusal within 50 ms"
    ),
    (
        "tests/e2e/test_bounds_process.py"
        "::test_health_stays_fast_while_a_44_mib_logprobs_answer_is_built_and_sent"
    ): "/health within 200 ms while a 44 MiB answer is built",
    (
        "tests/e2e/test_bounds_process.py"
        "::test_four_batches_on_one_47_mib_file_hold_little_memory_and_never_stall"
    ): "/health within 200 ms while batches are created",
    (
        "tests/e2e/test_warmup_process.py"
        "::test_the_first_request_after_ready_is_as_fast_as_the_later_ones"
    ): "the first request's TTFT against the median of later ones",
    # the whole file: its other tests share the server, which would otherwise start twice
    "tests/e2e/test_timings_process.py": "the server's phase timings against the client's clock",
}

# Folders whose files are long (server processes, Ray, fault runs) go out first, so that the
# many short unit files fill the end of the run and both workers finish close together.
HEAVY_FIRST = ("tests/ray/", "tests/e2e/", "tests/robustness/", "tests/integration/")


def _rank(scope: str) -> int:
    for rank, folder in enumerate(HEAVY_FIRST):
        if scope.startswith(folder):
            return rank
    return len(HEAVY_FIRST)


class AloneLastScheduling(LoadFileScheduling):
    """pytest-xdist's per-file load balancing, heavy folders first and ``ALONE`` files last.

    A worker holds back the last test it was sent until it is sent another or told to stop
    (it must know the next test to tear fixtures down right). So the alone phase starts like
    this: once only alone tests are left, the first worker that asks for more is chosen and
    waits at its last test; every other worker is told to stop as it asks, and runs what it
    has; when all of them have ended (their session fixtures torn down too), the chosen one is
    sent every alone test.
    """

    def __init__(self, config: pytest.Config, log: object | None = None) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]
        self.alone_node: WorkerController | None = None

    def _split_scope(self, nodeid: str) -> str:
        return alone_entry(nodeid) or super()._split_scope(nodeid)

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is None:
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            for scope in sorted(units, key=_rank):
                self.workqueue[scope] = units[scope]
        # Twice, as pytest-xdist does: each worker starts with two files when there are enough.
        for _ in range(2):
            for node in self.nodes:
                self._reschedule(node)
        self._start_alone_phase()

    def mark_test_complete(
        self, node: WorkerController, item_index: int, duration: float = 0
    ) -> None:
        super().mark_test_complete(node, item_index, duration)
        self._start_alone_phase()

    def remove_node(self, node: WorkerController) -> str | None:
        if node is self.alone_node:
            self.alone_node = None
        crashed = super().remove_node(node)
        self._start_alone_phase()
        return crashed

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        pending = self._pending_of(self.assigned_work[node])
        if pending > 2:
            return
        shared = next((scope for scope in self.workqueue if scope not in ALONE), None)
        if shared is not None:
            self._assign(node, shared)
            return
        if self.alone_node is None:
            self.alone_node = node
        elif node is not self.alone_node:
            node.shutdown()

    def _start_alone_phase(self) -> None:
        chosen = self.alone_node
        if chosen is None or not self.workqueue or chosen.shutting_down:
            return
        if any(scope not in ALONE for scope in self.workqueue):
            return
        # every other worker gone (pytest-xdist removes one once its session fixtures are torn
        # down, which can take seconds of CPU: a server's drain), not just out of tests
        if any(node is not chosen for node in self.assigned_work):
            return
        for scope in list(self.workqueue):
            self._assign(chosen, scope)

    def _assign(self, node: WorkerController, scope: str) -> None:
        """pytest-xdist's assignment of the first file in the queue, for this one."""
        self.workqueue.move_to_end(scope, last=False)
        self._assign_work_unit(node)


def alone_entry(nodeid: str) -> str | None:
    """The ``ALONE`` entry that covers the test ``nodeid``, if any."""
    for entry in ALONE:
        if nodeid == entry or nodeid.startswith((f"{entry}::", f"{entry}[")):
            return entry
    return None


def check_entries(rootpath: Path) -> None:
    """A usage error for an ``ALONE`` entry whose file or test function is not there (renamed,
    moved, deleted), so that the list cannot go stale."""
    stale = []
    for entry in ALONE:
        path, _, name = entry.partition("::")
        source = rootpath / path
        if not source.is_file() or (
            name and not re.search(rf"^(async )?def {re.escape(name)}\(", source.read_text(), re.M)
        ):
            stale.append(entry)
    if stale:
        raise pytest.UsageError(f"tests/alone.py lists tests that do not exist: {stale}")
