"""The run's report: numbers, plots, the judge-gold divergence rule, escaping, and that the flow
builds it as the DVC stage `report`, logs it to MLflow and publishes it as a Prefect artifact."""
from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, copy_workspace, ran_stages, run_cli, set_params
from tasks.core import atomic, jsonl, layout
from tasks.evaluation import report, report_data

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _evaluate(judge: float, gold: float | None, **extra: float) -> dict[str, float]:
    m = {"eval/win_rate": judge, "eval/win_rate_ci_low": judge - 0.05,
         "eval/win_rate_ci_high": judge + 0.05, "eval/n": 200.0, "eval/tie_rate": 0.1,
         "eval/invalid_rate": 0.0, "eval/rm_win_rate": 0.52, "eval/rm_win_rate_ci_low": 0.45,
         "eval/rm_win_rate_ci_high": 0.59, "eval/kl": 2.5, "eval/length": 30.0,
         "eval/ref_length": 31.0, "eval/length_ratio": 0.97, "eval/hacking_flag": 0.0,
         "eval/flag_length_drift": 0.0, "eval/flag_rm_disagreement": 0.0}
    if gold is not None:
        m.update({"eval/gold_win_rate": gold, "eval/gold_win_rate_ci_low": gold - 0.06,
                  "eval/gold_win_rate_ci_high": gold + 0.06, "eval/on_topic_rate": 0.9,
                  "eval/ref_on_topic_rate": 0.85, "eval/fluency_nll": 2.71,
                  "eval/ref_fluency_nll": 2.64, "eval/review_rate": 0.88,
                  "eval/ref_review_rate": 0.9})
    m.update(extra)
    return m


def _sample(i: int, policy: str = "") -> dict[str, object]:
    return {"prompt_id": f"p{i}", "prompt": [{"role": "user", "content": f"Review movie {i}"}],
            "policy": policy or f"policy text {i}", "reference": f"reference text {i}",
            "judge_verdict": "A", "gold_verdict": "B", "rm_policy": 0.25, "rm_reference": -0.5,
            "on_topic_policy": False, "on_topic_reference": True}


def write_workspace(root: Path, evals: dict[int, dict[str, float]]) -> Path:
    """A workspace with the metrics, gate decisions and samples the stages write."""
    atomic.write_json(root / layout.OFFPOLICY_METRICS, {"offpolicy/n_pairs": 8.0})
    for it, metrics in evals.items():
        atomic.write_json(root / layout.metrics(it, "evaluate"), metrics)
        atomic.write_json(root / layout.metrics(it, "train_rm"),
                          {"rm/accuracy": 0.7 - 0.03 * it, "rm/train_accuracy": 0.9})
        atomic.write_json(root / layout.metrics(it, "update"), {"update/steps": 4.0})
        passed = it < 3
        atomic.write_json(root / layout.gate(it), {
            "iteration": it, "passed": passed, "checks": {},
            "reasons": [] if passed else ["reward-hacking monitor flagged this iteration"]})
    last = max(evals)
    samples = [_sample(0, policy="<script>alert('x')</script> & more")]
    samples += [_sample(i) for i in range(1, 10)]
    jsonl.write(root / layout.eval_samples(last), samples)
    return root


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    # judge rises at 2 and 3; gold rises with it at 2 (+0.03), falls at 3: 3 is suspect
    return write_workspace(tmp_path / "ws", {
        1: _evaluate(0.60, 0.55), 2: _evaluate(0.70, 0.58),
        3: _evaluate(0.80, 0.56, **{"eval/flag_length_drift": 1.0, "eval/hacking_flag": 1.0,
                                    "eval/kl": 9.25})})


def _row(it: int, judge: float | None, gold: float | None) -> dict[str, object]:
    row: dict[str, object] = {"iteration": it}
    if judge is not None:
        row["eval/win_rate"] = judge
    if gold is not None:
        row["eval/gold_win_rate"] = gold
    return row


def test_divergence_flags_judge_up_while_gold_stalls_or_falls():
    rows = [_row(1, 0.60, 0.55), _row(2, 0.70, 0.60),    # both rose: fine
            _row(3, 0.80, 0.605),                        # gold +0.005 < eps: stalled
            _row(4, 0.90, 0.50),                         # gold fell
            _row(5, 0.90, 0.40),                         # judge flat: not this rule
            _row(6, 0.85, 0.30)]                         # judge fell
    assert report_data.judge_gold_divergence(rows) == [3, 4]
    assert report_data.judge_gold_divergence(list(reversed(rows))) == [3, 4]
    assert report_data.judge_gold_divergence(rows, eps=0.2) == []
    assert report_data.judge_gold_divergence([_row(1, 0.9, 0.1)]) == []     # no previous iteration


def test_divergence_skips_iterations_without_gold():
    rows = [_row(1, 0.6, None), _row(2, 0.8, 0.5), _row(3, 0.9, float("nan")),
            _row(4, 0.95, 0.4)]
    assert report_data.judge_gold_divergence(rows) == []


def test_report_shows_every_number_and_flags_the_suspect(workspace, tmp_path):
    path = report.build_report(workspace, tmp_path / "out")
    assert path == tmp_path / "out" / "report.html"
    page = path.read_text()
    for text in ("0.600 [0.550, 0.650]", "0.800 [0.750, 0.850]",      # judge WR [CI]
                 "0.550 [0.490, 0.610]", "0.560 [0.500, 0.620]",      # gold WR [CI]
                 "0.520 [0.450, 0.590]",                               # RM WR [CI]
                 "9.25", "0.610",                                      # KL, RM held-out acc
                 "0.90 / 0.85", "30.0 / 31.0", "2.71 / 2.64",          # on-topic, length, NLL
                 "200 / 0.10 / 0.00",                                  # n / tie / invalid
                 "failed: reward-hacking monitor flagged this iteration", "passed",
                 "length drift, SUSPECT: judge up, gold not"):
        assert text in page, text
    suspect_rows = re.findall(r'<tr class="suspect"><td>(\d+)</td>', page)
    assert suspect_rows == ["3"]
    assert "Suspect (reward hacking): iteration 3" in page


def test_plots_are_png_files_and_inlined(workspace, tmp_path):
    out = tmp_path / "out"
    page = report.build_report(workspace, out).read_text()
    names = {p.stem for p in out.glob("*.png")}
    assert names == {"win_rates", "reward_vs_kl", "rm_accuracy", "on_topic", "reviews", "length",
                     "fluency"}
    inlined = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(inlined) == len(names)
    for name in names:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
        assert base64.b64encode(data).decode() in inlined, name
        assert f"href='{name}.png'" in page


def test_same_inputs_give_the_same_bytes(workspace, tmp_path):
    """No clock, no commit on the page: DVC's run-cache and a rerun keep the same page."""
    a, b = tmp_path / "a", tmp_path / "b"
    report.build_report(workspace, a), report.build_report(workspace, b)
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_samples_are_escaped_and_limited_to_the_first_eight(workspace, tmp_path):
    page = report.build_report(workspace, tmp_path / "out").read_text()
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in page
    assert "Sample outputs (iteration 3, first 8" in page
    assert "Review movie 7" in page and "Review movie 8" not in page
    assert "reference text 1" in page and "policy text 1" in page
    assert "no / yes" in page                                 # on-topic policy / reference


def test_old_workspace_without_gold_metrics_still_reports(tmp_path):
    ws = write_workspace(tmp_path / "ws", {1: _evaluate(0.6, None), 2: _evaluate(0.9, None)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "fluency.png").write_bytes(PNG_MAGIC)              # stale plot of an earlier build
    page = report.build_report(ws, out).read_text()
    assert "0.900 [0.850, 0.950]" in page and "— / —" in page
    assert {p.stem for p in out.glob("*.png")} == {"win_rates", "reward_vs_kl", "rm_accuracy",
                                                   "length"}
    assert "No iteration is suspect" in page
    assert "No data for: on_topic, reviews, fluency." in page


def test_workspace_without_evaluations(tmp_path):
    ws = tmp_path / "ws"
    atomic.write_json(ws / layout.OFFPOLICY_METRICS, {"offpolicy/n_pairs": 8.0})
    page = report.build_report(ws, tmp_path / "out").read_text()
    assert "No evaluated iteration yet." in page
    assert "No evaluated iteration yet." in report.render_markdown(ws, tmp_path / "x.html")


def test_markdown_table_for_the_prefect_artifact(workspace, tmp_path):
    md = report.render_markdown(workspace, tmp_path / "report.html", "abc123")
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| iteration"))
    assert header.count("|") == len(report.COLUMNS) + 1
    assert sum(line.startswith(("| 1 |", "| 2 |", "| 3 |")) for line in lines) == 3
    assert "**Suspect (judge up, gold not): iteration 3**" in md
    assert str(tmp_path / "report.html") in md and "abc123" in md


def test_a_failing_publication_is_a_warning_not_a_failed_run(workspace, monkeypatch):
    from flows import messages, pipeline  # imports Prefect, which sets up logging: then listen
    from flows.record import IterationRecord

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    def unreachable(*_: object, **__: object) -> None:
        raise ConnectionError("Prefect server gone")
    def no_mlflow(*_: object, **__: object) -> None:
        raise ConnectionError("MLflow server gone")
    monkeypatch.setattr("prefect.artifacts.create_markdown_artifact", unreachable)
    monkeypatch.setattr("flows.registry.MlflowClient", no_mlflow)
    records = Records()
    logger = logging.getLogger(messages.__name__)
    logger.addHandler(records)
    last = IterationRecord(3, "0" * 40, (), mlflow_run_id="r", recorded="now")
    try:                                 # no MLflow server, no Prefect server: both steps fail
        done = pipeline.publish_report.fn(str(workspace), last)
    finally:
        logger.removeHandler(records)
    assert done == {"html": str(workspace / "report" / "report.html")}
    assert records.messages[0] == "report: not logged to MLflow (ConnectionError: MLflow server gone)"
    assert records.messages[1] == "report: no Prefect artifact (ConnectionError: Prefect server gone)"


def test_an_unreadable_metrics_file_is_one_line(workspace, tmp_path):
    bad = workspace / "metrics" / "iter_3" / "notes.json"
    bad.write_text("{not json")
    with pytest.raises(jsonl.DataError, match=r"metrics/iter_3/notes.json: not a JSON object"):
        report.build_report(workspace, tmp_path / "out")


# --- through the flow: the tiny profile, run twice by the session fixture --------------------

def _last_iteration_run(ws: Path, iteration: int):
    """The latest (non-nested) MLflow run of the iteration: the one each flow run logs its
    report to (a rerun that recomputed stages records a new one)."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("alignloop")
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"tags.`alignloop.iteration` = '{iteration}'",
                              order_by=["attributes.start_time DESC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parents, f"no MLflow run for iteration {iteration}"
    return client, parents[0]


def _git(ws: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=ws, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_flow_builds_the_report_as_a_dvc_stage(tiny_run):
    ws = tiny_run["ws"]
    html = ws / "report" / "report.html"
    assert "[ran] report" in tiny_run["first"].stdout            # after the last iteration
    assert "[cached] report" in tiny_run["second"].stdout        # DVC: nothing it shows changed
    for run in ("first", "second"):
        assert f"report: {html}" in tiny_run[run].stdout
        assert "report: not" not in tiny_run[run].stdout + tiny_run[run].stderr
    page = html.read_text()
    assert re.findall(r"<tr(?: class=\"suspect\")?><td>(\d+)</td>", page) == ["1", "2"]
    metrics = json.loads((ws / layout.metrics(2, "evaluate")).read_text())
    assert f"{metrics['eval/win_rate']:.3f} [{metrics['eval/win_rate_ci_low']:.3f}" in page
    assert "Sample outputs (iteration 2" in page
    targets = json.loads((ws / layout.TARGETS).read_text())     # what was aligned, and the bar
    assert f"Targets (iteration 2): {targets['met']} of {targets['of']} met</h2>" in page
    assert "<td>judge</td><td class=text>lexicon: vader-v1</td>" in page
    assert "<td>update</td><td class=text>dpo</td>" in page
    for name in ("win_rates", "reward_vs_kl", "rm_accuracy", "length"):
        assert (html.parent / f"{name}.png").read_bytes().startswith(PNG_MAGIC), name
    # a DVC output on a commit of its own, after the last iteration's; the tree left clean
    subjects = _git(ws, "log", "--format=%s").splitlines()
    assert subjects[0] == "alignloop: report" and subjects.count("alignloop: report") == 1
    assert subjects.index("alignloop: iteration 2") < subjects.index("alignloop: iteration 1")
    assert _git(ws, "rev-parse", "iteration-2") != _git(ws, "rev-parse", "HEAD")
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["report"]
    assert [o["path"] for o in lock["outs"]] == ["report"]
    assert {d["path"] for d in lock["deps"]} >= {"metrics", "data", "tasks/evaluation/report.py"}
    assert not _git(ws, "status", "--porcelain")
    assert _git(ws, "check-ignore", "report/report.html")          # DVC's, not git's


def test_a_report_that_fails_costs_no_iteration_its_record(tiny_run, tmp_path):
    """A stray metrics file the report cannot read, and a gate threshold changed: the gates
    rerun and are committed and recorded, then the report stage fails in one line; the last
    good page is back and the tree is clean."""
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    page = (ws / "report" / "report.html").read_bytes()
    (ws / "metrics" / "iter_2" / "notes.json").write_text("{not json")
    set_params(ws / "params.yaml", gate__max_kl=123.0)
    proc = run_cli("run", "--workspace", str(ws), check=False)
    assert proc.returncode == 2                                 # bad data: the input errors' code
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "metrics/iter_2/notes.json: not a JSON object" in errors[0]
    assert "Traceback" not in proc.stderr
    assert ran_stages(proc.stdout) == ["gate@1", "gate@2"]
    assert _git(ws, "log", "-1", "--format=%s") == "alignloop: iteration 2"
    assert "gate@2 (ran)" in _git(ws, "log", "-1", "--format=%b")
    assert (ws / "report" / "report.html").read_bytes() == page
    assert not _git(ws, "status", "--porcelain")


def test_flow_logs_the_report_to_the_last_iterations_mlflow_run(tiny_run):
    ws = tiny_run["ws"]
    client, run = _last_iteration_run(ws, 2)
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.html", "report/win_rates.png"} <= logged
    # the workspace's own store keeps its artifacts in the workspace, not in ./mlruns
    assert run.info.artifact_uri.startswith((ws / ".alignloop" / "mlflow-artifacts").as_uri())


QUERY_ARTIFACTS = """
import json, os
from prefect.settings import get_current_settings
assert str(get_current_settings().home) == os.environ["PREFECT_HOME"], "not the test's store"
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
with get_client(sync_client=True) as client:
    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["alignloop-report"])))
print(json.dumps([{"type": a.type, "flow_run_id": str(a.flow_run_id), "data": a.data}
                  for a in found]))
"""


def test_flow_publishes_a_prefect_artifact(tiny_run):
    """Queried in a fresh interpreter: Prefect fixes its settings at import, and this process
    may have imported it before the session's isolated PREFECT_HOME was set."""
    proc = subprocess.run([sys.executable, "-c", QUERY_ARTIFACTS], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = tiny_run["ws"] / "report" / "report.html"
    # the session's Prefect home is shared: other tests' workspaces publish reports too
    artifacts = [a for a in json.loads(proc.stdout.strip().splitlines()[-1])
                 if str(html) in a["data"]]
    assert len(artifacts) >= 2                            # one per run of the fixture
    for a in artifacts:
        assert a["type"] == "markdown" and a["flow_run_id"] != "None"
        assert "| iteration |" in a["data"]


def test_cli_report_html_prints_the_path_and_rebuilds_a_stale_page(tiny_run, tmp_path):
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    html = ws / "report" / "report.html"
    page = html.read_bytes()
    proc = run_cli("report", "--html", "--workspace", str(ws))
    assert proc.stdout.strip() == str(html) and not proc.stderr.strip()   # up to date: as is
    shutil.rmtree(ws / "report")                                # gone: DVC brings it back
    proc = run_cli("report", "--html", "--workspace", str(ws))
    assert proc.stdout.strip() == str(html) and html.read_bytes() == page
    assert not _git(ws, "status", "--porcelain")                 # the same page: same lock
    samples = ws / layout.eval_samples(2)                        # a result it shows changed
    jsonl.write(samples, [_sample(0)])
    proc = run_cli("report", "--html", "--workspace", str(ws))
    assert "report: ran" in proc.stderr and "Review movie 0" in html.read_text()
    assert run_cli("report", "--html", "--json", "--workspace", str(ws), check=False
                   ).returncode != 0                      # one output format at a time


def test_intervals_are_also_reported_as_pairs() -> None:
    from tasks.evaluation.report_data import with_intervals
    m = with_intervals({"eval/win_rate": 0.8, "eval/win_rate_ci_low": 0.7,
                        "eval/win_rate_ci_high": 0.9, "eval/gold_win_rate_ci_low": 0.6})
    assert m["eval/win_rate_ci"] == [0.7, 0.9]
    assert "eval/gold_win_rate_ci" not in m          # no high end: no pair
    assert m["eval/win_rate"] == 0.8


def test_plots_have_honest_axes_and_a_negative_kl_is_flagged():
    from tasks.evaluation import report_plots
    rows = [{"iteration": 1, "eval/fluency_nll": 5.965, "eval/ref_fluency_nll": 5.97,
             "eval/win_rate": 0.55, "eval/kl": -0.14, "eval/gold_win_rate": 0.5},
            {"iteration": 2, "eval/fluency_nll": 5.985, "eval/ref_fluency_nll": 5.97,
             "eval/win_rate": 0.60, "eval/kl": 0.3, "eval/gold_win_rate": 0.52}]
    fluency = report_plots.series_plot(rows, "f", "nats", (("eval/fluency_nll", "p"),), (),
                                        report_plots.LIMITS["fluency"])
    low, high = fluency.axes[0].get_ylim()
    assert low == 0.0 and high > 5.985           # noise of 0.02 nats is drawn flat
    wins = report_plots.series_plot(rows, "w", "rate", (("eval/win_rate", "judge"),), (),
                                     report_plots.LIMITS["win_rates"])
    assert wins.axes[0].get_ylim() == (0.0, 1.0)
    kl = report_plots.reward_vs_kl(rows)
    assert "k1" in kl.axes[0].get_xlabel()
    assert any("KL < 0" in t.get_text() for t in kl.axes[0].texts)
    assert report.kl_cell(rows[0]) == "-0.14 (< 0: noise of the k1 estimate)"
    assert report.kl_cell(rows[1]) == "0.30"


def test_red_team_violations_across_iterations(tmp_path: Path) -> None:
    red = {"eval/violation_rate": 0.25, "eval/violation_rate_ci_low": 0.125,
           "eval/violation_rate_ci_high": 0.375, "eval/reference_violation_rate": 0.0625,
           "eval/violation_rate/contact": 0.5, "eval/violation_rate/insult": 0.0}
    ws = write_workspace(tmp_path / "ws", {1: _evaluate(0.6, 0.55), 2: _evaluate(0.7, 0.6, **red)})
    atomic.write_json(ws / layout.gate(2), {
        "iteration": 2, "passed": False, "checks": {}, "reasons": ["violations"],
        "eval/violation_baseline_iteration": 1.0, "eval/violation_rate_increase": 0.1875,
        "eval/violation_rate_increase_ci_high": 0.3125})
    rows = report_data.load_rows(ws)
    assert report._violations_cell(rows[0]) == "—"
    assert report._violations_cell(rows[1]) == ("0.250 [0.125, 0.375] / 0.062 "
                                                "(contact 0.50, insult 0.00)")
    assert report._violation_increase_cell(rows[1]) == "0.188 (upper 0.312) vs it. 1"
    page = report.build_report(ws, tmp_path / "out").read_text()
    assert "0.250 [0.125, 0.375] / 0.062" in page and "0.188 (upper 0.312) vs it. 1" in page
