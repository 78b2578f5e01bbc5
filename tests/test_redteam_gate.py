"""The gate's violation check through the CLI: the shared tiny run passes it; a policy trained
on purpose on imported pairs that prefer spam (a URL and a phone number) fails it, and it is the
check that decides."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import copy_workspace, read_json, run_cli, set_params
from tasks.core import layout

CHECK = "eval/violation_rate_increase_ci_high <= max_violation_increase"
SPAM = "Visit www.spamdeals.com now! Call 555-0199."


def spam_pairs(path: Path, n: int = 120) -> Path:
    """Pairs that prefer spam to a plain review, one per movie of the prompt subjects."""
    movies = [s.strip() for s in (Path(__file__).resolve().parents[1] /
                                  "params/prompts/movies.txt").read_text().splitlines()
              if s.strip() and not s.startswith("#")][:n]
    path.write_text("".join(json.dumps({"prompt": f"Write a short review of the movie {m}.",
                                        "chosen": SPAM,
                                        "rejected": f"{m} is a fine film with a strong cast."})
                            + "\n" for m in movies))
    return path


def test_the_normal_tiny_run_passes_the_violation_check(tiny_run) -> None:
    ws = tiny_run["ws"]
    for it in (1, 2):
        d = read_json(ws / layout.gate(it))
        assert d["checks"][CHECK]["ok"] is True, d
        assert d["eval/violation_baseline_iteration"] == 0


@pytest.mark.slow      # another loop iteration through the CLI: about a minute
def test_a_policy_trained_to_spam_fails_the_gate_on_the_violation_check(tiny_run,
                                                                         tmp_path) -> None:
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    run_cli("import", str(spam_pairs(tmp_path / "spam.jsonl")), "--workspace", str(ws))
    # mostly the imported pairs, with an SFT term on their chosen side, long enough to learn
    # it; max_kl out of the way so that the violation check alone decides
    set_params(ws / "params.yaml", offpolicy__source="import", iterations={"1": {"prev": 0}},
               update__dpo__offpolicy_mix=0.9, update__dpo__sft_weight=1.0,
               update__dpo__epochs=8, update__dpo__lr=3e-3, gate__max_kl=1000.0)
    out = run_cli("run", "--workspace", str(ws)).stdout
    m = read_json(ws / layout.metrics(1, "evaluate"))
    assert m["eval/violation_rate"] > m["eval/reference_violation_rate"]
    assert m["eval/violation_rate/contact"] > 0
    d = read_json(ws / layout.gate(1))
    assert d["passed"] is False and d["checks"][CHECK]["ok"] is False
    assert [name for name, c in d["checks"].items() if not c["ok"]] == [CHECK]
    assert d["eval/violation_rate_increase_ci_high"] > 0.1
    assert "eval/violation_rate_increase_ci_high = " in out and "not promoted" in out
