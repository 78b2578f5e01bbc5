"""A copied or moved workspace is a new, independent one: its MLflow store, DVC remote and
registry follow it, and the original is never written (flows/relocate.py)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli, snapshot


def _store(root: Path) -> str:
    """A workspace-like MLflow store made by MLflow itself, in a fresh process: an experiment
    whose artifacts live under the workspace, a run with a workspace tag and a dataset input
    from the workspace's remote, a model version whose source is a workspace directory."""
    code = f"""
import mlflow
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.http_dataset_source import HTTPDatasetSource
from pathlib import Path
root = Path({str(root)!r}); state = root / ".alignloop"; state.mkdir(parents=True)
mlflow.set_tracking_uri(f"sqlite:///{{state / 'mlflow.db'}}")
c = mlflow.MlflowClient()
exp = c.create_experiment("alignloop", artifact_location=(state / "mlflow-artifacts").as_uri())
with mlflow.start_run(experiment_id=exp) as run:
    mlflow.set_tag("alignloop.workspace", str(root))
    mlflow.set_tag("elsewhere", f"/mnt{{root}}/models")       # another path that contains it
    src = (state / "dvc-remote" / "files" / "md5" / "ab" / "cdef").as_uri()
    mlflow.log_input(MetaDataset(source=HTTPDatasetSource(src), name="data/x.jsonl",
                                 digest="abcdef"))
    mlflow.log_text("hello", "report/index.html")
c.create_registered_model("alignloop-policy")
mv = c.create_model_version("alignloop-policy", source=str(root / "models" / "iter_1" / "policy"),
                            run_id=run.info.run_id, tags={{"workspace": str(root)}})
print(run.info.run_id)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def _read(root: Path, run_id: str) -> dict[str, object]:
    code = f"""
import json, mlflow
mlflow.set_tracking_uri("sqlite:///{root / '.alignloop' / 'mlflow.db'}")
c = mlflow.MlflowClient()
run = c.get_run({run_id!r}); mv = c.get_model_version("alignloop-policy", "1")
print(json.dumps({{"location": c.get_experiment_by_name("alignloop").artifact_location,
    "artifact_uri": run.info.artifact_uri, "tag": run.data.tags["alignloop.workspace"],
    "elsewhere": run.data.tags["elsewhere"],
    "source": mv.source, "mv_tag": mv.tags["workspace"],
    "dataset": json.loads(run.inputs.dataset_inputs[0].dataset.source)["url"],
    "report": mlflow.artifacts.load_text(run.info.artifact_uri + "/report/index.html")}}))
"""
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, check=True).stdout)


def test_a_copied_store_names_the_copy_and_the_original_is_untouched(tmp_path: Path) -> None:
    from flows import relocate
    a, b = tmp_path / "team" / "W", tmp_path / "mine" / "W2"
    run_id = _store(a)
    shutil.copytree(a, b)
    before = hashlib.md5((a / ".alignloop" / "mlflow.db").read_bytes()).hexdigest()
    assert relocate.recorded_root(b / ".alignloop" / "mlflow.db") == a
    assert relocate.follow(b / ".alignloop" / "mlflow.db", b) >= 6
    got = _read(b, run_id)
    assert got == {"location": (b / ".alignloop" / "mlflow-artifacts").as_uri(),
                   "artifact_uri": f"{(b / '.alignloop' / 'mlflow-artifacts').as_uri()}/"
                                   f"{run_id}/artifacts",
                   "tag": str(b), "source": str(b / "models" / "iter_1" / "policy"),
                   "elsewhere": f"/mnt{a}/models",                  # not the workspace's
                   "mv_tag": str(b),
                   "dataset": (b / ".alignloop" / "dvc-remote" / "files" / "md5" / "ab" /
                               "cdef").as_uri(),
                   "report": "hello"}
    assert hashlib.md5((a / ".alignloop" / "mlflow.db").read_bytes()).hexdigest() == before
    assert _read(a, run_id)["source"] == str(a / "models" / "iter_1" / "policy")
    assert relocate.follow(b / ".alignloop" / "mlflow.db", b) == 0       # once
    assert relocate.recorded_root(tmp_path / "none.db") is None


@pytest.mark.slow      # a third tiny iteration in the copy
def test_a_copy_runs_loads_and_audits_on_its_own_with_the_original_unreadable(
        tiny_run: dict, tmp_path: Path) -> None:
    """cp -a of a finished workspace, the original moved out of reach: the copy runs a third
    iteration (a tick), loads its champion through MLflow and has it answer a chat request,
    `lineage --verify` passes against
    its own stores; the original's files are byte for byte as before."""
    src = tmp_path / "W"
    shutil.copytree(tiny_run["ws"], src, symlinks=True)     # the original, for this test
    copy = tmp_path / "W2"
    subprocess.run(["cp", "-a", str(src), str(copy)], check=True)
    before = snapshot(src)
    db_before = hashlib.md5((src / ".alignloop" / "mlflow.db").read_bytes()).hexdigest()
    away = tmp_path / "out-of-reach"          # (chmod 000 stops no one running as root)
    src.rename(away)
    try:
        out = run_cli("tick", "--workspace", str(copy))
        assert "tick: ran iteration 3" in out.stdout, out.stdout
        verify = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace",
                         str(copy), "--verify")
        assert "verify: ok" in verify.stdout and f"{src}/" not in verify.stdout
        code = ("import mlflow; p = mlflow.transformers.load_model("
                "'models:/alignloop-policy@champion'); print(p.task); "
                "c = mlflow.pyfunc.load_model('models:/alignloop-policy@champion'); "
                "r = c.predict({'messages': [{'role': 'user', 'content': 'Review Heat.'}], "
                "'max_tokens': 8}); print(r[0]['choices'][0]['message']['role'])")
        env = {**os.environ, "MLFLOW_TRACKING_URI":
               f"sqlite:///{copy / '.alignloop' / 'mlflow.db'}"}
        loaded = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                                capture_output=True, text=True)
        assert loaded.returncode == 0, loaded.stderr[-2000:]
        assert loaded.stdout.split() == ["text-generation", "assistant"]  # loads, answers chat
    finally:
        away.rename(src)
    assert snapshot(src) == before
    assert hashlib.md5((src / ".alignloop" / "mlflow.db").read_bytes()).hexdigest() == db_before
    with sqlite3.connect(copy / ".alignloop" / "mlflow.db") as con:
        rows = [r for t, c in _columns(con) for r in con.execute(
            f'SELECT "{c}" FROM "{t}" WHERE instr("{c}", ?) > 0', (f"{src}/",))]
    assert rows == []                     # nothing in the copy's store names the original


def _columns(con: sqlite3.Connection) -> list[tuple[str, str]]:
    from flows.relocate import text_columns
    return text_columns(con)


@pytest.mark.slow
def test_a_teams_mlflow_server_takes_the_stores_role(tmp_path: Path) -> None:
    """`MLFLOW_TRACKING_URI` names a real `mlflow server` (SQLite behind it, artifacts through
    its proxy): the run records there and not in the workspace, the champion is registered there
    with the workspace-relative lineage and a pointer to its DVC bytes as source (the server
    accepts only sources inside the run's artifacts; no weights uploaded), the report reaches
    the proxy, and `lineage --verify` and `serve`'s alias check answer from the server."""
    import socket
    import time
    import urllib.request

    from conftest import TINY
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    team = tmp_path / "team"
    team.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
         f"sqlite:///{team / 'mlflow.db'}", "--artifacts-destination", str(team / "artifacts"),
         "--serve-artifacts", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                   f"{os.environ.get('PATH', '')}"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no mlflow server"
                time.sleep(1)
        env = {"MLFLOW_TRACKING_URI": url}
        ws = tmp_path / "ws"
        run_cli("run", "--params", str(TINY), "--workspace", str(ws), env=env)
        assert not (ws / ".alignloop" / "mlflow.db").exists()       # the team's store, not ours
        code = f"""
import json, mlflow
c = mlflow.MlflowClient({url!r})
mv = c.get_model_version_by_alias("alignloop-policy", "champion")
run = c.get_run(mv.run_id)
pointer = mlflow.artifacts.download_artifacts(mv.source + "/dvc-pointer.json",
                                             tracking_uri={url!r})
print(json.dumps({{"version": mv.version, "model_path": mv.tags["model_path"],
                   "md5": mv.tags["model_md5"], "source": mv.source, "run_id": mv.run_id,
                   "pointer": json.load(open(pointer)), "artifact_uri": run.info.artifact_uri,
                   "report": [f.path for f in c.list_artifacts(mv.run_id, "report")]}}))
"""
        got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                        text=True, check=True).stdout)
        assert got["model_path"] == "models/iter_2/policy"
        assert got["source"] == f"runs:/{got['run_id']}/models/iter_2/policy"
        assert got["pointer"]["model_md5"] == got["md5"]
        assert got["pointer"]["restore"].endswith("dvc pull models/iter_2/policy")
        assert not list((team / "artifacts").rglob("*.safetensors"))  # weights stay in DVC
        assert got["artifact_uri"].startswith("mlflow-artifacts:/")     # through the proxy
        assert "report/report.html" in got["report"]
        assert list((team / "artifacts").rglob("report.html"))
        out = run_cli("lineage", "models:/alignloop-policy@champion", "--workspace", str(ws),
                      "--verify", env=env)
        assert out.stdout.startswith(f"alignloop-policy v{got['version']} ['champion']")
        assert "verify: ok" in out.stdout
        bad = run_cli("serve", "models:/alignloop-policy@nope", "--workspace", str(ws), env=env,
                      check=False)
        assert bad.returncode == 2 and "has no alias nope (aliases: champion -> v" in bad.stderr
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
