"""Engine tests fail, never hang: a per-test time limit well under the suite's 300 s.

The engine itself ends every request with an error when its loop dies (see
``test_batching_faults.py``); this limit is the second line, for a bug that keeps the loop
alive but stuck (a mutant that never admits a request, say).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ENGINE_TEST_TIMEOUT = 120  # seconds; the slowest engine test takes ~20 s on a busy 2-core box
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    given = config.getoption("timeout", None)  # pytest-timeout's --timeout, when passed
    if given is not None and float(given) <= ENGINE_TEST_TIMEOUT:
        return
    for item in items:
        if item.path.is_relative_to(_HERE) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT))
