"""The stage processes' malloc settings (tasks/core/heap.py): they take effect, and a user's win."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core import heap

ROOT = Path(__file__).resolve().parent.parent

# a fresh process makes a 64 MB torch tensor and reads glibc's mallinfo2 while it lives: the
# bytes in mappings of their own (glibc's default above its mmap threshold, 32 MB at most)
PROBE = """
import ctypes, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
x = torch.ones(16 * 2**20)
print(mallinfo2().hblkhd)
"""


def mapped_bytes(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True).stdout
    return int(out)


def loader_tunables(env: dict[str, str]) -> dict[str, str]:
    """The tunables' values as this process's dynamic loader reads them from `env`
    (`ld.so --list-tunables`, glibc >= 2.33)."""
    maps = Path("/proc/self/maps").read_text().split()
    loader = next(p for p in maps if "/ld-linux" in p)
    out = subprocess.run([loader, "--list-tunables"], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True).stdout
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


@pytest.mark.skipif(not heap.is_glibc(), reason="glibc's tunables")
def test_stage_settings_take_effect() -> None:
    """glibc ignores a misspelt tunable without a word: each one is checked by what it does
    (mmap off: a 64 MB tensor comes from the heap) or by the value glibc read (the trim
    threshold, whose effect depends on what lies at the heap's top)."""
    stage_env = heap.stage_environment({})
    assert stage_env == {heap.ENV: heap.TUNABLES}
    assert mapped_bytes({heap.ENV: ""}) >= 64 * 2**20     # glibc's default: its own mapping
    assert mapped_bytes(stage_env) == 0                   # mmap_max=0: from the heap
    read = loader_tunables(stage_env)["glibc.malloc.trim_threshold"].split()[0]
    assert int(read, 16) == 2**40                         # never given back
    stock = loader_tunables({heap.ENV: ""})["glibc.malloc.trim_threshold"].split()[0]
    assert int(stock, 16) != 2**40


def test_the_users_tunables_win() -> None:
    assert heap.stage_environment({heap.ENV: ""}) == {}
    assert heap.stage_environment({heap.ENV: "glibc.malloc.arena_max=2"}) == {}


def test_nothing_set_off_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "is_glibc", lambda: False)
    assert heap.stage_environment({}) == {}


@pytest.mark.skipif(not heap.is_glibc(), reason="glibc's tunables")
@pytest.mark.parametrize("choice,expected", [("stage", heap.TUNABLES), ("stock", "")])
def test_a_benchmark_restarts_itself_under_the_chosen_heap(tmp_path, choice, expected) -> None:
    """benchmarks' --heap: glibc reads tunables at start, so the program runs again with them."""
    script = tmp_path / "prog.py"
    script.write_text("import os, sys\n"
                      f"sys.path.insert(0, {str(ROOT)!r})\n"
                      "from benchmarks.isolation import restart_with_heap\n"
                      "restart_with_heap(sys.argv[1])\n"
                      "print(repr(os.environ.get('GLIBC_TUNABLES')))\n")
    env = {k: v for k, v in os.environ.items() if k != heap.ENV}
    out = subprocess.run([sys.executable, str(script), choice], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == repr(expected if expected else None)    # stock: no restart needed
    again = subprocess.run([sys.executable, str(script), choice],
                           env={**env, heap.ENV: "glibc.malloc.arena_max=1"}, check=True,
                           capture_output=True, text=True).stdout
    assert again.strip() == repr(expected)                         # whatever was set, replaced


@pytest.mark.slow      # every training call in a process of its own, both sides: ~50 s
def test_heap_ab_losses_equal_on_a_tiny_model(tmp_path) -> None:
    """`python -m benchmarks.heap_ab` on a tiny model, one pass per side: every training call
    ran in its own process under each setting and the losses are equal to the bit."""
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    save_tiny(TinyModelParams(), 0, tmp_path)
    out = subprocess.run([sys.executable, "-m", "benchmarks.heap_ab", "--model", str(tmp_path),
                          "--kinds", "dpo,rm", "--repeats", "1"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    for kind in ("dpo", "rm"):
        r = result[kind]
        assert r["losses_equal"] and r["steps"] > 0, r
        assert len(r["stock"]["seconds"]) == len(r["stage"]["seconds"]) == 1
