"""The CLI's commands that make a workspace from this installation or bring its pipeline up to
this installation's: `init`, `upgrade`, `profiles`.

A workspace keeps the pipeline it was made with (dvc.yaml, the stage sources under tasks/, the
shipped data under params/), committed in its own git history, until `alignloop upgrade` (or
`run --params`, which writes a profile and the pipeline with it) brings in the installed one.
An upgrade changes stage sources, so DVC reruns the stages that read them at the next run:
`alignloop status` names them, before the upgrade and after it.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

from flows import params_file as params_text
from flows import shipped
from flows import workspace as wsmod
from tasks.config.params import SAFE_LOADER
from tasks.core import layout
from tasks.core.errors import InputError


def cmd_profiles(args: argparse.Namespace) -> int:
    rows = shipped.profiles()
    width = max(len(p.name) for p in rows)
    for p in rows:
        base = f" (a diff of {p.base})" if p.base else ""
        print(f"{p.name:<{width}}  {p.description}{base}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    root = Path(args.directory).resolve()
    if (root / layout.PARAMS_FILE).exists():
        raise InputError(f"{root}: already a workspace (it has {layout.PARAMS_FILE}); run it "
                         f"with `alignloop run --workspace {args.directory}`")
    params = Path(args.params).resolve() if args.params else shipped.profile(args.profile)
    params_text.validate(root, params)         # fails before anything is created
    root.mkdir(parents=True, exist_ok=True)
    wsmod.apply_environment(wsmod.Workspace(root))
    ws, changed = wsmod.prepare(root, params)
    made = [".gitignore", ".dvcignore", ".dvc/config", ".dvc/.gitignore", layout.IMPORT_DIR,
            layout.AUDIT_LABELS, *changed]          # what init wrote; nothing else of DIR's
    wsmod.git(root, "add", "--", *made)
    what = f"profile {args.profile}" if not args.params else str(params.name)
    wsmod.git(root, "commit", "-q", "-m",
              f"alignloop init: {what} (alignloop {shipped.version()})")
    print(f"workspace {root}: {what}, {len(changed)} files from alignloop {shipped.version()}")
    print(f"edit {root / layout.PARAMS_FILE} if you like, then: "
          f"alignloop run --workspace {args.directory}")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    ws = wsmod.existing_workspace(args.workspace)
    with wsmod.workspace_lock(ws):
        changed = wsmod.sync_pipeline(ws.root)
        if not changed:
            print(f"{ws.root}: the pipeline is alignloop {shipped.version()}'s already")
            return 0
        paths = [c.removesuffix(" (removed)") for c in changed]   # nothing else of the user's
        wsmod.git(ws.root, "add", "-A", "--", *paths)
        wsmod.git(ws.root, "commit", "-q", "-m",
                  f"alignloop upgrade: the pipeline of alignloop {shipped.version()}\n\n"
                  + "\n".join(changed))
    print(f"{ws.root}: {len(changed)} pipeline files from alignloop {shipped.version()}:")
    for rel in changed:
        print(f"  {rel}")
    print("the stages that read them rerun at the next `alignloop run` "
          "(`alignloop status` lists them)")
    return 0


def upgrade_notice(root: Path) -> str | None:
    """One line when the workspace's pipeline differs from this installation's: how many
    files, and which stages read them (they rerun after `alignloop upgrade`)."""
    changed = wsmod.pipeline_changes(root)
    if not changed:
        return None
    stages = readers(root, [c.removesuffix(" (removed)") for c in changed])
    rerun = f"; stages that read them rerun: {', '.join(stages)}" if stages else ""
    return (f"pipeline: {len(changed)} files differ from the installed alignloop "
            f"{shipped.version()}'s (`alignloop upgrade` takes them{rerun})")


def readers(root: Path, paths: list[str]) -> list[str]:
    """The stages of the workspace's dvc.yaml (every iteration's, by name) that declare one of
    `paths` as a dependency (`${key}` read from its params.yaml); all of them for dvc.yaml."""
    stages = yaml.load((root / "dvc.yaml").read_text(), Loader=SAFE_LOADER)["stages"]
    params = yaml.load((root / layout.PARAMS_FILE).read_text(), Loader=SAFE_LOADER)
    wanted = set(paths)
    out = []
    for name, stage in stages.items():
        deps = {_interpolated(d, params) for d in stage.get("do", stage).get("deps", [])
                if isinstance(d, str)}
        if "dvc.yaml" in wanted or wanted & deps:
            out.append(name)
    return out


def _interpolated(dep: str, params: dict) -> str:
    """A dvc.yaml dep with its `${a.b}` params keys filled in (`${item...}` left as it is)."""
    def value(m: re.Match[str]) -> str:
        node: object = params
        for part in m[1].split("."):
            if not isinstance(node, dict) or part not in node:
                return m[0]
            node = node[part]
        return str(node)
    return re.sub(r"\$\{\s*([^}\s]+)\s*\}", value, dep)


def add_parsers(sub: argparse._SubParsersAction, default_workspace: str) -> None:
    init = sub.add_parser("init", help="make a workspace (git + DVC) from a shipped profile "
                                       "or a params file of your own")
    init.add_argument("directory", help="where (created if missing)")
    which = init.add_mutually_exclusive_group()
    which.add_argument("--profile", default="default",
                       help="a shipped profile (`alignloop profiles` lists them)")
    which.add_argument("--params", help="a params file of your own")
    init.set_defaults(func=cmd_init)
    pro = sub.add_parser("profiles", help="the profiles this installation ships")
    pro.set_defaults(func=cmd_profiles)
    up = sub.add_parser("upgrade", help="bring the workspace's pipeline (dvc.yaml, stage "
                                        "sources, shipped data) up to this installation's")
    up.add_argument("--workspace", default=default_workspace)
    up.set_defaults(func=cmd_upgrade)
