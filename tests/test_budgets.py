"""Budgets on the recurring loop: the judge's requests are counted before any is sent (and a
run over `judge.max_requests_per_tick` stops before judging), and a tick beyond
`--max-runs-per-day` is refused with its reason logged."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import copy_workspace, run_cli
from tasks.config.params import JudgeParams
from tasks.core.errors import InputError
from tasks.data.records import PreferencePair
from tasks.judging.labelling import judge_all, requests_needed, seeded_pairs
from tasks.judging.verdict_cache import VerdictCache
from tasks.stages.judge import check_budget
from test_judge_http import server  # noqa: F401 (the fixture: a scripted judge server)
from test_pairwise_judge import PROMPT, judge_with, prefers

JP = JudgeParams(kind="http", model="m", comparisons_per_prompt=4, pool_pairs="all",
                 max_requests_per_tick=10)
GROUPS = [(PROMPT, ["good one", "bad one", "good two", "meh"], {"prompt_id": "p1"}),
          (PROMPT, ["x", "y", "x"], {"prompt_id": "p2"})]       # p2: two distinct pairs


def test_the_count_is_what_judging_then_sends(tmp_path: Path):
    judge = judge_with(prefers("good"), VerdictCache(tmp_path / "c.sqlite", "id"))
    audited = [PreferencePair(PROMPT, "good one", "bad one", "s", {})]    # also in the plan
    need, orders = requests_needed(judge, GROUPS, JP, audited)
    assert orders == 2 * (4 + 2 + 1)
    assert judge.backend.asked == []                     # type: ignore[attr-defined]
    judge_all(judge, GROUPS, "iter_1", JP)
    from tasks.judging.judges import judge_pairs
    judge_pairs(judge, [(p.prompt, p.chosen, p.rejected) for p in audited])  # as audit does
    sent = judge.backend.asked                           # type: ignore[attr-defined]
    assert need == len(sent) == len(set(sent))
    # p1: 4 pairs in both orders; p2's two pairs are ("x","y") and ("y","x"): 2 distinct
    # orders; the audited pair adds its 2 unless the plan has it already
    in_plan = (0, 1) in seeded_pairs("p1", GROUPS[0][1], 4)
    assert need == 2 * 4 + 2 + (0 if in_plan else 2)
    assert requests_needed(judge, GROUPS, JP, audited)[0] == 0   # a rerun: all cached


def test_a_run_over_the_budget_is_refused_before_any_request(tmp_path: Path):
    judge = judge_with(prefers("good"), VerdictCache(tmp_path / "c.sqlite", "id"))
    tight = JudgeParams(**{**JP.__dict__, "max_requests_per_tick": 9})
    with pytest.raises(InputError, match=r"^judge@3: judging needs 10 requests to the http "
                                         r"judge .*over judge.max_requests_per_tick = 9; "
                                         "nothing was sent$"):
        check_budget(judge, GROUPS, tight, [], 3)
    assert judge.backend.asked == []                     # type: ignore[attr-defined]
    check_budget(judge, GROUPS, JP, [], 3)               # 10 <= 10: judging may go on


# ---- --max-runs-per-day ----

@pytest.fixture()
def ws(tiny_run, tmp_path) -> Path:
    return copy_workspace(tiny_run["ws"], tmp_path / "ws")


def _ticks(ws: Path) -> list[dict]:
    path = ws / ".alignloop" / "ticks.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _log_runs(ws: Path, *ages_h: float, outcome: str = "ran") -> None:
    now = time.time()
    with (ws / ".alignloop" / "ticks.jsonl").open("a") as f:
        for i, age in enumerate(ages_h):
            start = now - age * 3600
            f.write(json.dumps({"iteration": 3 + i, "start": start, "end": start + 60,
                                "outcome": outcome}) + "\n")


def test_the_daily_count_is_of_ticks_that_ran_in_the_last_24_hours(ws):
    from flows.schedule import over_daily_budget
    from flows.workspace import Workspace
    w = Workspace(ws)
    _log_runs(ws, 30.0, 23.0)                 # one too old to count
    _log_runs(ws, 1.0, outcome="failed")      # a failed run spent its budget too
    with (ws / ".alignloop" / "ticks.jsonl").open("a") as f:
        f.write(json.dumps({"start": time.time(), "outcome": "skipped"}) + "\n{\"half")
    now = time.time()
    assert over_daily_budget(w, 0, now) is None                  # 0: no limit
    assert over_daily_budget(w, 3, now) is None
    why = over_daily_budget(w, 2, now)
    assert why is not None and why.startswith("2 runs in the last 24 h, --max-runs-per-day 2")
    free = time.strftime("%Y-%m-%dT%H", time.gmtime(now + 1 * 3600))   # when 23 h -> 24 h
    assert f"the next may run from {free}" in why


def test_a_tick_beyond_max_runs_per_day_is_refused(ws):
    before = (ws / "params.yaml").read_text()
    _log_runs(ws, 5.0, 2.0)
    t0 = time.monotonic()
    proc = run_cli("tick", "--workspace", str(ws), "--max-runs-per-day", "2")
    assert time.monotonic() - t0 < 30                            # no flow run, no pipeline
    assert proc.returncode == 0
    assert proc.stdout.startswith("tick: refused (2 runs in the last 24 h, --max-runs-per-day 2")
    last = _ticks(ws)[-1]
    assert last["outcome"] == "refused" and "--max-runs-per-day 2" in last["why"]
    assert (ws / "params.yaml").read_text() == before
    bad = run_cli("tick", "--workspace", str(ws), "--max-runs-per-day", "-1", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0


def test_the_served_tick_refuses_under_its_lock_too(ws):
    """The flow itself, as a served fire runs it (the CLI's pre-check is skipped)."""
    import os

    from flows.schedule import tick
    _log_runs(ws, 1.0)
    saved = dict(os.environ)                  # the tick sets the workspace's environment
    try:
        state = tick.fn(str(ws), overlap="skip", max_runs_per_day=1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert state.name == "Refused" and state.is_completed()
    assert _ticks(ws)[-1]["outcome"] == "refused"


# ---- judge.max_requests_per_tick through a tick ----

@pytest.mark.slow      # a tiny loop with the http judge, then a tick: minutes
def test_a_tick_over_the_judge_request_budget_stops_before_judging(tmp_path, server):  # noqa: F811
    import hashlib
    import subprocess

    from conftest import ROOT, set_params
    from test_http_judge_e2e import PAIRS
    from test_judge_http import Script, completion

    class Coin(Script):          # a verdict from the request's text: stable, some pairs clear
        def next(self, body: dict) -> object:
            text = body["messages"][0]["content"]
            return 200, completion("AB"[hashlib.md5(text.encode()).digest()[0] % 2])
    script = Coin([])
    env = {"ALIGNLOOP_JUDGE_URL": server(script)}
    ws = tmp_path / "ws"
    run_cli("init", str(ws), "--params", str(ROOT / "params" / "tiny-http-judge.yaml"))
    set_params(ws / "params.yaml", judge__model="fake-judge")
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    run_cli("import", str(src), "--workspace", str(ws))
    run_cli("run", "--workspace", str(ws), env=env)
    set_params(ws / "params.yaml", judge__max_requests_per_tick=20)   # a tick needs 72
    git = lambda *a: subprocess.run(["git", *a], cwd=ws, capture_output=True, text=True,
                                    check=True).stdout.strip()
    git("commit", "-qam", "judge request budget")
    head, sent = git("rev-parse", "HEAD"), len(script.bodies)
    proc = run_cli("tick", "--workspace", str(ws), env=env, check=False)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("error: stage judge@3 failed: judge@3: "
                                                   "judging needs 72 requests"), err
    assert "over judge.max_requests_per_tick = 20; nothing was sent" in err
    assert len(script.bodies) == sent            # earlier iterations' reruns: from the cache
    assert git("rev-parse", "HEAD") == head and not git("status", "--porcelain")
    assert not (ws / "data" / "iter_3").exists()
    last = _ticks(ws)[-1]
    assert last["outcome"] == "failed" and "judge.max_requests_per_tick = 20" in last["why"]
