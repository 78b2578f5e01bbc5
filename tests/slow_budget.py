"""CI's time budget for the `slow` tests (a pytest plugin, loaded by conftest.py).

With `ALIGNLOOP_TEST_DEADLINE` set (unix seconds; `.ci/run` sets it from CI's limit), the slow
tests run most important first (`FIRST`, then file order) and a slow test starts only if the
time it took when measured (`slow_durations.json`: seconds per test, setup included, measured on
the slowest CPU CI has run on) still ends before the deadline; otherwise it is skipped with a
reason that says so and how much time was left. CI then ends inside its limit on any CPU, and
its summary (`-rs`) names every test it did not run. Without the variable nothing changes:
every test runs, in file order. A test the file does not know is given `UNKNOWN_S`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("slow_durations.json")
UNKNOWN_S = 600.0
# What a user relies on most, first: the installed package, kill -9 and Ctrl-C, the served
# schedule, a copied or cloned workspace, a refused tick, the release gate, LoRA, budgets.
FIRST = ("test_install.py", "test_recovery.py", "test_group_signals.py", "test_schedule.py",
         "test_relocate.py", "test_build_on_best.py", "test_book.py", "test_redteam_gate.py",
         "test_lora_run.py", "test_budgets.py", "test_http_judge_e2e.py", "test_real_model.py")
SHARED = "tiny_run"     # the session's shared tiny run: built by the first test that asks for it


def deadline() -> float | None:
    value = os.environ.get("ALIGNLOOP_TEST_DEADLINE")
    return float(value) if value else None


def measured() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def rank(item: pytest.Item) -> int:
    name = Path(str(item.fspath)).name
    return FIRST.index(name) if name in FIRST else len(FIRST)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if deadline() is not None:
        items.sort(key=rank)                 # stable: file order within a rank


class Budget:
    def __init__(self) -> None:
        self.seconds = measured()
        self.shared_built = False

    def need(self, item: pytest.Item) -> float:
        """Seconds the test took when measured; the shared run's build on top when this test
        would build it and the measured test that did is another."""
        own = self.seconds.get(item.nodeid, UNKNOWN_S)
        if SHARED in getattr(item, "fixturenames", ()) and not self.shared_built:
            own += self.seconds.get(f"fixture:{SHARED}", 0.0)
        return own


BUDGET = Budget()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    end = deadline()
    if end is not None and item.get_closest_marker("slow") is not None:
        left, need = end - time.time(), BUDGET.need(item)
        if need > left:
            pytest.skip(f"CI's time budget: {left:.0f} s left, this test took {need:.0f} s "
                        f"when measured ({DURATIONS.name})")
    if SHARED in getattr(item, "fixturenames", ()):
        BUDGET.shared_built = True
