"""Progress of a long stage loop for the person at the terminal: done/total, rate, ETA.

On a terminal the line is rewritten in place (at most a few times a second); when stdout is
not a terminal (CI logs, `| tee`) one line is printed every `every` seconds, and a last one at
the end, so a 10-minute stage shows how far it has got without flooding a log. The loops call
`step(n)`; they never print themselves and hold no global state. `track` labels the line with
the stage instance this process runs (`python -m tasks.stages.rollout --it 2` -> `rollout@2`).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def _clock(seconds: float) -> str:
    s = int(max(seconds, 0) + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    def __init__(self, label: str, total: int, unit: str = "steps", rate_unit: str = "",
                 every: float = 10.0, out: TextIO | None = None,
                 now: Callable[[], float] = time.monotonic):
        self.label, self.total, self.unit = label, max(int(total), 0), unit
        self.rate_unit = rate_unit or unit
        self.out = out or sys.stdout
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.every = 0.25 if self.tty else every
        self._now = now
        self.t0 = self._now()
        self.done, self.work = 0, 0.0
        self._last = self.t0
        self._closed = False

    def step(self, n: int = 1, work: float | None = None) -> None:
        """`n` more units done; `work` more of what the rate counts (tokens, say)."""
        self.done += n
        self.work += n if work is None else work
        now = self._now()
        if now - self._last >= self.every:
            self._last = now
            self._emit(final=False)

    def line(self) -> str:
        elapsed = self._now() - self.t0
        rate = self.work / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) * elapsed / self.done if self.done else None
        eta = f", ETA {_clock(left)}" if left is not None and self.done < self.total else ""
        return (f"  {self.label}: {self.done}/{self.total} {self.unit}, {rate:.1f} "
                f"{self.rate_unit}/s, {_clock(elapsed)} elapsed{eta}")

    def _emit(self, final: bool) -> None:
        if self.tty:
            self.out.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.out.write(self.line() + "\n")
        self.out.flush()

    def close(self) -> None:
        """The last line (always printed once a loop took longer than one interval)."""
        if not self._closed:
            self._closed = True
            if self._now() - self.t0 >= self.every or self.tty:
                self._emit(final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stage_label() -> str:
    """`rollout@2` for `python -m tasks.stages.rollout --it 2`; the program's name otherwise."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name.rpartition(".")[2] if spec is not None and spec.name else "stage"
    argv = sys.argv[1:]
    it = argv[argv.index("--it") + 1] if "--it" in argv[:-1] else "0"
    return name if it == "0" else f"{name}@{it}"


def track(total: int, unit: str, rate_unit: str = "") -> Progress:
    """A progress line for a loop of `total` units in this stage process."""
    return Progress(stage_label(), total, unit, rate_unit)
