"""The run's fork server (tasks/runtime/forkserver.py): a stage program started under it runs in
a forked child that has torch imported already, with the program's own working directory,
environment, arguments, `sys.path` (the workspace's copy of the stage sources) and standard
streams; the program exits as the child does and passes signals on; the child ends with the
program; a program the server cannot serve as a fresh interpreter would runs on its own.

The probe stage lives only in a copy of tasks/ outside the checkout, so a child that ran it
imported that copy, not the server's modules."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import cli_env
from tasks.core import heap
from tasks.runtime import forkserver

ROOT = Path(__file__).resolve().parent.parent

PROBE = '''
import json, os, sys, time
started_with_torch = "torch" in sys.modules     # a fresh interpreter has not imported it
import tasks
out = {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv[1:],
       "env": os.environ.get("ALIGNLOOP_PROBE_VALUE"), "tasks": tasks.__file__,
       "torch": started_with_torch, "main": __name__}
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "sleep":
    time.sleep(60)
elif mode == "exit3":
    raise SystemExit(3)
elif mode == "raise":
    raise RuntimeError("probe failed")
'''


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of tasks/ with one more stage module, the probe."""
    root = tmp_path_factory.mktemp("code")
    shutil.copytree(ROOT / "tasks", root / "tasks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tasks" / "stages" / "zz_probe.py").write_text(PROBE)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[forkserver.Server]:
    log = tmp_path_factory.mktemp("forkserver") / "server.log"
    srv = forkserver.Server().start({**cli_env(), **heap.stage_environment()}, log)
    srv.log = log                                    # type: ignore[attr-defined]
    yield srv
    srv.stop()


def stage_env(**extra: str) -> dict[str, str]:
    return {**cli_env(), **heap.stage_environment(), **extra}


SERVER: list[str] = []     # the module's server's socket, for the programs' environment


@pytest.fixture(autouse=True)
def _socket(request: pytest.FixtureRequest) -> None:
    SERVER[:] = [request.getfixturevalue("server").path] if "server" in request.fixturenames \
        else []


def probe(code: Path, *args: str, env: dict[str, str] | None = None,
          **kw: object) -> subprocess.Popen[str]:
    env = env or stage_env(ALIGNLOOP_PROBE_VALUE="v1")
    if SERVER and forkserver.ENV not in env:
        env[forkserver.ENV] = SERVER[0]
    return subprocess.Popen([sys.executable, "-m", "tasks.stages.zz_probe", *args], cwd=code,
                            env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # type: ignore


def finish(p: subprocess.Popen[str]) -> tuple[dict[str, object], str, int]:
    out, err = p.communicate(timeout=120)
    return json.loads(out.splitlines()[0]), err, p.returncode


def test_a_stage_program_runs_in_a_forked_child_as_itself(code: Path,
                                                          server: forkserver.Server) -> None:
    p = probe(code, "plain", "--it", "3")
    out, err, rc = finish(p)
    assert rc == 0 and "to stderr" in err
    assert out["torch"] is True                      # started from the server's imports
    assert out["ppid"] == server.proc.pid and out["pid"] != p.pid   # type: ignore[union-attr]
    assert out["cwd"] == str(code) and out["env"] == "v1" and out["main"] == "__main__"
    assert out["argv"] == ["plain", "--it", "3"]
    assert out["tasks"] == str(code / "tasks" / "__init__.py")   # the program's copy
    assert not psutil.pid_exists(int(out["pid"])) or \
        psutil.Process(int(out["pid"])).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize(("mode", "code_expected", "said"), [
    ("exit3", 3, ""), ("raise", 1, "RuntimeError: probe failed")])
def test_the_program_exits_as_its_child_did(code: Path, server: forkserver.Server, mode: str,
                                            code_expected: int, said: str) -> None:
    out, err, rc = finish(probe(code, mode))
    assert out["torch"] is True and rc == code_expected and said in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_program_reaches_its_child(code: Path, server: forkserver.Server,
                                                   sig: int) -> None:
    p = probe(code, "sleep")
    assert p.stdout is not None
    out = json.loads(p.stdout.readline())
    assert out["torch"] is True
    child = psutil.Process(int(out["pid"]))
    p.send_signal(sig)
    p.wait(30)
    # SIGTERM kills; SIGINT is Python's KeyboardInterrupt, and the interpreter then dies of it
    assert p.returncode == -sig
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert gone and not alive


def test_kill_9_of_the_program_ends_its_child(code: Path, server: forkserver.Server) -> None:
    p = probe(code, "sleep")
    assert p.stdout is not None
    out = json.loads(p.stdout.readline())
    child = psutil.Process(int(out["pid"]))
    p.kill()
    p.wait(30)
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert gone and not alive


def test_a_program_the_server_cannot_serve_runs_on_its_own(code: Path,
                                                           server: forkserver.Server) -> None:
    # a variable libraries read at import (OpenMP's threads) differs from the server's
    p = probe(code, "plain", env=stage_env(ALIGNLOOP_PROBE_VALUE="v2", OMP_NUM_THREADS="1"))
    out, _, rc = finish(p)
    assert rc == 0 and out["torch"] is False and out["pid"] == p.pid and out["env"] == "v2"
    assert "tasks.stages.zz_probe runs on its own: the environment variable OMP_NUM_THREADS " \
        "differs" in server.log.read_text()              # type: ignore[attr-defined]
    # variables the CLI and DVC set per stage may differ
    out, _, rc = finish(probe(code, "plain", env=stage_env(
        ALIGNLOOP_PROBE_VALUE="v3", ALIGNLOOP_STAGE_SUMMARY="/dev/null", DVC_STAGE="zz")))
    assert rc == 0 and out["torch"] is True and out["env"] == "v3"


def test_off_or_without_a_server_a_program_runs_on_its_own(code: Path) -> None:
    for value in ("0", str(code / "no-such-socket")):
        p = probe(code, "plain", env=stage_env(**{forkserver.ENV: value}))
        out, _, rc = finish(p)
        assert rc == 0 and out["torch"] is False and out["pid"] == p.pid


def test_the_server_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = ("import os, sys, time; sys.path.insert(0, sys.argv[1]); "
              "from tasks.runtime import forkserver; forkserver.ensure(); "
              "print(os.environ.get(forkserver.ENV), flush=True); forkserver.enable(); "
              "forkserver.ensure(); forkserver.ensure(); s, = forkserver._STARTED; "
              "print(s.proc.pid, os.environ[forkserver.ENV] == s.path, flush=True); "
              "time.sleep(60)")
    env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
    parent = subprocess.Popen([sys.executable, "-c", script, str(ROOT)], env=env, text=True,
                              stdout=subprocess.PIPE)
    assert parent.stdout is not None
    assert parent.stdout.readline() == "None\n"        # not enabled: no server
    pid, advertised = parent.stdout.readline().split()
    assert advertised == "True"                         # one server, in the environment
    srv = psutil.Process(int(pid))
    parent.kill()
    parent.wait(30)
    t0 = time.monotonic()
    gone, alive = psutil.wait_procs([srv], timeout=60)
    assert gone and not alive, f"the server outlived its parent by {time.monotonic() - t0:.0f} s"


def test_the_shared_tiny_run_forked_every_stage_from_its_clis_own_server(tiny_run) -> None:
    """The run's log names each stage program its fork server forked (the CLI started the
    server: the first run was given none), and none ran on its own."""
    import re
    logs = sorted((tiny_run["ws"] / ".alignloop" / "logs").glob("run-*.log"))  # type: ignore
    first = logs[0].read_text()
    forked = re.findall(r"fork server: (tasks\.stages\.\w+(?: --it \d+)?) forked as pid", first)
    loop = [f"tasks.stages.{s} --it {it}" for it in (1, 2)
            for s in ("rollout", "judge", "train_rm", "update", "evaluate", "gate")]
    assert set(loop) <= set(forked), forked
    assert "runs on its own" not in first


@pytest.mark.parametrize("stage", ["rollout", "update"])
def test_a_stage_forked_writes_the_bytes_it_writes_fresh(tiny_run, tmp_path: Path,
                                                         stage: str) -> None:
    """The same stage program of the tiny run's iteration 1, run again in two copies of its
    workspace: fresh, and forked from a fork server. Same machine, same code, same threads:
    its outputs are the same bytes (a sampler's log-probs and a trained policy's weights
    included). What the fork server changes is the start-up, not the arithmetic."""
    import hashlib

    import yaml
    lock = yaml.safe_load((tiny_run["ws"] / "dvc.lock").read_text())   # type: ignore
    outs = [o["path"] for o in lock["stages"][f"{stage}@1"]["outs"]]

    def digest(ws: Path) -> dict[str, str]:
        files = [f for out in outs for f in ([ws / out] if (ws / out).is_file()
                                             else sorted((ws / out).rglob("*")))
                 if f.is_file()]
        return {str(f.relative_to(ws)): hashlib.md5(f.read_bytes()).hexdigest() for f in files}

    runs = {}
    log = tmp_path / "server.log"
    srv = forkserver.Server().start({**cli_env(), **heap.stage_environment()}, log)
    try:
        for how in ("fresh", "forked"):
            ws = shutil.copytree(tiny_run["ws"], tmp_path / how, symlinks=True)  # type: ignore
            for out in outs:                           # DVC's links into the cache: replaced
                target = ws / out
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
            env = stage_env(**{forkserver.ENV: srv.path if how == "forked" else "0"})
            proc = subprocess.run([sys.executable, "-m", f"tasks.stages.{stage}", "--it", "1"],
                                  cwd=ws, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-2000:]
            runs[how] = digest(ws)
    finally:
        srv.stop()
    assert log.read_text().count(f"tasks.stages.{stage} --it 1 forked as pid") == 1
    assert runs["fresh"] and runs["fresh"] == runs["forked"]
    assert runs["fresh"] == digest(tiny_run["ws"])     # type: ignore[arg-type]


# a whole extra iteration through the CLI; the fast tests fork the tiny run's stages
@pytest.mark.slow
def test_a_tick_in_a_copied_workspace_forks_its_stages_from_its_own_server(tiny_run,
                                                                          tmp_path: Path) -> None:
    """`alignloop tick` (what every cron fire runs) in a copy of the finished tiny workspace:
    iteration 3's stage programs are forked by the tick's own fork server, none runs on its
    own, and the iteration is committed."""
    import re

    from conftest import copy_workspace, run_cli
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")          # type: ignore[arg-type]
    logs = set((ws / ".alignloop" / "logs").glob("*.log"))
    out = run_cli("tick", "--workspace", str(ws), env={forkserver.ENV: ""})
    assert re.search(r"^tick: \w+ iteration 3$", out.stdout, re.M), out.stdout
    new = [p for p in (ws / ".alignloop" / "logs").glob("*.log") if p not in logs
           and "prefect-server" not in p.name]
    text = "".join(p.read_text() for p in new)
    forked = set(re.findall(r"(tasks\.stages\.\w+ --it 3) forked as pid", text))
    assert {f"tasks.stages.{s} --it 3" for s in ("rollout", "judge", "train_rm", "update",
                                                  "evaluate", "gate")} <= forked, text[-2000:]
    assert "runs on its own" not in text
    tracked = subprocess.run(["git", "ls-files", "metrics/iter_3"], cwd=ws,
                             capture_output=True, text=True).stdout.split()
    assert "metrics/iter_3/gate_decision.json" in tracked, tracked    # committed
