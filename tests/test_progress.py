"""Progress lines of long stage loops: periodic when stdout is a log, in place on a terminal."""
from __future__ import annotations

import io

from tasks.core.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_log_gets_one_line_per_interval_with_rate_and_eta_and_a_last_line():
    out, clock = io.StringIO(), _Clock()
    with Progress("rollout@1", total=40, unit="batches", rate_unit="tok", every=10, out=out,
                  now=clock) as p:
        for _ in range(40):
            clock.t += 1.0
            p.step(1, work=96)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5                      # at 10, 20, 30, 40 s, then the last line
    assert lines[0] == "  rollout@1: 10/40 batches, 96.0 tok/s, 0:10 elapsed, ETA 0:30"
    assert lines[-1] == "  rollout@1: 40/40 batches, 96.0 tok/s, 0:40 elapsed"


def test_a_short_loop_prints_nothing_to_a_log():
    out, clock = io.StringIO(), _Clock()
    with Progress("judge@1", total=3, out=out, now=clock) as p:
        for _ in range(3):
            clock.t += 0.5
            p.step()
    assert out.getvalue() == ""


def test_a_terminal_line_is_rewritten_in_place():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    out, clock = Tty(), _Clock()
    with Progress("update@1", total=4, out=out, now=clock) as p:
        for _ in range(4):
            clock.t += 1.0
            p.step()
    text = out.getvalue()
    assert text.startswith("\r  update@1: 1/4 steps") and text.endswith("0:04 elapsed\n")
    assert text.count("\n") == 1
