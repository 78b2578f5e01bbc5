"""A workspace: a git repository with DVC initialised that holds one alignment project's
pipeline, data, models and the Prefect and MLflow stores (under `.alignloop/`, git-ignored).

`prepare` creates it when needed and syncs the pipeline declaration into it: dvc.yaml, the
stage sources (tasks/), the versioned prompt files and the chosen params profile as
params.yaml. Files are rewritten only when their bytes differ, so DVC sees unchanged inputs
as unchanged. Params are validated before anything in the workspace is touched.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flows import shipped
from flows.params_file import profile_text, validate
from tasks.config.params import Params, load_params
from tasks.core import atomic, layout
from tasks.core.errors import InputError

STATE_DIR = ".alignloop"             # Prefect home, MLflow store, DVC remote, server pid/logs
REMOTE = "local"                     # the default DVC remote: <workspace>/.alignloop/dvc-remote
GITIGNORE = f"/{STATE_DIR}/\n__pycache__/\n"
# MLflow (before 3.18) writes this note into a model directory loaded through a models:/ URI;
# it is not an output, so DVC must not see the directory as changed
DVCIGNORE = ("registered_model_meta",)
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "200",
    "GIT_AUTHOR_NAME": os.environ.get("GIT_AUTHOR_NAME", "alignloop"),
    "GIT_AUTHOR_EMAIL": os.environ.get("GIT_AUTHOR_EMAIL", "alignloop@localhost"),
    "GIT_COMMITTER_NAME": os.environ.get("GIT_COMMITTER_NAME", "alignloop"),
    "GIT_COMMITTER_EMAIL": os.environ.get("GIT_COMMITTER_EMAIL", "alignloop@localhost"),
}


class Busy(RuntimeError):
    """Another iteration holds the workspace."""


@dataclass(frozen=True)
class Workspace:
    root: Path

    @property
    def state(self) -> Path:
        return self.root / STATE_DIR

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.state / 'mlflow.db'}"

    @property
    def prefect_home(self) -> Path:
        return self.state / "prefect"

    @property
    def dvc_remote(self) -> Path:
        return self.state / "dvc-remote"

    def params(self) -> Params:
        return load_params(self.root / layout.PARAMS_FILE)


def environment(ws: Workspace) -> dict[str, str]:
    """Variables every process of this workspace runs with: offline, quiet, stores in place.

    Values the user already set (a Prefect or MLflow server of the team's) win.
    """
    env = dict(QUIET_ENV)
    env["MLFLOW_TRACKING_URI"] = os.environ.get("MLFLOW_TRACKING_URI", ws.mlflow_uri)
    env["PREFECT_HOME"] = os.environ.get("PREFECT_HOME", str(ws.prefect_home))
    env["DVC_SITE_CACHE_DIR"] = os.environ.get("DVC_SITE_CACHE_DIR", str(ws.state / "dvc-site"))
    # stage commands run `python -m tasks.stages.X`: make that the interpreter running alignloop
    bindir, path = str(Path(sys.executable).parent), os.environ.get("PATH", "")
    env["PATH"] = path if path.split(os.pathsep)[0] == bindir else os.pathsep.join([bindir, path])
    return env


@contextlib.contextmanager
def workspace_lock(ws: Workspace, overlap: str = "wait") -> Iterator[None]:
    """Exclusive hold of the workspace (`.alignloop/iteration.lock`): `run`, `rerun`, ticks and
    `import` take it, so no two of them interleave. overlap "wait" blocks until it is free,
    "skip" raises Busy at once. Light to import: no Prefect, MLflow or DVC."""
    ws.state.mkdir(parents=True, exist_ok=True)
    with (ws.state / "iteration.lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (fcntl.LOCK_NB if overlap == "skip" else 0))
        except BlockingIOError:
            raise Busy(f"{ws.root}: another iteration is running") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def apply_environment(ws: Workspace) -> None:
    secure_state(ws)
    env = environment(ws)
    if env["MLFLOW_TRACKING_URI"] == ws.mlflow_uri:    # the workspace's own store, not a team's
        from flows import relocate
        relocate.follow(ws.state / "mlflow.db", ws.root)
    os.environ.update(env)


def secure_state(ws: Workspace) -> None:
    """The stores are the user's alone: `.alignloop/` is created 0700, and DVC's site cache
    inside it is created before DVC would make it world-writable (DVC creates a missing one
    0777 whatever the umask). The MLflow database is 0600 once it exists. Files the stages
    write (data, models, metrics) follow the user's umask."""
    if not ws.root.is_dir():
        return
    ws.state.mkdir(mode=0o700, exist_ok=True)
    site = Path(os.environ.get("DVC_SITE_CACHE_DIR", str(ws.state / "dvc-site")))
    if site.is_relative_to(ws.state):
        (site / "repo").mkdir(mode=0o700, parents=True, exist_ok=True)
    db = ws.state / "mlflow.db"
    if db.is_file() and db.stat().st_mode & 0o077:
        db.chmod(0o600)


def git(root: Path, *args: str, check: bool = True) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                         env={**os.environ, **{k: v for k, v in QUIET_ENV.items()
                                               if k.startswith("GIT_")}})
    if check and out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {root}: {out.stderr.strip()}")
    return out.stdout.strip()


def git_bytes(root: Path, *args: str) -> bytes | None:
    """Raw stdout of a git command (e.g. `show COMMIT:PATH`), or None when it fails."""
    out = subprocess.run(["git", *args], cwd=root, capture_output=True)
    return out.stdout if out.returncode == 0 else None


def _put(dst: Path, data: bytes) -> bool:
    """Write `data` to `dst` (atomically) unless it holds those bytes; True if written."""
    if _same(dst, data):
        return False
    atomic.write_bytes(dst, data)
    return True


def sync_declaration(root: Path, params_file: Path) -> list[str]:
    """Copy the installed pipeline into the workspace: dvc.yaml (rendered for its params), the
    stage sources (tasks/**/*.py), the versioned data under params/ and the profile as
    params.yaml; files already there with the same bytes are left alone."""
    if shipped.is_source_tree(root):
        return []
    changed = []
    if _put(root / layout.PARAMS_FILE, profile_text(params_file).encode()):
        changed.append(layout.PARAMS_FILE)
    return changed + sync_pipeline(root)


def sync_pipeline(root: Path) -> list[str]:
    """dvc.yaml (rendered for the workspace's params.yaml), the stage sources and the shipped
    data, from this installation into the workspace: what changed, relative to root."""
    changed = [rel for rel, data in _pipeline_files(root) if _put(root / rel, data)]
    for rel in sorted(shipped.sources_in(root) - shipped.sources()):
        (root / rel).unlink()
        changed.append(f"{rel} (removed)")
    return changed


def pipeline_changes(root: Path) -> list[str]:
    """The workspace's pipeline files that differ from this installation's (what
    `sync_pipeline` would write), without writing anything."""
    if shipped.is_source_tree(root) or not (root / layout.PARAMS_FILE).is_file():
        return []
    return [rel for rel, data in _pipeline_files(root) if not _same(root / rel, data)] + \
        [f"{rel} (removed)" for rel in sorted(shipped.sources_in(root) - shipped.sources())]


def _pipeline_files(root: Path) -> list[tuple[str, bytes]]:
    """(path in the workspace, bytes) of the installed pipeline: dvc.yaml rendered for the
    workspace's params, the stage sources, the shipped data."""
    sources = [(shipped.tasks_dir().parent / rel, rel) for rel in sorted(shipped.sources())]
    return [("dvc.yaml", _rendered(root, shipped.dvc_yaml()))] + \
        [(rel, src.read_bytes()) for src, rel in sources + shipped.data_files()]


def _same(path: Path, data: bytes) -> bool:
    return path.is_file() and path.read_bytes() == data


def _rendered(root: Path, template: Path) -> bytes:
    """The pipeline declaration for the workspace's params: dvc.yaml (the `template` file)
    with each `# if:` dep kept or commented out (tasks/config/conditions.py)."""
    from tasks.config import conditions
    template = template.read_text()
    return conditions.render(template, load_params(root / layout.PARAMS_FILE)).encode()


def render_declaration(root: Path) -> bool:
    """Render the workspace's own dvc.yaml again for its params.yaml (a run that keeps the
    workspace's declaration: params edited there by hand); True if it changed."""
    return _put(root / "dvc.yaml", _rendered(root, root / "dvc.yaml"))


def init(root: Path) -> bool:
    """Create git + DVC (local cache, local-directory remote) if missing; True if created."""
    root.mkdir(parents=True, exist_ok=True)
    ws = Workspace(root)
    created = False
    if not (root / ".git").exists():
        git(root, "init", "-q", "-b", "main")
        created = True
    if not (root / ".gitignore").exists():
        atomic.write_text(root / ".gitignore", GITIGNORE)
    if not (root / ".dvc").exists():
        import contextlib
        import io
        import logging

        from dvc.repo import Repo
        dvc_log = logging.getLogger("dvc")
        level, dvc_log.level = dvc_log.level, logging.WARNING
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # DVC's "commit to git" banner
                Repo.init(str(root))
        finally:
            dvc_log.setLevel(level)
        with contextlib.chdir(root), Repo(str(root)).config.edit() as conf:
            conf["core"]["analytics"] = False
            conf["core"]["autostage"] = False
            conf["core"]["remote"] = REMOTE
            # relative: DVC writes it relative to .dvc/ and resolves it against .dvc/, so a
            # copy or a clone of the workspace pushes into its own remote, not this one's
            conf["remote"][REMOTE] = {"url": str(ws.dvc_remote.relative_to(root))}
        created = True
    _relative_remote(root)
    _link_cache(root)
    ignore = root / ".dvcignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    missing = [x for x in DVCIGNORE if x not in lines]
    if missing:
        atomic.write_text(ignore, "\n".join(lines + missing) + "\n")
    ws.dvc_remote.mkdir(parents=True, exist_ok=True)
    (root / layout.IMPORT_DIR).mkdir(parents=True, exist_ok=True)
    labels = root / layout.AUDIT_LABELS          # the people's audited labels (git-tracked)
    if not labels.exists():
        atomic.write_text(labels, "")
    readme = root / layout.IMPORT_DIR / "README.txt"
    if not readme.exists():
        atomic.write_text(readme, "Put your own preference pairs here (JSONL or a saved HF "
                                  "datasets directory) and set offpolicy.source: import.\n")
    return created


def _link_cache(root: Path) -> None:
    """The workspace's outputs as hard links to the cache's one copy (read-only: DVC protects
    them), not a second copy of every model, where this machine's filesystem links: in
    `.dvc/config.local`, this machine's, which git does not carry, so a clone on a filesystem
    without links copies instead of failing. DVC relinks a fresh output only when `hardlink` is
    its first cache type (it cannot tell a reflink from a copy: `reflink,hardlink,copy` left
    repro's outputs as copies), and with `hardlink` alone it fails where links do not work: so
    it is set only where they do. Checked at every run (a link and an unlink), written only
    when it changes; a cache type a person set in .dvc/config is left alone."""
    import configparser
    import io
    import tempfile
    shared, path = configparser.ConfigParser(), root / ".dvc" / "config.local"
    shared.read(root / ".dvc" / "config")
    if shared.has_option("cache", "type"):
        return
    with tempfile.TemporaryDirectory(dir=root / ".dvc") as tmp:
        (Path(tmp) / "a").write_bytes(b"")
        try:
            os.link(Path(tmp) / "a", Path(tmp) / "b")
            links = True
        except OSError:
            links = False
    conf = configparser.ConfigParser()
    conf.read(path)
    if (conf.get("cache", "type", fallback=None) == "hardlink") == links:
        return
    if not conf.has_section("cache"):
        conf.add_section("cache")
    if links:
        conf.set("cache", "type", "hardlink")
    else:
        conf.remove_option("cache", "type")
    text = io.StringIO()
    conf.write(text)
    atomic.write_text(path, text.getvalue())


def _relative_remote(root: Path) -> None:
    """A workspace made before remotes were relative names its own default remote by absolute
    path (`<dir>/.alignloop/dvc-remote`): in a copy or a clone that path is the original's.
    Written relative again (to the copy's own remote), once; a remote a person set (another
    name, another place, a URL) is left alone."""
    import configparser
    path = root / ".dvc" / "config"
    conf = configparser.ConfigParser()
    conf.read(path)
    section = f"'remote \"{REMOTE}\"'"
    url = conf.get(section, "url", fallback="")
    default = Path(STATE_DIR) / "dvc-remote"
    if not (Path(url).is_absolute() and Path(url).parts[-2:] == default.parts):
        return
    text = path.read_text()
    atomic.write_text(path, text.replace(f"url = {url}\n", f"url = ../{default.as_posix()}\n"))


def prepare(root: Path, params_file: Path | None) -> tuple[Workspace, list[str]]:
    """Validate params, then init the workspace and sync the declaration into it."""
    root = root.resolve()
    if params_file is None and not (root / layout.PARAMS_FILE).is_file():
        raise FileNotFoundError(f"{root}: no params.yaml; pass --params FILE")
    validate(root, params_file)                    # fails before the workspace is touched
    init(root)
    if params_file is not None:
        changed = sync_declaration(root, params_file)
    else:
        changed = ["dvc.yaml"] if (root / "dvc.yaml").is_file() and \
            not shipped.is_source_tree(root) and render_declaration(root) else []
    return Workspace(root), changed


def existing_workspace(workspace: str) -> Workspace:
    """The workspace a command reads (its directory as given), its environment applied; one line
    when it is none."""
    root = Path(workspace).resolve()
    if not (root / "dvc.yaml").is_file():
        raise InputError(f"{root}: not an alignloop workspace (no dvc.yaml); run it first")
    ws = Workspace(root)
    apply_environment(ws)
    return ws
