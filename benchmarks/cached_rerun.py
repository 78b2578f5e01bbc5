"""How long a fully cached rerun of the loop takes, and where the time goes.

A `tiny`-profile workspace (two iterations, 16 stage instances) is created with the CLI
against a standalone Prefect server started once, then `alignloop run --workspace WS` is
repeated with nothing to do (the workspace's own params.yaml: nothing is synced from this
checkout, so edits made meanwhile cannot turn a rerun into a real run). Each rerun runs under
`python -X importtime -m benchmarks.timed_cli` (from the checkout root) and its wall time is
split:

- `interpreter_s`: spawn until the first line of Python runs;
- `imports_s`: the CLI's module-level imports (Prefect, DVC, MLflow; no torch);
- `lazy_imports_s`: imports the command does on first use (MLflow's SQL store, ruamel, ...);
- `rest_s`: the command minus those: params check and declaration sync, the Prefect flow (DVC
  status per stage, MLflow "already recorded" checks, git, the run report), the summary;
- `exit_s`: from the command's return until the process is gone (interpreter teardown).

`cached_rerun_s` = rest_s (median of the reruns); `server_start_s` (the standalone server
until healthy, fresh PREFECT_HOME: migrations included) is measured once, apart. Then, with
that server stopped, `temp_server_wall_s`: the whole rerun as a user's shell sees it on the
default path, where each run starts a temporary Prefect server of its own.

`--yaml-ab` (after a run has left the workspace): cached reruns with DVC's YAML parsed by
ruamel's pure-Python loader and by its C loader, alternating (`yaml_loader_ab`);
`--heartbeat-ab`: with Prefect's flow-heartbeat loop and with ours (flows/heartbeats.py).
"""
from __future__ import annotations

import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.isolation import REPO, isolated_env

TINY = REPO / "params" / "tiny.yaml"


def _start_server(ws: Path, env: dict[str, str]) -> tuple[dict[str, Any], float]:
    """The workspace's standalone Prefect server, started in a child (isolated env)."""
    code = ("import json, sys; from pathlib import Path; from flows import server; "
            "from flows.workspace import Workspace; "
            "print(json.dumps(server.start(Workspace(Path(sys.argv[1])))))")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(ws)], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True, timeout=180)
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def _stop_server(ws: Path, env: dict[str, str]) -> None:
    code = ("import sys; from pathlib import Path; from flows import server; "
            "from flows.workspace import Workspace; server.stop(Workspace(Path(sys.argv[1])))")
    subprocess.run([sys.executable, "-c", code, str(ws)], env=env, cwd=REPO, timeout=60,
                   capture_output=True)


def _cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"alignloop {' '.join(args)} exited {proc.returncode}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def lazy_import_s(stderr: str) -> tuple[float, list[tuple[str, float]]]:
    """Seconds of the top-level imports `-X importtime` logged after timed_cli's marker (the
    imports the command does on first use), and the largest of them."""
    from benchmarks.timed_cli import MARKER
    tail = stderr.split(MARKER, 1)[1] if MARKER in stderr else ""
    tops = []
    for line in tail.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|", 2)
        if len(name) - len(name.lstrip(" ")) == 1:         # nesting level 0
            tops.append((name.strip(), int(cumulative) / 1e6))
    return sum(s for _, s in tops), sorted(tops, key=lambda x: -x[1])[:5]


def timed_rerun(args: list[str], env: dict[str, str], work: Path,
                profile: Path | None = None, flags: list[str] | None = None) -> dict[str, Any]:
    """One `alignloop ARGS` through timed_cli.py (with its `flags`); its split, and whether
    anything ran."""
    timings = work / "timings.json"
    extra = (["--profile", str(profile)] if profile else []) + (flags or [])
    t_spawn = time.time()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "benchmarks.timed_cli",
                           str(timings), *extra, *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    t_exit = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"cached rerun exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    t = json.loads(timings.read_text())
    lazy, biggest = lazy_import_s(proc.stderr)
    ran = [ln for ln in proc.stdout.splitlines() if ln.startswith(("[ran] ", "[restored] "))]
    command = t["command_done"] - t["imports_done"]
    return {"wall_s": t_exit - t_spawn, "interpreter_s": t["boot"] - t_spawn,
            "imports_s": t["imports_done"] - t["boot"], "lazy_imports_s": lazy,
            "command_s": command, "rest_s": command - lazy,
            "exit_s": t_exit - t["command_done"], "all_cached": not ran,
            "stages": sum(ln.startswith("[cached] ") for ln in proc.stdout.splitlines()),
            "largest_lazy_imports": [(n, round(s, 3)) for n, s in biggest]}


def profile_summary(path: Path, top: int = 25) -> list[dict[str, Any]]:
    """The functions with the most cumulative time in a cProfile dump."""
    table = pstats.Stats(str(path)).stats        # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, ncalls, _, cum, _) in table.items():
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": ncalls,
                     "cumulative_s": round(cum, 3)})
    rows.sort(key=lambda r: -r["cumulative_s"])
    return rows[:top]


def python_startup_s(env: dict[str, str], n: int = 3) -> float:
    """Bare interpreter start-up (`python -c pass`), the floor under every process."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_cached_rerun(work: Path, params: Path = TINY, reruns: int = 5,
                         profile: bool = False) -> dict[str, Any]:
    """Create/refresh a tiny workspace in `work`, then time `reruns` fully cached reruns."""
    work.mkdir(parents=True, exist_ok=True)
    ws = work / "ws"
    env = isolated_env(work / "stores")
    server, server_s = _start_server(ws, env)
    env = {**env, "PREFECT_API_URL": server["api_url"]}
    try:
        t0 = time.perf_counter()
        first = _cli(["run", "--params", str(params), "--workspace", str(ws)], env, 900)
        first_s = time.perf_counter() - t0
        args = ["run", "--workspace", str(ws)]          # the workspace's own params.yaml
        runs = [timed_rerun(args, env, work) for _ in range(reruns)]
        prof = None
        if profile:
            timed_rerun(args, env, work, profile=work / "rerun.prof")
            prof = profile_summary(work / "rerun.prof")
    finally:
        _stop_server(ws, env)
    # the user's default path: no server running, each run starts its own temporary one
    env.pop("PREFECT_API_URL")
    walls = []
    for _ in range(reruns):
        t0 = time.perf_counter()
        _cli(args, env, 300)
        walls.append(time.perf_counter() - t0)
    best = sorted(runs, key=lambda r: r["rest_s"])[len(runs) // 2]                # median
    out: dict[str, Any] = {
        "cached_rerun_s": round(best["rest_s"], 2),
        "definition": "the command's own time (params check and declaration sync, the Prefect "
                      "flow: DVC status per stage, MLflow checks, git, report) minus the imports "
                      "it does on first use; interpreter start and exit, module-level imports "
                      "and the standalone server's start-up are reported apart",
        "split": {k: round(best[k], 2) for k in ("wall_s", "interpreter_s", "imports_s",
                                                  "lazy_imports_s", "rest_s", "exit_s")},
        "cached_rerun_with_exit_s": round(best["rest_s"] + best["exit_s"], 2),
        "largest_lazy_imports": best["largest_lazy_imports"],
        "server_start_s": round(server_s, 2),
        # the whole `alignloop run` as a user's shell sees it, the run's own temporary Prefect
        # server included (started beside the imports and the DAG parse): median and all
        "temp_server_wall_s": round(sorted(walls)[len(walls) // 2], 2),
        "temp_server_wall_s_all": [round(w, 2) for w in walls],
        "python_startup_s": round(python_startup_s(env), 3),
        "first_run_s": round(first_s, 1),
        "first_run_ran": sum(ln.startswith(("[ran] ", "[restored] "))
                             for ln in first.stdout.splitlines()),
        "reruns": [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                    if k != "largest_lazy_imports"} for r in runs],
        "all_cached": all(r["all_cached"] for r in runs),
        "rerun_s_all": [round(r["rest_s"], 2) for r in runs],
        "median_of": len(runs), "profile": params.name, "workspace": str(ws),
    }
    if prof is not None:
        out["profile_top"] = prof
    return out


def _alternate(work: Path, sides: dict[str, tuple[dict[str, str], list[str]]],
               pairs: int) -> dict[str, Any]:
    """On the workspace measure_cached_rerun left in `work`, against one standalone server:
    cached reruns of each side (extra environment, extra timed_cli flags) in turn, `pairs`
    rounds; rest_s of every rerun and the 1-minute load."""
    ws = work / "ws"
    if not (ws / "dvc.lock").is_file():
        raise SystemExit(f"{ws}: no workspace; run `python -m benchmarks.cached_rerun {work}`")
    env = isolated_env(work / "stores")
    server, _ = _start_server(ws, env)
    env = {**env, "PREFECT_API_URL": server["api_url"]}
    out: dict[str, Any] = {name: [] for name in sides}
    out["load_1min"] = []
    try:
        for _ in range(pairs):
            for name, (extra_env, flags) in sides.items():
                r = timed_rerun(["run", "--workspace", str(ws)], {**env, **extra_env}, work,
                                flags=flags)
                if not r["all_cached"]:
                    raise RuntimeError("a rerun ran a stage: not a cached rerun")
                out[name].append(round(r["rest_s"], 2))
                out["load_1min"].append(round(os.getloadavg()[0], 1))
    finally:
        _stop_server(ws, env)
    return out


def yaml_loader_ab(work: Path, pairs: int = 4) -> dict[str, Any]:
    """Cached reruns with ruamel's pure-Python YAML loader (its C extension hidden by a module
    that refuses to import) and with the C loader, alternating (`_alternate`)."""
    shim = work / "no-c-yaml"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "_ruamel_yaml.py").write_text('raise ImportError("hidden: pure-Python YAML")\n')
    path = os.pathsep.join([str(shim), isolated_env(work / "stores")["PYTHONPATH"]])
    return _alternate(work, {"pure_python_yaml": ({"PYTHONPATH": path}, []),
                             "c_yaml": ({}, [])}, pairs)


def heartbeat_ab(work: Path, pairs: int = 4) -> dict[str, Any]:
    """Cached reruns with Prefect's own flow-heartbeat loop (joined at the flow's end, up to
    1 s) and with flows/heartbeats.py's, alternating (`_alternate`)."""
    return _alternate(work, {"prefect_heartbeats": ({}, ["--prefect-heartbeats"]),
                             "alignloop_heartbeats": ({}, [])}, pairs)


# python -m benchmarks.cached_rerun [WORKDIR] [--profile | --yaml-ab | --heartbeat-ab]
if __name__ == "__main__":
    d = Path(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") \
        else REPO / "benchmarks" / ".cache" / "tiny"
    if "--yaml-ab" in sys.argv:
        print(json.dumps(yaml_loader_ab(d), indent=1))
    elif "--heartbeat-ab" in sys.argv:
        print(json.dumps(heartbeat_ab(d), indent=1))
    else:
        print(json.dumps(measure_cached_rerun(d, profile="--profile" in sys.argv), indent=1))
    os._exit(0)
