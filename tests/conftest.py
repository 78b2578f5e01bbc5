"""Test isolation: every Prefect, MLflow and DVC store lives in the pytest run's temp dirs.

No test touches the user's ~/.prefect, an MLflow server, or a DVC site cache; no test
downloads anything (the offline switches are set for every process the tests start).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

pytest_plugins = ["slow_budget"]      # CI's time budget for the slow tests (tests/slow_budget.py)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "params" / "tiny.yaml"


@pytest.fixture(scope="session", autouse=True)
def isolated_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("stores")
    for var in ("PREFECT_API_URL", "PREFECT_PROFILE", "MLFLOW_TRACKING_URI", "PREFECT_HOME"):
        os.environ.pop(var, None)
    env = {"PREFECT_HOME": str(base / "prefect"), "DVC_SITE_CACHE_DIR": str(base / "dvc-site"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "true",
           "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DVC_NO_ANALYTICS": "1", "ALIGNLOOP_THREADS": "2",
           "ALIGNLOOP_CACHE_DIR": str(base / "tokenizer-cache"),   # extracted once a session
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    os.environ.update(env)
    return env


SHARED_SERVER: list[str] = []         # the session's fork server's socket (run_cli's CLIs)


@pytest.fixture(scope="session", autouse=True)
def shared_fork_server(isolated_env: dict[str, str],
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One fork server (tasks/runtime/forkserver.py) for the CLIs `run_cli` starts, so that
    their stage programs skip the imports without each CLI starting a server of its own for
    the one or two stages most of them run. Its environment is what a CLI gives its stages;
    a stage whose environment differs (a test's own variable) runs on its own. The shared
    tiny run, and the tests that signal or kill a CLI they start themselves, run with the
    CLI's own server, as a user's run does."""
    from flows.workspace import QUIET_ENV
    from tasks.core import heap
    from tasks.runtime import forkserver
    env = {**cli_env(), **QUIET_ENV}
    env.update(heap.stage_environment(env))
    log = tmp_path_factory.mktemp("fork-server") / "server.log"
    server = forkserver.Server().start(env, log)
    SHARED_SERVER[:] = [server.path]
    yield
    SHARED_SERVER.clear()
    server.stop()


def cli_env() -> dict[str, str]:
    """This process's environment for a CLI it starts: without pytest's marker of the running
    test (set anew for each test; a shared fork server started in one test would otherwise
    refuse the stages of the next) and without a fork server's socket."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTEST_CURRENT_TEST", "ALIGNLOOP_FORKSERVER")}


SHARED_PREFECT: list[object] = []     # the session's Prefect server (run_cli's runs, reruns, ticks)


def shared_prefect(args: Collection[str], env: dict[str, str]) -> dict[str, str]:
    """PREFECT_API_URL of one Prefect server for the session's `alignloop run`, `rerun` and
    `tick` commands, started at the first: the same server a run starts for itself
    (flows/run_server.py, on the session's store), which takes 6-10 s of a core to start, once
    instead of once per run. Not for a command whose caller sets a Prefect variable (the shared tiny run sets
    PREFECT_API_URL empty: the CLI's own server, as a user's run has) nor for a workspace whose
    standalone server runs (`alignloop server start`: the run uses that, as a user's does)."""
    args = list(args)
    if not args or args[0] not in ("run", "rerun", "tick") or \
            any(k.startswith("PREFECT_") for k in env):
        return {}
    if "--workspace" in args[:-1]:
        ws = Path(args[args.index("--workspace") + 1])
        from flows.workspace import STATE_DIR
        if (ws / STATE_DIR / "prefect-server.json").is_file():
            return {}
    import threading
    if SHARED_PREFECT and SHARED_PREFECT[0].proc.poll() is not None:   # type: ignore[attr-defined]
        SHARED_PREFECT.clear()                  # ended (it dies with the thread that started it)
    if not SHARED_PREFECT:
        if threading.current_thread() is not threading.main_thread():
            return {}
        from flows.run_server import RunServer
        server = RunServer(Path(os.environ["PREFECT_HOME"]) / "shared-server.log").start()
        server.wait()
        SHARED_PREFECT.append(server)
    return {"PREFECT_API_URL": SHARED_PREFECT[0].api_url}          # type: ignore[attr-defined]


@pytest.fixture(scope="session", autouse=True)
def shared_prefect_server(isolated_env: dict[str, str]) -> Iterator[None]:
    """Stops the session's Prefect server (`shared_prefect`) at the session's end."""
    yield
    for server in SHARED_PREFECT:
        server.stop()                                              # type: ignore[attr-defined]
    SHARED_PREFECT.clear()


def run_cli(*args: str, check: bool = True, timeout: float = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `alignloop ARGS` in a fresh interpreter, as a user would, its stage programs
    forked from the session's fork server (env {"ALIGNLOOP_FORKSERVER": ""}: from the CLI's
    own, as a user's are) and a run, rerun or tick reporting to the session's Prefect server
    (`shared_prefect`)."""
    shared = {"ALIGNLOOP_FORKSERVER": SHARED_SERVER[0]} if SHARED_SERVER else {}
    shared.update(shared_prefect(args, env or {}))
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**cli_env(), **shared, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"alignloop {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def snapshot(root: Path, cache: bool = True) -> dict[str, str]:
    """md5 of every file a run may write, except the state stores and DVC's tmp; without the
    DVC cache when `cache` is False (a content-addressed store a failed run may add objects
    to: outputs of the stages that succeeded before the failure, for DVC's run-cache)."""
    import hashlib
    out = {}
    skip = (".alignloop/", ".git/", ".dvc/tmp/") + (() if cache else (".dvc/cache/",))
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not rel.startswith(skip):
            out[rel] = hashlib.md5(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two iterations of the tiny profile in a fresh workspace, run twice through the CLI."""
    ws = tmp_path_factory.mktemp("tiny") / "ws"
    first = run_cli("run", "--params", str(TINY), "--workspace", str(ws),
                    env={"ALIGNLOOP_FORKSERVER": "",     # the CLI's own fork server
                         "PREFECT_API_URL": ""})          # and Prefect server
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws, capture_output=True,
                          text=True).stdout.strip()
    before = snapshot(ws)
    second = run_cli("run", "--params", str(TINY), "--workspace", str(ws))
    head2 = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws, capture_output=True,
                           text=True).stdout.strip()
    return {"ws": ws, "first": first, "second": second, "before": before,
            "after": snapshot(ws), "head": head, "head2": head2}


@pytest.fixture(scope="session")
def stage_loop(tmp_path_factory: pytest.TempPathFactory) -> object:
    """One iteration of the tiny profile's loop, every stage's main() called in DAG order in a
    temp workspace (tests/stage_loop.py): what the per-stage smoke tests read and copy."""
    from stage_loop import loop_workspace
    return loop_workspace(tmp_path_factory.mktemp("loop") / "ws")


def copy_workspace(src: Path, dst: Path) -> Path:
    """A full copy (git, DVC cache, MLflow store, its own DVC remote: the default remote is
    named relative to the workspace)."""
    import shutil
    shutil.copytree(src, dst, symlinks=True)
    return dst


def ran_stages(stdout: str) -> list[str]:
    """Stage instances a run recomputed or restored, from its progress lines."""
    return [line.split()[1] for line in stdout.splitlines()
            if line.startswith(("[ran] ", "[restored] "))]


def set_params(path: Path, **edits: object) -> None:
    """Set dotted keys (given with `__` for `.`) in a params file; the result must still load."""
    import yaml

    from tasks.config.params import load_params
    data = yaml.safe_load(path.read_text())
    for dotted, value in edits.items():
        *parents, last = dotted.split("__")
        node = data
        for key in parents:
            node = node[key]
        assert last in node, f"{dotted} is not a key of {path.name}"
        node[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_params(path)


def tiny_stage_workspace(root: Path) -> Path:
    """A workspace for calling stage mains directly: the versioned data the stages read, the
    tiny profile as params.yaml and an empty import directory."""
    import shutil

    from flows.shipped import PARAMS_DATA
    from tasks.core import layout
    (root / "params").mkdir(parents=True)
    for name in PARAMS_DATA:
        shutil.copytree(ROOT / "params" / name, root / "params" / name)
    shutil.copy(TINY, root / layout.PARAMS_FILE)
    (root / layout.IMPORT_DIR).mkdir(parents=True)
    return root


def run_stage(main: object, root: Path, it: int = 0) -> None:
    """Call a stage edge's main() on a workspace root, as its dvc.yaml cmd would."""
    main(["--root", str(root), "--it", str(it)])  # type: ignore[operator]


def read_json(path: Path) -> object:
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def ray_address() -> object:
    """One local Ray cluster for the session (start-up ~10 s, shared): this process holds it
    (tasks.runtime.ray_pool uses it as it is), and CLI runs reach it through RAY_ADDRESS."""
    pytest.importorskip("ray")
    import ray

    from tasks.runtime import ray_pool
    with ray_pool.cluster(2):
        yield ray.get_runtime_context().gcs_address


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """ast.walk, less the bodies of `if TYPE_CHECKING:` blocks (imports there never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def project_imports(source: str, known: Collection[str]) -> set[str]:
    """The modules of `known` (dotted names) a Python source imports, at any depth and in any
    form, except under `if TYPE_CHECKING:` (never run); a package imported for its modules
    (`from tasks.core import atomic`) counts as those modules."""
    out: set[str] = set()
    for node in runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in known}


def serve_and_chat(ws: Path, request: dict[str, object]) -> object:
    """`alignloop serve` of the workspace's champion (MLflow's scoring server, PATH without this
    interpreter's bin directory, run from another directory than the workspace), one request to
    /invocations, the server stopped; the decoded reply."""
    import socket
    import time
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--workspace", str(ws),
                               "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                if urllib.request.urlopen(f"{url}/ping", timeout=5).status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "the scoring server did not come up"
                time.sleep(1)
        body = json.dumps(request).encode()
        req = urllib.request.Request(f"{url}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    return reply
