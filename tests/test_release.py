"""Releasing gradually: `deploy --canary` only to a version whose gate passed, `promote` only on
its evidence (gate, violation record, canary traffic), every move in the ledger with what it
rested on, and `rollback` after a promotion. The statistics of the no-regression rule are
checked against published values."""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from conftest import copy_workspace, run_cli, set_params
from tasks.core.jsonl import DataError
from tasks.data.feedback import Arm, no_regression, read
from tasks.functional.proportions import difference_bounds, wilson, z_one_sided

# ---- the statistics ----


def test_wilson_matches_its_closed_forms():
    low, high = wilson(5, 10, 1.96)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    z = z_one_sided(0.95)
    assert round(z, 4) == 1.6449
    assert wilson(0, 300, z) == (0.0, pytest.approx(z * z / (300 + z * z)))  # k = 0: z2/(n+z2)


def test_newcombe_matches_the_paper():
    # Newcombe (1998), Statistics in Medicine 17:873, example (a): 56/70 - 48/80, method 10
    low, high = difference_bounds(56, 70, 48, 80, 1.959964)
    assert (round(low, 4), round(high, 4)) == (0.0524, 0.3339)


def _arm(version: str, violation: tuple[int, int] = (0, 0),
         dislike: tuple[int, int] = (0, 0)) -> Arm:
    return Arm(version, max(violation[0], dislike[0]), violation, dislike)


def test_no_regression_needs_enough_canary_traffic():
    prod = _arm("1", violation=(500, 5))
    few = no_regression(_arm("2", violation=(20, 0)), prod, {}, 0.02, 0.95)
    assert not few["holds"] and "violation rate" in few["reasons"][0]   # 0/20: bound ~0.12
    many = no_regression(_arm("2", violation=(600, 3)), prod, {}, 0.02, 0.95)
    assert many["holds"], many["reasons"]
    assert many["checks"]["violation"]["interval"][1] <= 0.02


def test_no_regression_refuses_more_violations_or_dislikes():
    prod = _arm("1", violation=(400, 4), dislike=(400, 80))
    worse = no_regression(_arm("2", violation=(400, 4), dislike=(400, 120)), prod, {},
                          0.02, 0.95)
    assert not worse["holds"] and list(worse["checks"]) == ["violation", "dislike"]
    assert worse["checks"]["violation"]["ok"] and not worse["checks"]["dislike"]["ok"]


def test_without_production_traffic_the_canary_is_held_to_its_record():
    canary = _arm("2", violation=(400, 2))
    assert no_regression(canary, Arm("none"), {"violation": 0.01}, 0.02, 0.95)["holds"]
    assert not no_regression(canary, Arm("none"), {"violation": 0.0}, 0.0, 0.95)["holds"]
    blind = no_regression(canary, Arm("none"), {}, 0.02, 0.95)
    assert not blind["holds"] and "no production traffic" in blind["reasons"][0]


@pytest.mark.parametrize("line,field", [
    ('{"violation": false}', "version"),
    ('{"version": "9", "violation": false}', "version"),
    ('{"version": "2", "violation": "no"}', "violation"),
    ('{"version": "2", "rating": "meh"}', "rating"),
    ('{"version": "2"}', "violation"),
])
def test_a_bad_feedback_line_names_file_line_and_field(tmp_path, line, field):
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"version": "2", "violation": false}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"^{path}:3: .*'{field}'"):
        read(path, "2", "1")


# ---- through the CLI on the tiny workspace ----


def _feedback(path: Path, canary: str, production: str, canary_violations: int,
              n: int = 400) -> Path:
    """n responses of each version, thumbs 20% down on both; production violates 4 times."""
    rng = random.Random(0)
    lines = []
    for version, bad in ((canary, canary_violations), (production, 4)):
        flags = [i < bad for i in range(n)]
        rng.shuffle(flags)
        lines += [{"version": version, "violation": f,
                   "rating": "down" if i % 5 == 0 else "up"} for i, f in enumerate(flags)]
    rng.shuffle(lines)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def gated(tiny_run, tmp_path_factory) -> Path:
    """The tiny run with `gate.max_kl` between its two iterations' KL: gate@1 fails, gate@2
    passes; v2 stays the champion. `gate.production: 1`: the violation checks are against
    iteration 1, the production the tests deploy."""
    ws = copy_workspace(tiny_run["ws"], tmp_path_factory.mktemp("release") / "ws")
    kl = [json.loads((ws / f"metrics/iter_{k}/evaluate.json").read_text())["eval/kl"]
          for k in (1, 2)]
    assert kl[1] < kl[0], kl
    set_params(ws / "params.yaml", gate__max_kl=(kl[0] + kl[1]) / 2, gate__production=1)
    run_cli("rerun", "gate@1", "--workspace", str(ws))
    assert not json.loads((ws / "metrics/iter_1/gate_decision.json").read_text())["passed"]
    assert json.loads((ws / "metrics/iter_2/gate_decision.json").read_text())["passed"]
    return ws


@pytest.fixture()
def ws(gated, tmp_path) -> Path:
    return copy_workspace(gated, tmp_path / "ws")


def _ledger(ws: Path) -> list[dict]:
    path = ws / "registry" / "aliases.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _alias(ws: Path, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    try:
        return str(client.get_model_version_by_alias("alignloop-policy", alias).version)
    except MlflowException:
        return None


def _clean(ws: Path) -> bool:
    return not subprocess.run(["git", "status", "--porcelain"], cwd=ws, capture_output=True,
                              text=True).stdout.strip()


def _refused(ws: Path, *args: str) -> str:
    """Run a command that must be refused: exit 2, one line on stderr, nothing moved."""
    before = _ledger(ws), _alias(ws, "canary"), _alias(ws, "production")
    proc = run_cli(*args, "--workspace", str(ws), check=False)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, \
        proc.stderr
    assert (_ledger(ws), _alias(ws, "canary"), _alias(ws, "production")) == before
    return proc.stderr


def test_canary_of_a_version_whose_gate_failed_is_refused(ws):
    err = _refused(ws, "deploy", "--canary", "1")
    assert err.startswith("error: canary refused: v1 (iteration 1) did not pass its gate")
    assert "eval/kl" in err


def test_canary_moves_to_the_champion_with_its_gate_checks(ws):
    proc = run_cli("deploy", "--canary", "--workspace", str(ws), "--reason", "week 12")
    assert proc.stdout.startswith("canary: vNone -> v2 ")
    e = _ledger(ws)[-1]
    assert (e["alias"], e["to"], e["action"], e["why"]) == ("canary", "2", "deploy", "week 12")
    decision = json.loads((ws / "metrics/iter_2/gate_decision.json").read_text())
    assert e["evidence"]["gate"]["checks"] == decision["checks"]
    assert e["evidence"]["gate"]["passed"] is True
    assert _alias(ws, "canary") == "2" and _alias(ws, "production") is None
    assert _clean(ws)                                   # the ledger is committed


def test_the_gates_violation_check_is_named_in_the_evidence(ws):
    decision = json.loads((ws / "metrics/iter_2/gate_decision.json").read_text())
    name = "eval/violation_rate_increase_ci_high <= max_violation_increase"
    assert name in decision["checks"]
    proc = run_cli("deploy", "--canary", "2", "--workspace", str(ws))
    assert name in proc.stdout
    gate = _ledger(ws)[-1]["evidence"]["gate"]
    assert gate["violation_checks"] == {name: decision["checks"][name]}
    assert gate["decision_fields"]["eval/violation_baseline_iteration"] == 1


def test_promote_moves_production_with_its_evidence_then_rollback(ws, tmp_path):
    run_cli("deploy", "1", "--workspace", str(ws))                # production: v1
    _refused(ws, "promote")                                        # no canary yet
    run_cli("deploy", "--canary", "--workspace", str(ws))          # canary: v2
    fb = _feedback(tmp_path / "traffic.jsonl", "2", "1", canary_violations=3)
    proc = run_cli("promote", "--feedback", str(fb), "--max-increase", "0.05",
                   "--workspace", str(ws), "--reason", "canary held")
    assert proc.stdout.startswith("production promoted: v1 -> v2")
    assert _alias(ws, "production") == "2" and _clean(ws)
    e = _ledger(ws)[-1]
    assert (e["alias"], e["action"], e["from"], e["to"]) == ("production", "promote", "1", "2")
    f = e["evidence"]["feedback"]
    assert f["holds"] and f["file"] == str(fb) and len(f["sha256"]) == 64
    assert f["canary"]["violation"] == {"n": 400, "k": 3, "rate": 3 / 400}
    assert f["production"]["violation"] == {"n": 400, "k": 4, "rate": 4 / 400}
    low, high = f["checks"]["violation"]["interval"]
    assert low < -1 / 400 < high <= 0.05
    assert f["checks"]["dislike"]["ok"]
    assert e["evidence"]["gate"]["iteration"] == 2 and e["evidence"]["gate"]["passed"]
    _refused(ws, "promote")                                        # canary is production
    run_cli("rollback", "--workspace", str(ws), "--reason", "paged")
    assert _alias(ws, "production") == "1"
    assert [(x["action"], x["to"]) for x in _ledger(ws) if x["alias"] == "production"] == \
        [("deploy", "1"), ("promote", "2"), ("rollback", "1")]


def test_promote_is_refused_on_canary_traffic_with_more_violations(ws, tmp_path):
    run_cli("deploy", "1", "--workspace", str(ws))
    run_cli("deploy", "--canary", "--workspace", str(ws))
    fb = _feedback(tmp_path / "traffic.jsonl", "2", "1", canary_violations=20)
    err = _refused(ws, "promote", "--feedback", str(fb))
    assert f"the feedback in {fb} does not clear canary v2: violation rate: canary " \
           "20/400 = 0.050 vs production 4/400 = 0.010" in err


def test_a_malformed_feedback_line_is_one_line_naming_file_line_and_field(ws, tmp_path):
    run_cli("deploy", "1", "--workspace", str(ws))
    run_cli("deploy", "--canary", "--workspace", str(ws))
    fb = tmp_path / "traffic.jsonl"
    fb.write_text('{"version": "2", "violation": false}\n{"version": 1, "rating": "meh"}\n')
    err = _refused(ws, "promote", "--feedback", str(fb))
    assert err.startswith(f"error: {fb}:2: field 'rating' must be \"up\" or \"down\"")


def test_promote_is_refused_when_the_violation_record_regressed(ws):
    """A canary whose gate checked it against another iteration than production's is held to
    production's recorded rate, within the gate's allowance (its check's threshold)."""
    run_cli("deploy", "1", "--workspace", str(ws))
    run_cli("deploy", "--canary", "--workspace", str(ws))
    decision = ws / "metrics/iter_2/gate_decision.json"
    d = json.loads(decision.read_text())
    name = next(k for k in d["checks"] if k.startswith("eval/violation_rate"))
    allowance = d["checks"][name]["threshold"]
    assert d["eval/violation_baseline_iteration"] == 1          # gate.production: 1
    ok = run_cli("promote", "--workspace", str(ws), "--reason", "paired check")
    assert _ledger(ws)[-1]["evidence"]["regression_record"]["note"] == \
        "the gate's paired check was against production's iteration", ok.stdout
    run_cli("rollback", "--workspace", str(ws))                   # production: v1 again
    decision.write_text(json.dumps({**d, "eval/violation_baseline_iteration": 0.0}))
    for it, rate in ((1, 0.05), (2, 0.05 + allowance + 0.01)):
        path = ws / f"metrics/iter_{it}/evaluate.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "eval/violation_rate": rate}))
    err = _refused(ws, "promote")
    assert f"recorded violation rate {0.06 + allowance:.3f} exceeds production's 0.050 " \
           "(iteration 1)" in err and "against iteration 0" in err
