"""`alignloop ARGS` with its wall time split: interpreter start, imports, the command itself.

Run as `python -X importtime -m benchmarks.timed_cli TIMINGS.json ARGS...` from the checkout
root (cached_rerun.py does); the first line below is the earliest point this module's code
runs, so (its wall clock - the parent's spawn time) is interpreter start-up, with `-m`'s own
share in it: runpy finding this module and importing the (docstring-only) `benchmarks`
package (~1 ms). After the module-level imports a marker goes to stderr: the top-level `-X
importtime` entries after it are the imports the command does lazily (cached_rerun.py sums
them). With `--profile OUT.prof` before ARGS the command runs under cProfile; with
`--prefect-heartbeats` (after it, before ARGS) Prefect's own flow-heartbeat loop runs instead
of flows/heartbeats.py's.
"""
import time

T_BOOT = time.time()

# after T_BOOT on purpose (E402): their import time is the command's, not the interpreter's
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

MARKER = "timed_cli: module-level imports done"


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    prof_path, prefect_heartbeats = None, False
    if args[:1] == ["--profile"]:
        prof_path, args = args[1], args[2:]
    if args[:1] == ["--prefect-heartbeats"]:
        prefect_heartbeats, args = True, args[1:]
    # what flows.cli sets before it imports Prefect, set before we import it here
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    from flows import cli, pipeline, registry, schedule  # noqa: F401  (the run's imports)
    if prefect_heartbeats:                 # Prefect's own loop (cached_rerun --heartbeat-ab)
        from flows import heartbeats
        heartbeats.uninstall()
    t_imports = time.time()
    print(MARKER, file=sys.stderr, flush=True)   # -X importtime lines after it: lazy imports
    code: object = 0
    profiler = None
    if prof_path:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    sys.argv = ["alignloop", *args]      # the program's own entry (cli.main(), as the
    try:                                   # console script calls it), not an in-process call
        cli.main()
    except SystemExit as e:
        code = e.code
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(prof_path)
    t_done = time.time()
    out.write_text(json.dumps({"boot": T_BOOT, "imports_done": t_imports, "command_done": t_done,
                               "code": code}))
    sys.stdout.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
