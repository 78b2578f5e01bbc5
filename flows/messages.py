"""The flow's progress lines and warnings: to the terminal and to the Prefect run's log."""
from __future__ import annotations

import logging

from prefect import get_run_logger


def say(msg: str, terminal: bool = True) -> None:
    """Progress line for the terminal (unless `terminal` is False) and the Prefect log."""
    if terminal:
        print(msg, flush=True)
    try:
        get_run_logger().info(msg)
    except Exception:   # noqa: BLE001 (outside a run context: tests calling helpers directly)
        pass


def warn(msg: str) -> None:
    """A warning in the Prefect log (and on the terminal), with the current traceback."""
    logger: logging.Logger | logging.LoggerAdapter
    try:
        logger = get_run_logger()
    except Exception:   # noqa: BLE001 (outside a run context)
        logger = logging.getLogger(__name__)
    logger.warning(msg, exc_info=True)
