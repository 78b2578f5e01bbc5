"""The efficacy bar (`targets:` in params) checked against the last iteration's evaluation and
the loop's wall time, met or missed, with the numbers: written to `metrics/targets.json` (in
the last iteration's commit), logged to its MLflow run and the Prefect flow run's log, and
printed by `alignloop run` at the end.

The wall time is what each loop stage took when it computed the outputs dvc.lock now holds,
recorded in `.alignloop/stage_seconds.json` beside the lock entry it produced. So a run resumed
after a failure, or one that found some stages cached, still counts every iteration's full
cost; a stage whose outputs were restored (DVC's run cache or remote) has no timing here and
leaves the minutes untimed rather than under-counted. The bar holds per iteration: the
longest one is checked, each one printed.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flows.workspace import STATE_DIR
from tasks.config.params import TargetParams
from tasks.core import atomic, layout

SETUP_STAGES = layout.SETUP_STAGES
SECONDS_FILE = "stage_seconds.json"      # in .alignloop/: stage -> {seconds, lock fingerprint}


@dataclass(frozen=True)
class Check:
    name: str
    value: float
    bar: str
    met: bool

    def line(self) -> str:
        return f"  [{'met' if self.met else 'MISSED'}] {self.name} = {self.value:.3f} ({self.bar})"


def iteration_minutes(stage_seconds: Mapping[str, float]) -> dict[str, float]:
    """Wall time of each iteration, iteration key -> minutes: the sum of its loop stages'
    seconds (stage name `stage@key` -> seconds; set-up stages belong to no iteration)."""
    out: dict[str, float] = {}
    for name, s in stage_seconds.items():
        stage, _, key = name.partition("@")
        if stage not in SETUP_STAGES and key:
            out[key] = out.get(key, 0.0) + s / 60.0
    return out


def _seconds_path(root: Path) -> Path:
    return Path(root) / STATE_DIR / SECONDS_FILE


def _read_seconds(root: Path) -> dict[str, Any]:
    try:
        data = json.loads(_seconds_path(root).read_text())
    except (FileNotFoundError, json.JSONDecodeError):    # none yet, or unreadable: untimed
        return {}
    return data if isinstance(data, dict) else {}


def record_seconds(root: Path, runs: Iterable[Any], lock: Mapping[str, Any]) -> None:
    """Remember the wall time of every stage that computed its outputs in `runs` (StageRuns),
    keyed to the lock entry it produced; cached and restored stages keep what they had."""
    from flows.dag import fingerprint
    ran = {r.name: r.seconds for r in runs if r.outcome == "ran" and r.name in lock}
    if not ran:
        return
    data = _read_seconds(root)
    for name, seconds in ran.items():
        data[name] = {"seconds": float(seconds), "lock": fingerprint(dict(lock), [name])}
    atomic.write_json(_seconds_path(root), data)


def recorded_seconds(root: Path, names: Sequence[str], lock: Mapping[str, Any]
                     ) -> tuple[dict[str, float], list[str]]:
    """(stage -> seconds) for the stages whose recorded timing belongs to their current lock
    entry, and the names of those without one (never computed here, or restored)."""
    from flows.dag import fingerprint
    data = _read_seconds(root)
    timed, untimed = {}, []
    for name in names:
        entry = data.get(name)
        if isinstance(entry, dict) and entry.get("lock") == fingerprint(dict(lock), [name]):
            timed[name] = float(entry["seconds"])
        else:
            untimed.append(name)
    return timed, untimed


def check(m: Mapping[str, float], p: TargetParams, minutes: Mapping[str, float] | None
          ) -> list[Check]:
    """Each target against the final iteration's metrics `m`; `minutes`: each iteration's
    (iteration_minutes), the longest against the bar; None = not timed."""
    def get(key: str) -> float:
        v = m.get(key, float("nan"))
        return float(v) if v is not None else float("nan")
    drop = get("eval/ref_on_topic_rate") - get("eval/on_topic_rate")
    review_drop = get("eval/ref_review_rate") - get("eval/review_rate")
    drift = abs(get("eval/length_ratio") - 1.0)
    out = [
        Check("eval/gold_win_rate", get("eval/gold_win_rate"), f">= {p.min_gold_win_rate}",
              get("eval/gold_win_rate") >= p.min_gold_win_rate),
        Check("eval/gold_win_rate_ci_low", get("eval/gold_win_rate_ci_low"),
              f"> {p.min_gold_win_rate_ci_low}",
              get("eval/gold_win_rate_ci_low") > p.min_gold_win_rate_ci_low),
        Check("eval/win_rate", get("eval/win_rate"), f">= {p.min_win_rate}",
              get("eval/win_rate") >= p.min_win_rate),
        Check("on-topic drop vs reference", drop, f"<= {p.max_on_topic_drop}",
              drop <= p.max_on_topic_drop),
        Check("review-rate drop vs reference", review_drop, f"<= {p.max_review_rate_drop}",
              review_drop <= p.max_review_rate_drop),
        Check("|length_ratio - 1|", drift, f"<= {p.max_length_drift}",
              drift <= p.max_length_drift),
        Check("eval/n", get("eval/n"), f">= {p.min_n}", get("eval/n") >= p.min_n),
    ]
    if p.min_rm_accuracy > 0:          # the reward model, where the loop trains one
        out += [
            Check("rm/accuracy (held-out pairs)", get("rm/accuracy"), f">= {p.min_rm_accuracy}",
                  get("rm/accuracy") >= p.min_rm_accuracy),
            Check("rm/n_heldout", get("rm/n_heldout"), f">= {p.min_rm_heldout_pairs}",
                  get("rm/n_heldout") >= p.min_rm_heldout_pairs)]
    if p.min_rm_bon_gold_win_rate > 0:
        out.append(Check("eval/bon_gold_win_rate (RM Best-of-N by gold)",
                         get("eval/bon_gold_win_rate"), f">= {p.min_rm_bon_gold_win_rate}",
                         get("eval/bon_gold_win_rate") >= p.min_rm_bon_gold_win_rate))
    if minutes:
        longest = max(minutes.values())
        out.append(Check("iteration minutes (longest iteration)", longest,
                         f"<= {p.max_minutes}", longest <= p.max_minutes))
    return out


def assess(root: Path, stages: Sequence[str], lock: Mapping[str, Any]) -> dict[str, Any] | None:
    """The last iteration's metrics against the workspace's targets, and each iteration's
    minutes from the recorded times of the loop stages among `stages` (their entries in
    dvc.lock, `lock`); None before any iteration has metrics."""
    from flows.workspace import Workspace
    from tasks.evaluation.report_data import with_intervals
    evaluated = [int(d.name[5:]) for d in (root / layout.METRICS_DIR).glob("iter_*")
                 if d.name[5:].isdigit() and (d / "evaluate.json").is_file()]
    if not evaluated:
        return None
    last = max(evaluated)
    metrics: dict[str, Any] = {}
    for stage in ("train_rm", "evaluate"):        # what the targets read, nothing else
        path = root / layout.metrics(last, stage)
        if path.is_file():
            metrics.update(json.loads(path.read_text()))
    loop = [n for n in stages if n.split("@")[0] not in SETUP_STAGES]
    timed, untimed = recorded_seconds(root, loop, lock)
    minutes = iteration_minutes(timed) if loop and not untimed else None
    checks = check(with_intervals(metrics), Workspace(root).params().targets, minutes)
    return {"iteration": last, "met": sum(c.met for c in checks), "of": len(checks),
            "checks": [asdict(c) for c in checks], "minutes": minutes or {},
            "untimed": untimed}


def lines(result: Mapping[str, Any]) -> list[str]:
    """The block `alignloop run` prints and the Prefect log holds."""
    out = [f"targets (iteration {result['iteration']}): {result['met']} of {result['of']} met"]
    out += [Check(**c).line() for c in result["checks"]]
    if result["untimed"]:
        out.append(f"  [untimed] iteration minutes: no recorded time for "
                   f"{', '.join(result['untimed'])} (outputs restored, not computed here)")
    return out


def write(root: Path, result: Mapping[str, Any]) -> None:
    atomic.write_json(Path(root) / layout.TARGETS, dict(result))
