"""`alignloop`: run the loop, show each stage's state, report per-iteration metrics."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows import cli_models, cli_release, cli_workspace, import_pairs, shipped, signals, targets
from flows import params_file as params_text
from flows import workspace as wsmod
from flows.cli_views import cmd_dag, cmd_lineage, cmd_params, cmd_report, cmd_status, print_report
from flows.run import RunFailed, quiet_prefect
from flows.targets import SETUP_STAGES

if TYPE_CHECKING:
    from flows.record import IterationRecord
from tasks.core import layout
from tasks.core.errors import InputError

DEFAULT_WORKSPACE = "workspace"


def cmd_run(args: argparse.Namespace) -> int:
    params = Path(args.params).resolve() if args.params else None
    if args.profile:
        params = shipped.profile(args.profile)
    root = Path(args.workspace).resolve()
    if params is None and not (root / layout.PARAMS_FILE).is_file():
        params = shipped.default_profile()
    params_text.validate(root, params)         # fails before the workspace is touched
    if params is None and (notice := cli_workspace.upgrade_notice(root)):
        print(notice)                          # the workspace keeps its own pipeline
    return _run_and_print(root, params, force=[])


def cmd_rerun(args: argparse.Namespace) -> int:
    from flows import dag
    ws = wsmod.existing_workspace(args.workspace)
    params_text.validate(ws.root, None)
    names = [r.name for r in dag.ordered_stages(ws.root)]
    if args.stage not in names:
        raise InputError(f"{args.stage}: no such stage instance (have: {', '.join(names)})")
    force = [args.stage] + (dag.downstream(ws.root, args.stage) if args.downstream else [])
    print(f"rerun: {', '.join(force)}; every other stage as DVC decides")
    return _run_and_print(ws.root, None, force=force)


def _run_and_print(root: Path, params_file: Path | None, force: list[str]) -> int:
    from flows.run import run_loop
    records, seconds = run_loop(root, params_file, force)
    _print_summary(root, records, seconds)
    return 0


def _print_summary(root: Path, records: list[IterationRecord], seconds: float) -> None:
    stages = [s for rec in records for s in rec.stages]
    ran = [s.name for s in stages if s.outcome != "cached"]
    print(f"done in {seconds:.1f} s: {len(ran)} of {len(stages)} stages "
          f"{'ran or were restored' if ran else 'ran; everything was cached'}")
    for rec in records:
        if rec.policy_version:
            print(f"  iteration {rec.iteration}: policy v{rec.policy_version}, "
                  f"reward model v{rec.reward_model_version}, commit {rec.git_commit[:10]}")
    print_report(root)
    _print_targets(root, [s.name for s in stages], {s.name for s in stages if s.outcome == "ran"})


def _print_targets(root: Path, stages: list[str], ran: set[str]) -> None:
    """The last iteration against the profile's efficacy bar (`targets:`), met or missed. The
    loop's minutes are each stage's recorded time for the outputs it holds (flows/targets.py),
    so a resumed or partly cached run still counts what the whole loop cost."""
    from flows.dag import read_lock
    result = targets.assess(root, stages, read_lock(root))
    if result is None:
        return
    print("\n".join(targets.lines(result)))
    minutes = result["minutes"]
    if minutes and not result["untimed"]:
        loop = [n for n in stages if n.split("@")[0] not in SETUP_STAGES]
        each = ", ".join(f"{k}: {minutes[k]:.2f}" for k in sorted(minutes, key=int))
        print(f"  (minutes per iteration {each}; all {sum(minutes.values()):.2f}: each loop "
              f"stage's time when it computed its outputs; this run computed "
              f"{len([n for n in loop if n in ran])} of {len(loop)})")


def cmd_server(args: argparse.Namespace) -> int:
    from flows import server
    ws = wsmod.existing_workspace(args.workspace)
    if args.action == "start":
        info = server.start(ws, port=args.port)
        print(f"prefect server up: {info['ui_url']} (API {info['api_url']}, pid {info['pid']}); "
              f"export PREFECT_API_URL={info['api_url']}")
    elif args.action == "stop":
        print("prefect server stopped" if server.stop(ws) else "no prefect server running")
    else:
        info = server.status(ws)
        print(json.dumps(info) if info else "no prefect server running")
        return 0 if info else 1
    return 0


def cmd_judge_server(args: argparse.Namespace) -> int:
    """A local OpenAI-compatible judge (transformers serve) for `judge.kind: http`."""
    from flows import judge_server
    ws = wsmod.Workspace(Path(args.workspace).resolve())
    if args.action == "start":
        try:
            info = judge_server.start(ws, Path(args.model) if args.model else None,
                                      port=args.port)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"judge server up: {info['url']} serving {info['model']} (pid {info['pid']}, log "
              f"{info['log']}); export ALIGNLOOP_JUDGE_URL={info['url']}")
    elif args.action == "stop":
        print("judge server stopped" if judge_server.stop(ws) else "no judge server running")
    else:
        info = judge_server.status(ws)
        print(json.dumps(info) if info else "no judge server running")
        return 0 if info and info["healthy"] else 1
    return 0


def _api_url(ws: wsmod.Workspace) -> str:
    """The team's PREFECT_API_URL if set, else this workspace's own standalone server."""
    from flows import server
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        url = server.start(ws)["api_url"]
        os.environ["PREFECT_API_URL"] = url
    return url


def _pool_server(ws: wsmod.Workspace) -> str:
    """The Prefect server a work pool lives on: PREFECT_API_URL, else this workspace's running
    standalone server. None is started here: a worker elsewhere must be told its URL."""
    from flows import server
    url = os.environ.get("PREFECT_API_URL") or (server.status(ws) or {}).get("api_url")
    if not url:
        raise InputError("a work pool needs a Prefect server (Prefect's temporary one cannot "
                         "hand runs to a worker): run `alignloop server start` or export "
                         "PREFECT_API_URL")
    if not server.healthy(url):
        raise InputError(f"no Prefect server answers at {url} (PREFECT_API_URL)")
    os.environ["PREFECT_API_URL"] = url
    return url


def _deploy_to_pool(ws: wsmod.Workspace, args: argparse.Namespace, when: str) -> int:
    url = _pool_server(ws)
    quiet_prefect()
    import httpx
    from prefect.exceptions import PrefectException

    from flows.schedule import deploy_to_pool, deployment_name
    try:
        kind = deploy_to_pool(ws, args.work_pool, args.cron, args.overlap,
                              interval=args.interval, max_runs_per_day=args.max_runs_per_day)
    except (PrefectException, httpx.HTTPError, ValueError) as e:
        raise InputError(f"deploying to work pool {args.work_pool} failed: "
                         f"{str(e).strip().splitlines()[0]}") from None
    print(f"deployed alignloop-tick/{deployment_name(ws)} to work pool {args.work_pool} "
          f"({kind}) on {when} against {url} (overlapping ticks: {args.overlap})")
    print(f"start a worker where {ws.root} and {shipped.code_root()} exist at these paths:\n"
          f"  PREFECT_API_URL={url} prefect worker start --pool {args.work_pool}")
    return 0


def _budget(max_runs: int) -> None:
    if max_runs < 0:
        raise InputError(f"--max-runs-per-day: expected 0 (no limit) or more, got {max_runs}")


def cmd_schedule(args: argparse.Namespace) -> int:
    ws = wsmod.existing_workspace(args.workspace)
    _budget(args.max_runs_per_day)
    when = f"cron '{args.cron}'" if args.cron else f"every {args.interval:g} s"
    if args.work_pool:
        return _deploy_to_pool(ws, args, when)
    url = _api_url(ws)
    quiet_prefect()
    from flows.schedule import serve
    print(f"serving alignloop-{ws.root.name} on {when} against {url} "
          f"(overlapping ticks: {args.overlap}); Ctrl-C stops serving")
    serve(ws, args.cron, args.overlap, interval=args.interval,
          max_runs_per_day=args.max_runs_per_day)
    return 0


def cmd_tick(args: argparse.Namespace) -> int:
    ws = wsmod.existing_workspace(args.workspace)
    _budget(args.max_runs_per_day)
    if args.server:
        _api_url(ws)
    quiet_prefect()
    from flows.schedule import refuse_if_over_budget, skip_if_busy, tick
    if skip_if_busy(ws, args.overlap) or \
            refuse_if_over_budget(ws, args.max_runs_per_day):   # before a flow run starts
        return 0
    from flows import pipeline  # noqa: F401 (DVC's and MLflow's loggers exist once imported)
    from flows.run import failure, run_logs
    logs = run_logs(ws)                       # Prefect's, DVC's output and a stage's error
    quiet_prefect(logs["log"])                # line go to the log: the terminal gets one
    from tasks.runtime import forkserver
    forkserver.enable(logs["log"])            # stage programs start from its imports
    try:
        result = tick(str(ws.root), overlap=args.overlap,
                      max_runs_per_day=args.max_runs_per_day)
    except BaseException as e:                # the tick restored the workspace: one line
        raise failure(e, logs, restored=True) from e
    print(f"tick: {result['outcome']}" + (f" iteration {result['iteration']}"
                                          if "iteration" in result else ""))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`mlflow models serve` of a registered version's exact bytes (found by its `model_md5` in
    the DVC cache or a local remote, flows/restore.py), with this interpreter's environment
    (MLflow starts `uvicorn` by name: its bin directory goes first on PATH). A policy is a chat
    model: POST /invocations {"messages": [...], "max_tokens": N}."""
    from mlflow.tracking import MlflowClient

    from flows import lineage, restore
    ws = wsmod.existing_workspace(args.workspace)
    mv = lineage.resolve(MlflowClient(), args.model)       # one line for a bad name or alias
    try:
        model_dir = restore.materialise(ws.root, ws.state, mv.tags.get("model_path", "?"),
                                        mv.tags.get("model_md5", ""))
    except restore.NotRestorable as e:
        raise InputError(f"{args.model}: {mv.name} v{mv.version}: {e}") from None
    print(f"serving {mv.name} v{mv.version} ({args.model}, md5 {mv.tags['model_md5']}) on "
          f"http://{args.host}:{args.port}/invocations", flush=True)
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(model_dir),
           "--env-manager", "local", "-h", args.host, "-p", str(args.port)]
    if (Path(model_dir) / layout.ADAPTER_BASE).is_file():   # a LoRA adapter: MLflow finds
        os.chdir(ws.root)                  # its base by the workspace-relative path it names
    os.execvpe(cmd[0], cmd, {**os.environ, **wsmod.environment(ws)})
    return 0                                               # not reached


EXAMPLES = """examples:
  alignloop run                                # the default profile in ./workspace
  alignloop run --params params/tiny.yaml --workspace /tmp/w   # a 2-minute demo
  alignloop status --workspace /tmp/w          # what would rerun, and why (old -> new)
  alignloop params update.dpo --params params/default.yaml   # what each key means, its value
  alignloop rerun train_rm@2 --downstream      # recompute one stage and what follows
  alignloop import hh.jsonl --workspace /tmp/w # your own preference pairs (TRL formats)
  alignloop lineage models:/alignloop-policy@champion --verify
  alignloop serve models:/alignloop-policy@champion --port 5000   # chat over HTTP
  alignloop server start && alignloop schedule --cron "0 3 * * 1"
  alignloop schedule --work-pool local --cron "0 3 * * 1"   # for `prefect worker start`
  alignloop judge-server start --model DIR     # an OpenAI-compatible judge on loopback
  alignloop gc --keep-last 2 --dry-run         # what archiving old weights would free
  alignloop export models:/alignloop-policy@production out/   # a standalone HF directory
  alignloop deploy --canary && alignloop promote --feedback traffic.jsonl   # a release
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="alignloop", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"alignloop {shipped.version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    dg = sub.add_parser("dag", help="the declared DAG, one line per iteration (or --mermaid, "
                                    "--dot for a picture)")
    dg.add_argument("--workspace", default=DEFAULT_WORKSPACE)
    fmt = dg.add_mutually_exclusive_group()
    fmt.add_argument("--mermaid", action="store_true")
    fmt.add_argument("--dot", action="store_true")
    dg.set_defaults(func=cmd_dag)
    pa = sub.add_parser("params", help="every params key (or those under KEY): its value in a "
                                       "profile, type, default and meaning (from tasks/schemas/)")
    pa.add_argument("key", nargs="?", help="a key or a section, e.g. update.dpo.beta or judge")
    pa.add_argument("--params", help="a profile whose values to show (its base merged)")
    pa.set_defaults(func=cmd_params)
    run = sub.add_parser("run", help="run the loop (creates the workspace if needed)")
    which = run.add_mutually_exclusive_group()
    which.add_argument("--params", help="a params file (default: the workspace's params.yaml, "
                                        "or the `default` profile for a new workspace)")
    which.add_argument("--profile", help="a shipped profile by name (`alignloop profiles`)")
    run.add_argument("--workspace", default=DEFAULT_WORKSPACE, help="workspace directory")
    run.set_defaults(func=cmd_run)
    for name, func, text in (("status", cmd_status, "state of every stage instance, from DVC"),
                             ("report", cmd_report, "per-iteration metrics")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--workspace", default=DEFAULT_WORKSPACE, help="workspace directory")
        out = p.add_mutually_exclusive_group()
        out.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "report":
            out.add_argument("--html", action="store_true",
                             help="the HTML report with plots and sample outputs "
                                  "(<workspace>/report/, the `report` stage's output, "
                                  "rebuilt when DVC finds it stale): print its path")
        p.set_defaults(func=func)
    rerun = sub.add_parser("rerun", help="recompute one stage instance (and, with "
                                         "--downstream, what depends on it)")
    rerun.add_argument("stage", help="stage instance, e.g. train_rm@2 or prompts")
    rerun.add_argument("--downstream", action="store_true")
    rerun.add_argument("--workspace", default=DEFAULT_WORKSPACE)
    rerun.set_defaults(func=cmd_rerun)
    lin = sub.add_parser("lineage", help="provenance of a registered model version")
    lin.add_argument("model", help="models:/alignloop-policy@production or models:/NAME/VERSION")
    lin.add_argument("--workspace", default=DEFAULT_WORKSPACE)
    lin.add_argument("--json", action="store_true")
    lin.add_argument("--verify", action="store_true",
                     help="re-hash every artifact from the DVC cache and remote")
    lin.add_argument("--skip-remote", action="store_true",
                     help="with --verify: the cache and git only (the remote is not checked)")
    lin.add_argument("--book-source", action="append", metavar="PATH",
                     help="a clone or copy of an imported book's source workspace, read when "
                          "the path the book recorded is gone (repeatable)")
    lin.set_defaults(func=cmd_lineage)
    srv_m = sub.add_parser("serve", help="serve a registered version over HTTP (MLflow's "
                                          "scoring server; a policy answers chat requests)")
    srv_m.add_argument("model", nargs="?", default="models:/alignloop-policy@champion")
    srv_m.add_argument("--port", type=int, default=5000)
    srv_m.add_argument("--host", default="127.0.0.1")
    srv_m.add_argument("--workspace", default=DEFAULT_WORKSPACE)
    srv_m.set_defaults(func=cmd_serve)
    srv = sub.add_parser("server", help="this workspace's standalone Prefect server (loopback)")
    srv.add_argument("action", choices=["start", "stop", "status"])
    srv.add_argument("--port", type=int, default=4200)
    srv.add_argument("--workspace", default=DEFAULT_WORKSPACE)
    srv.set_defaults(func=cmd_server)
    js = sub.add_parser("judge-server", help="a local OpenAI-compatible judge server "
                                             "(transformers serve, loopback) for judge.kind: http")
    js.add_argument("action", choices=["start", "stop", "status"])
    js.add_argument("--model", help="a saved transformers model directory (default: the "
                                    "workspace's initial policy, models/iter_0/policy)")
    js.add_argument("--port", type=int, default=8000)
    js.add_argument("--workspace", default=DEFAULT_WORKSPACE,
                    help="where its pid file and log go (<workspace>/.alignloop/)")
    js.set_defaults(func=cmd_judge_server)
    sch = sub.add_parser("schedule", help="serve recurring iterations on a cron schedule (or "
                                          "deploy them to a work pool)")
    when = sch.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help='e.g. "0 3 * * 1" (Mondays 03:00)')
    when.add_argument("--interval", type=float, metavar="SECONDS", help="every N seconds")
    sch.add_argument("--overlap", choices=["wait", "skip"], default="skip",
                     help="an overlapping tick waits for the running one, or is skipped")
    sch.add_argument("--max-runs-per-day", type=int, default=0, metavar="N",
                     help="refuse a fire when N ticks ran an iteration in the last 24 h "
                          "(state Refused, logged in .alignloop/ticks.jsonl; 0 = no limit)")
    sch.add_argument("--work-pool", metavar="NAME",
                     help="deploy to this Prefect work pool (created as type process if "
                          "missing) for a worker to run, instead of serving here")
    sch.add_argument("--workspace", default=DEFAULT_WORKSPACE)
    sch.set_defaults(func=cmd_schedule)
    tk = sub.add_parser("tick", help="run the next iteration now, as a scheduled tick would")
    tk.add_argument("--overlap", choices=["wait", "skip"], default="wait")
    tk.add_argument("--max-runs-per-day", type=int, default=0, metavar="N",
                    help="refused (exit 0) when N ticks ran an iteration in the last 24 h")
    tk.add_argument("--server", action="store_true",
                    help="against the standalone server (started if needed)")
    tk.add_argument("--workspace", default=DEFAULT_WORKSPACE)
    tk.set_defaults(func=cmd_tick)
    import_pairs.add_parser(sub, DEFAULT_WORKSPACE)
    cli_workspace.add_parsers(sub, DEFAULT_WORKSPACE)
    cli_models.add_parsers(sub, DEFAULT_WORKSPACE)
    cli_release.add_parsers(sub, DEFAULT_WORKSPACE)
    return ap


def main(argv: list[str] | None = None) -> None:
    program = argv is None                    # the program itself, not a caller in-process
    if program:
        # The ~425k objects Prefect, DVC and MLflow leave at import live as long as the
        # process: frozen, the cyclic GC passes of the command skip them (a cached rerun's
        # command 1.00 -> 0.88 s, median of 5 alternating), and so do those of the
        # interpreter's exit, which took 1.1 s of every command (exit 1.18 -> 0.06 s).
        # atexit and log handlers, module teardown and refcount-freed objects run as before.
        gc.freeze()
    args = build_parser().parse_args(argv)
    signals.install()
    try:
        code = args.func(args)
        sys.stdout.flush()                      # a closed pipe shows here, not at exit
    except (InputError, FileNotFoundError) as e:    # aliases' and lineage's errors too
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except RunFailed as e:                    # a run's one line (flows/run.py)
        print(f"error: {e}", file=sys.stderr)
        code = e.code
    except signals.Terminated as e:
        code = e.code if isinstance(e.code, int) else 1
    except BrokenPipeError:                    # `alignloop status | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no error at exit
        code = 0
    if signals.received() is not None and code == 0:
        code = 128 + int(signals.received() or 0)
    if program:
        gc.freeze()                           # and what the command made, for the exit
    raise SystemExit(code)


if __name__ == "__main__":
    main()
