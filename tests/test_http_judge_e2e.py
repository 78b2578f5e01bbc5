"""The http judge against a real OpenAI-compatible server: `alignloop judge-server start` runs
`transformers serve` on loopback with the tiny model, the tiny loop runs with judge.kind: http
through the CLI; requests reach the server, the judge's identity (template md5) is recorded,
its rates are in the metrics, and a judge stage killed midway resumes from its cached verdicts.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from tasks.core import layout
from tasks.judging.pairwise import CRASH_ENV

PROFILE = ROOT / "params" / "tiny-http-judge.yaml"
TEMPLATE = ROOT / "params" / "judges" / "pairwise_review.txt"
PAIRS = [{"prompt": f"Write a short review of {m}.", "chosen": f"{m} is a gripping, well-made "
          "film with a fine cast.", "rejected": "Thank you so much for asking! Let me know."}
         for m in ("Jaws", "Casablanca", "Alien", "Vertigo", "Psycho", "Heat", "Fargo", "Brazil")]


def posts(log: Path) -> int:
    return log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1" 200')


def cached(ws: Path) -> int:
    n = 0
    for db in (ws / layout.JUDGE_CACHE_DIR).glob("*.sqlite"):
        with sqlite3.connect(db, timeout=5) as c:
            n += c.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]
    return n


@pytest.mark.slow
def test_tiny_loop_with_the_http_judge_against_transformers_serve(tmp_path: Path) -> None:
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    model = tmp_path / "judge-model"
    save_tiny(TinyModelParams(), 1, model)
    ws = tmp_path / "ws"
    started = run_cli("judge-server", "start", "--model", str(model), "--port", "8791",
                      "--workspace", str(ws))
    try:
        info = json.loads(run_cli("judge-server", "status", "--workspace", str(ws)).stdout)
        assert info["healthy"] and info["model"] == str(model), started.stdout
        env = {"ALIGNLOOP_JUDGE_URL": info["url"]}
        log = Path(info["log"])
        src = tmp_path / "pairs.jsonl"
        src.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
        run_cli("import", str(src), "--workspace", str(ws))
        run_cli("run", "--params", str(PROFILE), "--workspace", str(ws), env=env)
        # 1. requests reached the server, the identity carries the template md5
        assert posts(log) > 0
        md5 = hashlib.md5(TEMPLATE.read_bytes()).hexdigest()
        identity = f"{model}|template={md5}|greedy,max_tokens=4"
        for db in (ws / layout.JUDGE_CACHE_DIR).glob("*.sqlite"):
            with sqlite3.connect(db) as c:
                assert c.execute("SELECT v FROM meta WHERE k = 'identity'").fetchone()[0] == \
                    identity
        for it in (1, 2):
            for _, pair in _read(ws / layout.pairs_pool(it)):
                if pair["source"].startswith("iter_"):
                    assert pair["meta"]["judge"] == f"http:{identity}"
            m = json.loads((ws / layout.metrics(it, "judge")).read_text())
            for key in ("judge/rate_invalid", "judge/rate_tie", "judge/position_bias_rate",
                        "judge/requests", "judge/tokens", "judge/cache_hits"):
                assert key in m, key
            assert m["judge/n"] == 12 * 3 and m["judge/failed"] == 0
        ev = json.loads((ws / layout.metrics(1, "evaluate")).read_text())
        assert "eval/judge_position_bias_rate" in ev and ev["eval/judge_requests"] > 0
        # 2. the judge stage killed (SIGKILL) after two batches of 16: those are kept
        for db in (ws / layout.JUDGE_CACHE_DIR).glob("*"):
            db.unlink()
        killed = run_cli("rerun", "judge@1", "--workspace", str(ws), check=False,
                         env={**env, CRASH_ENV: "2"})
        assert killed.returncode != 0
        kept = cached(ws)
        assert kept == 32, f"killed with {kept} of 72 verdicts cached"
        before = posts(log)
        run_cli("rerun", "judge@1", "--workspace", str(ws), env=env)
        m = json.loads((ws / layout.metrics(1, "judge")).read_text())
        assert m["judge/cache_hits"] >= kept and m["judge/cache_misses"] == 72 - m["judge/cache_hits"]
        assert posts(log) - before == m["judge/requests"] == m["judge/cache_misses"]
        # 3. a rerun with the same judge costs nothing
        run_cli("rerun", "judge@1", "--workspace", str(ws), env=env)
        m = json.loads((ws / layout.metrics(1, "judge")).read_text())
        assert m["judge/requests"] == 0 and m["judge/cache_hits"] == 72
    finally:
        run_cli("judge-server", "stop", "--workspace", str(ws), check=False)


def _read(path: Path):
    from tasks.core import jsonl
    return jsonl.read(path)
