"""The slow tests' time budget (tests/slow_budget.py), on a throwaway suite run by pytest in a
subprocess: with a deadline a slow test that cannot end before it is skipped, saying why, the
others run; without one every test runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SUITE = '''
import pytest

@pytest.fixture(scope="session")
def tiny_run():
    return 1

@pytest.mark.slow
def test_long(tiny_run):
    pass

@pytest.mark.slow
def test_short():
    pass

def test_fast():
    pass
'''


def run_suite(tmp_path: Path, deadline: float | None) -> str:
    (tmp_path / "test_suite.py").write_text(SUITE)
    plugin = Path(__file__).with_name("slow_budget.py").read_text()
    (tmp_path / "slow_budget.py").write_text(plugin)
    (tmp_path / "slow_durations.json").write_text(json.dumps({
        "test_suite.py::test_long": 100.0, "test_suite.py::test_short": 1.0,
        "fixture:tiny_run": 50.0}))
    env = {k: v for k, v in os.environ.items() if k != "ALIGNLOOP_TEST_DEADLINE"}
    if deadline is not None:
        env["ALIGNLOOP_TEST_DEADLINE"] = str(deadline)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "slow_budget", "-rs", "-v",
                          "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    return out.stdout


def test_a_slow_test_that_cannot_end_before_the_deadline_is_skipped_saying_why(tmp_path: Path
                                                                              ) -> None:
    out = run_suite(tmp_path, time.time() + 120)    # test_long needs 100 + the shared 50
    assert "test_long SKIPPED" in out and "test_short PASSED" in out
    assert "test_fast PASSED" in out
    assert "CI's time budget" in out and "this test took 150 s when measured" in out
    out = run_suite(tmp_path, time.time() + 3600)
    assert "test_long PASSED" in out and "skipped" not in out
    out = run_suite(tmp_path, None)
    assert out.count("PASSED") == 3 and "skipped" not in out
