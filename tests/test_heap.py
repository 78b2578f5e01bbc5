"""The stage processes' malloc settings (tasks/heap.py): they take effect, and a user's win."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tasks import heap

# a fresh process runs six "steps" that each make and free three 64 MB tensors, as a training
# step makes its logits, their softmax and gradients, and counts the minor page faults of the
# last five: glibc's defaults map and unmap each one (16k faults per 4 KB-paged 64 MB)
STEPS = """
import json, resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    a = torch.ones(16 * 2**20); b = a * 2; c = (b + a).sum()
    del a, b
step()
f0 = faults()
for _ in range(5):
    step()
print(json.dumps(faults() - f0))
"""


def step_faults(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True).stdout
    return int(json.loads(out))


@pytest.mark.skipif(not heap.is_glibc(), reason="glibc's tunables")
def test_stage_settings_reuse_freed_tensor_memory() -> None:
    """A typo in a tunable's name is silently ignored by glibc: this is what catches it."""
    stage_env = heap.stage_environment({})
    assert stage_env == {heap.ENV: heap.TUNABLES}
    stock, stage = step_faults({heap.ENV: ""}), step_faults(stage_env)
    assert stock >= 5 * 3 * 16_000          # every page of every tensor faulted in again
    assert stage < stock / 2                # freed blocks reused (here: 66-82k of 246k)


def test_the_users_tunables_win() -> None:
    assert heap.stage_environment({heap.ENV: ""}) == {}
    assert heap.stage_environment({heap.ENV: "glibc.malloc.arena_max=2"}) == {}


def test_nothing_set_off_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "is_glibc", lambda: False)
    assert heap.stage_environment({}) == {}
