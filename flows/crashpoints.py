"""Named points in the record step where a crash can be injected, to test that every run
after a `kill -9` at any of them converges on the same ledger (tests/test_recovery.py), and in
`alignloop gc` (tests/test_gc.py).

`ALIGNLOOP_CRASH_AT=POINT@ITERATION` makes the process SIGKILL itself on reaching that point:
no handler, no finally block, no flush runs, exactly as when a person or the OOM killer kills
it. Unset (always, outside tests), `reach` is a dictionary lookup.
"""
from __future__ import annotations

import os
import signal

ENV = "ALIGNLOOP_CRASH_AT"
POINTS = ("git_commit",        # the iteration's commit is made, nothing logged yet
          "mlflow_run",        # the iteration's MLflow run exists, half of its stage runs
          "rm_version",        # the reward model version exists, the policy's does not
          "policy_version",    # the policy version exists, the gate has not been applied
          "alias_ledger",      # the alias move is in the ledger file, not yet in MLflow
          "alias",             # the alias has moved in MLflow; its ledger is not committed
          "dvc_push")          # everything recorded; the data not yet pushed to the remote
GC_POINTS = ("gc_aside",       # `alignloop gc` (iteration 0) moved the weights aside; no tag,
                               #   ledger line or commit yet
             "gc_record")      # gc's record committed; the remote's objects not yet deleted


def reach(point: str, iteration: int) -> None:
    """SIGKILL this process if ALIGNLOOP_CRASH_AT names this point of this iteration."""
    if os.environ.get(ENV) == f"{point}@{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)
