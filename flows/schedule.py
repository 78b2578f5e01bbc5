"""Recurring iterations: each tick appends the next iteration to the workspace's params and
runs the DAG (new iterations sample a fresh window of the train prompts).

Never two iterations interleaved in one workspace: a tick holds an exclusive lock on the
workspace for its whole run; an overlapping tick waits for it or is skipped (`overlap`), and
either way says so in the log. A failed tick puts the workspace back as it was before it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from prefect import flow

from flows import pipeline
from flows.pipeline import say
from flows.workspace import Workspace, git
from tasks import layout
from tasks.params import iteration_numbers, parse_params

Overlap = Literal["wait", "skip"]
TICKS = "ticks.jsonl"          # in .alignloop/: when each tick started and ended, and why


class Busy(RuntimeError):
    """Another iteration holds the workspace."""


@contextlib.contextmanager
def workspace_lock(ws: Workspace, overlap: Overlap) -> Iterator[None]:
    ws.state.mkdir(parents=True, exist_ok=True)
    with (ws.state / "iteration.lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (fcntl.LOCK_NB if overlap == "skip" else 0))
        except BlockingIOError:
            raise Busy(f"{ws.root}: another iteration is running") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def append_iteration(text: str) -> tuple[str, int]:
    """The params text with one more item under `iterations:`; comments are kept."""
    params = parse_params(text)
    k = max(iteration_numbers(params)) + 1
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if re.match(r"^iterations:", line))
    end = start + 1
    while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    indent = re.match(r"^(\s*)", lines[start + 1]).group(1) if end > start + 1 else "  "
    lines.insert(end, f'{indent}"{k}": {{prev: {k - 1}}}\n')
    new = "".join(lines)
    assert max(iteration_numbers(parse_params(new))) == k
    return new, k


def _log_tick(ws: Workspace, record: dict[str, object]) -> None:
    with (ws.state / TICKS).open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def _restore(ws: Workspace, head: str, iteration: int) -> None:
    """Back to the commit before the tick: tracked files, the new iteration's artifacts
    removed, every other DVC output checked out as dvc.lock records it."""
    import shutil

    from dvc.repo import Repo
    git(ws.root, "reset", "-q", "--hard", head)
    for rel in layout.iteration_dirs(iteration):
        shutil.rmtree(ws.root / rel, ignore_errors=True)
    with contextlib.chdir(ws.root), Repo(str(ws.root)) as repo:
        repo.checkout(force=True)


@flow(name="alignloop-tick", flow_run_name="tick-{workspace}")
def tick(workspace: str, overlap: Overlap = "wait") -> dict[str, object]:
    """One scheduled iteration: append it to params.yaml, run the DAG, record it."""
    ws = Workspace(Path(workspace))
    t0 = time.time()
    try:
        with workspace_lock(ws, overlap):
            started = time.time()
            head = git(ws.root, "rev-parse", "HEAD")
            path = ws.root / layout.PARAMS_FILE
            new, k = append_iteration(path.read_text())
            path.write_text(new)
            try:
                summaries = pipeline.alignloop(workspace)
            except BaseException:
                _restore(ws, head, k)
                _log_tick(ws, {"iteration": k, "start": started, "end": time.time(),
                               "outcome": "failed"})
                say(f"tick: iteration {k} failed; workspace restored to {head[:10]}")
                raise
            _log_tick(ws, {"iteration": k, "start": started, "end": time.time(),
                           "outcome": "ran", "waited_s": round(started - t0, 3)})
            say(f"tick: iteration {k} done")
            return {"iteration": k, "outcome": "ran", "summaries": summaries}
    except Busy as e:
        _log_tick(ws, {"start": t0, "end": time.time(), "outcome": "skipped"})
        say(f"tick: skipped ({e})")
        return {"outcome": "skipped"}


def serve(ws: Workspace, cron: str, overlap: Overlap) -> None:
    """Serve the tick as a Prefect deployment on `cron` (blocks; Ctrl-C to stop)."""
    tick.serve(name=f"alignloop-{ws.root.name}", cron=cron,
               parameters={"workspace": str(ws.root), "overlap": overlap},
               description=f"alignloop iterations in {ws.root}")
