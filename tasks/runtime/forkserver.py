"""Stage programs started from a process that has imported torch and transformers already.

Each stage is a program of its own (`python -m tasks.stages.<name>`, what dvc.yaml runs), and
its imports (torch, transformers, peft: 3.5-7 s of one core, `benchmarks/stage_startup.py`)
are most of a small stage's time and ~30 s of every iteration. A run's CLI starts one fork
server when its first stage program is about to start (`enable`, `ensure`): a process that
imports every stage module once, then waits on a Unix socket. A stage program started by DVC
finds the socket in ALIGNLOOP_FORKSERVER and, from `tasks/stages/__init__.py` before any
heavy import, hands its arguments, working directory, environment, `sys.path` and standard
streams to the server (`delegate`). The server forks; the child takes them over, forgets
every `tasks` module it imported (the workspace's own copy of the stage sources is imported
fresh, from the program's `sys.path`) and runs the module as `python -m` would. The program
stays as the child's stand-in: it passes on the signals it receives (Ctrl-C, a service
manager's stop, `kill`), and exits as the child did (its code, or the same signal). The child
ends when its program ends, however it ends (kill -9 included): it watches the socket.

A stage program runs on its own, as before, whenever the server cannot give it what a fresh
interpreter would have: no server, another interpreter or interpreter flags, or an
environment that differs in any variable a library may read at import (only ALIGNLOOP_*,
DVC_*, PREFECT_*, MLFLOW_*, GIT_*, PATH and the shell's own may differ; the child runs with
the program's environment). The arithmetic is the same code on the same libraries: what a
stage computes does not depend on how it started. `ALIGNLOOP_FORKSERVER=0` turns it off.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = "ALIGNLOOP_FORKSERVER"          # the socket's path; "0": stage programs run on their own
MODULE_PREFIX = "tasks.stages."
SAFE_PREFIXES = ("ALIGNLOOP_", "DVC_", "PREFECT_", "MLFLOW_", "GIT_")
SAFE_KEYS = frozenset({"PATH", "PWD", "OLDPWD", "SHLVL", "_"})      # the shell's own
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


# -- the stage program's side ------------------------------------------------------------------

def delegate() -> None:
    """Run this stage program in a child of the fork server, and exit as it exits. Returns
    (the program goes on on its own) when there is no server, or it refuses."""
    path = os.environ.get(ENV)
    module = _stage_module()
    if not path or path == "0" or module is None:
        return
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        request = json.dumps({**identity(), "env": dict(os.environ), "cwd": os.getcwd(),
                              "path": list(sys.path), "module": module,
                              "argv": list(sys.argv[1:]), "orig_argv": list(sys.orig_argv)})
        socket.send_fds(sock, [b"R"], [0, 1, 2])
        _send(sock, request.encode())
        reader = sock.makefile("rb")
        reply = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        return
    if "pid" not in reply:                    # refused: run here
        sock.close()
        return
    pid = int(reply["pid"])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    try:
        done = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        done = {}
    if "signal" in done:                      # the child died of it: so does its stand-in
        sig = int(done["signal"])
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    if "status" not in done:                  # the server was stopped under it (the run is
        os._exit(1)                           # ending); the kernel ends its child with it
    os._exit(int(done["status"]))


def _stage_module() -> str | None:
    """The stage module this interpreter was started to run (`python -m tasks.stages.X`), while
    runpy is still importing its package; None otherwise (an import by other code)."""
    if sys.argv[:1] != ["-m"]:
        return None
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" not in argv[1:]:
        return None
    i = argv.index("-m", 1)
    module = argv[i + 1] if i + 1 < len(argv) else ""
    return module if module.startswith(MODULE_PREFIX) else None


def _forward(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def identity() -> dict[str, Any]:
    """What must be equal for a forked child to be what a fresh interpreter would be."""
    return {"executable": os.path.realpath(sys.executable), "version": sys.version,
            "flags": list(sys.flags), "xoptions": dict(sys._xoptions),  # noqa: SLF001 (-X)
            "warnoptions": list(sys.warnoptions)}


def refusal(mine: dict[str, Any], env0: dict[str, str], req: dict[str, Any]) -> str | None:
    """Why the server cannot run this request (None: it can)."""
    for key, value in mine.items():
        if req.get(key) != value:
            return f"the program's {key} differs"
    env = req.get("env", {})
    for key in sorted(set(env0) | set(env)):
        if env0.get(key) != env.get(key) and key not in SAFE_KEYS \
                and not key.startswith(SAFE_PREFIXES):
            return f"the environment variable {key} differs"
    return None


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("the stage program went away")
        buf += part
    return buf


# -- the server's side ---------------------------------------------------------------------------

def serve(path: str, parent: int, lifeline: int) -> None:
    """Listen at `path` (clients queue while the imports run), import every stage module, then
    fork a child per request until `parent`, the process that started the server, is gone:
    `lifeline` is the read end of a pipe whose write end only it holds, readable (EOF) the
    moment it ends, however it ends. Then the server exits at once; the kernel ends its
    children (a parent-death signal)."""
    env0, mine = dict(os.environ), identity()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)            # there only once it accepts connections
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the CLI decides; SIGTERM ends the server
    _preload()
    children: dict[int, socket.socket] = {}
    import select
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, lifeline], [], [], 0.2)
        if lifeline in ready:
            break
        if ready:
            conn, _ = listener.accept()
            pid = _accept(conn, listener, children, mine, env0, lifeline)
            if pid is not None:
                children[pid] = conn
        _reap(children)
    with contextlib.suppress(OSError):
        os.unlink(path)
    os._exit(0)                               # nothing to tear down: no interpreter exit


def _accept(conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket],
            mine: dict[str, Any], env0: dict[str, str], lifeline: int) -> int | None:
    fds: list[int] = []
    req: dict[str, Any] = {}
    try:
        conn.settimeout(10)
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
        req = json.loads(_recv_exact(conn, n))
        conn.settimeout(None)
        why = refusal(mine, env0, req) if len(fds) == 3 else "no standard streams"
        if why is not None:
            print(f"alignloop fork server: {req.get('module')} runs on its own: {why}",
                  file=sys.stderr, flush=True)
            conn.sendall((json.dumps({"refused": why}) + "\n").encode())
            raise ConnectionError(why)
    except (OSError, ValueError, struct.error):
        conn.close()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        _child(conn, req, fds, [listener, *children.values()], lifeline)   # never returns
    print(f"alignloop fork server: {' '.join([req['module'], *req['argv']])} forked as pid "
          f"{pid}", file=sys.stderr, flush=True)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):         # a program gone already: its child sees EOF
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    return pid


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        done = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else \
            {"status": os.waitstatus_to_exitcode(status)}
        with contextlib.suppress(OSError):
            conn.sendall((json.dumps(done) + "\n").encode())
        conn.close()


def _preload() -> None:
    """Import every stage module (and so torch, transformers, peft and the rest), then leave
    the objects alive out of the cyclic GC's reach, as a stage program does."""
    import gc
    import importlib
    import pkgutil
    stages = importlib.import_module(MODULE_PREFIX.rstrip("."))   # by name: the stages import
    for info in pkgutil.iter_modules(stages.__path__):           # this module, not it them
        with contextlib.suppress(Exception):
            importlib.import_module(MODULE_PREFIX + info.name)
    gc.collect()
    gc.freeze()


def _child(conn: socket.socket, req: dict[str, Any], fds: list[int],
           inherited: list[socket.socket], lifeline: int) -> None:
    """The forked child: become the stage program `req` describes, run it, exit as it would."""
    code = 1
    try:
        for sig in FORWARDED + (signal.SIGCHLD,):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)   # Python's own, as at start
        _die_with_server()
        for s in inherited:
            s.close()
        os.close(lifeline)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        fds.clear()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[:] = req["path"]
        sys.argv = [req["module"], *req["argv"]]
        sys.orig_argv = req["orig_argv"]
        for name in [m for m in sys.modules if m == "tasks" or m.startswith("tasks.")]:
            del sys.modules[name]
        import importlib
        importlib.invalidate_caches()
        _std_streams()
        _watch(conn)
        code = _run(req["module"])
    finally:
        os._exit(code)


def _die_with_server() -> None:
    """The kernel ends the child (SIGTERM) when the server does."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _std_streams() -> None:
    """stdin, stdout and stderr on the program's descriptors, made as the interpreter makes
    them (line-buffered on a terminal; PYTHONUNBUFFERED honoured)."""
    import io
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    streams = []
    for fd, old in enumerate((sys.__stdin__, sys.__stdout__, sys.__stderr__)):
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        streams.append(io.TextIOWrapper(
            buffered, encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            line_buffering=os.isatty(fd) or fd == 2, write_through=unbuffered or fd == 2))
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def _watch(conn: socket.socket) -> None:
    """End the child at once when its stand-in program is gone (the socket reaches EOF)."""
    import threading

    def watch() -> None:
        with contextlib.suppress(OSError):
            while conn.recv(1024):
                pass
        os._exit(137)
    threading.Thread(target=watch, name="forkserver-client", daemon=True).start()


def _run(module: str) -> int:
    """`python -m module`, with what the interpreter does at exit; the exit status."""
    import atexit
    import runpy
    import threading
    import traceback
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:                    # noqa: BLE001 (what the interpreter does)
        traceback.print_exc()
        code = 1
    # the interpreter's exit: wait for the program's threads, run its atexit functions
    with contextlib.suppress(Exception):
        threading._shutdown()                # type: ignore[attr-defined]  # noqa: SLF001
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()              # noqa: SLF001
    _flush()
    return code


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# -- the CLI's side ------------------------------------------------------------------------------

class Server:
    """This run's fork server: `start()` returns at once; stopped at exit (and it ends by
    itself when the process that started it is gone)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="alignloop-fork-"))
        self.path = str(self.dir / "socket")
        self.proc: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None

    def start(self, env: dict[str, str], log: Path | None = None) -> Server:
        import atexit
        code = str(Path(__file__).resolve().parent.parent.parent)   # where `tasks` is
        # the lifeline: this process holds the write end (not inherited by what it starts)
        lifeline, self._lifeline = os.pipe()
        try:
            with open(log or os.devnull, "ab") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[2]); from "
                     "tasks.runtime.forkserver import serve; "
                     "serve(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]))",
                     self.path, code, str(os.getpid()), str(lifeline)], env=env, cwd=self.dir,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    pass_fds=(lifeline,),
                    # a session of its own: a signal to the CLI's process group reaches the
                    # stage programs, which pass it on to their children
                    start_new_session=True)
        finally:
            os.close(lifeline)
        atexit.register(self.stop)
        # listening within a fraction of a second (its imports come after): a program started
        # before would run on its own
        deadline = time.monotonic() + 10
        while not os.path.exists(self.path) and self.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)            # the server exits at once
            self._lifeline = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        for leftover in (self.path, self.path + ".tmp"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        with contextlib.suppress(OSError):
            self.dir.rmdir()


_ENABLED: list[Path | None] = []       # set by `enable`: this process may start a server
_STARTED: list[Server] = []


def enable(log: Path | None = None) -> None:
    """Let `ensure` start a fork server in this process (the CLI of a run or a tick), its
    errors to `log`. Not called, `ensure` does nothing: a test or a library that runs stages
    in its own process starts no server."""
    _ENABLED[:] = [log]


def ensure() -> None:
    """Start this process's fork server when the first stage program is about to start (a run
    whose stages are all cached starts none), unless ALIGNLOOP_FORKSERVER is set already (to
    "0", or to a server running). Stage programs started after this find it in the
    environment. The server runs with the environment stage processes get
    (tasks/core/heap.py)."""
    if not _ENABLED or _STARTED or os.environ.get(ENV) or not hasattr(os, "fork"):
        return
    from tasks.core import heap
    server = Server().start({**os.environ, **heap.stage_environment()}, _ENABLED[0])
    _STARTED.append(server)
    os.environ[ENV] = server.path
