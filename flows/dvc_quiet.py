"""DVC's warnings off for a moment: a checkout of outputs the lock does not vouch for yet warns
once per output ("No file hash info found ... It won't be created"); a restore, or a failed
stage's cleanup, says what it did in its own words, in one line."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_dvc() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("dvc", "dvc_data")]   # dvc_data warns
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
