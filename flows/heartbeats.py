"""Prefect's flow-run heartbeats, stopped at once when the flow ends.

Prefect 3.9's sync flow engine sends a heartbeat event every `flows.heartbeat_frequency`
seconds (180 by default; a server's zombie-flow automation reads them) from a thread that
sleeps in 1 s steps, and joins that thread when the flow ends (PrefectHQ/prefect#19641), so
every flow run ends 0-1 s late: 0.45 s of a fully cached rerun's 1.45 s (median, measured
side by side: `python -m benchmarks.cached_rerun DIR --heartbeat-ab`).

`install()` puts in the engine's place a loop that sends the same events, built and emitted
by the engine's own methods at the same interval, but waits on the stop event itself, so
the join at the end returns at once. Where the engine lacks what it uses (another Prefect
version), nothing is replaced and Prefect's own loop runs. `uninstall()` puts Prefect's back.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from prefect import flow_engine

JOIN_SECONDS = 2.0                          # as Prefect: a send in flight may finish
_ENGINE_NEEDS = ("_build_heartbeat_event_template", "_emit_flow_run_heartbeat",
                 "heartbeat_seconds")
_PREFECTS = getattr(flow_engine, "_send_heartbeats", None)


@contextlib.contextmanager
def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """Prefect's `_send_heartbeats` contract: heartbeats while the block runs, none after."""
    seconds = engine.heartbeat_seconds
    if seconds is None:
        yield
        return
    seconds = max(seconds, flow_engine.MINIMUM_HEARTBEAT_INTERVAL)
    # Prefect has no public API for the heartbeat's event or its emission
    resource, related = engine._build_heartbeat_event_template()  # noqa: SLF001
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            run = engine.flow_run
            if run is not None and run.state is not None and run.state.is_final():
                return                        # a final run sends none
            try:
                engine._emit_flow_run_heartbeat(resource, related)  # noqa: SLF001
            except Exception:
                engine.logger.debug("Failed to emit heartbeat", exc_info=True)
            stop.wait(seconds)

    # the caller's context (settings, API URL) in the thread, as Prefect does
    thread = threading.Thread(target=contextvars.copy_context().run, args=(loop,),
                              daemon=True, name="alignloop-flow-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        if join_on_exit:
            thread.join(timeout=JOIN_SECONDS)


def supported() -> bool:
    """Whether this Prefect's engine has what `send_heartbeats` uses."""
    engine = getattr(flow_engine, "FlowRunEngine", None)
    return (_PREFECTS is not None and engine is not None
            and hasattr(flow_engine, "MINIMUM_HEARTBEAT_INTERVAL")
            and all(hasattr(engine, name) for name in _ENGINE_NEEDS))


def install() -> bool:
    """Replace the engine's heartbeat loop; returns whether it was replaced."""
    if not supported():
        return False
    flow_engine._send_heartbeats = send_heartbeats  # type: ignore[attr-defined]  # noqa: SLF001
    return True


def uninstall() -> None:
    """Prefect's own loop again (the benchmark's other side)."""
    if _PREFECTS is not None:
        flow_engine._send_heartbeats = _PREFECTS  # type: ignore[attr-defined]  # noqa: SLF001
