"""Pairwise judges in the stages, on the tiny model: the `llm` judge (verdict log-probs of the
tiny policy itself) through collect_offpolicy and judge, and the `http` judge against a local
OpenAI-style server: template md5 in every pair's meta, judge metrics, and a rerun of the judge
stage answered from the verdict cache."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import set_params
from tasks.config.params import load_params
from tasks.core import jsonl, layout
from tasks.judging.judge_llm import LocalLMBackend
from tasks.judging.pairwise import JudgeStats
from tasks.stages import collect_offpolicy, judge, prepare_model, prompts, rollout

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = "params/judges/pairwise_review.txt"


def run(main, root: Path, it: int = 0) -> None:
    main(["--root", str(root), "--it", str(it)])


def set_judge(root: Path, **judge_keys: object) -> None:
    params = root / layout.PARAMS_FILE
    data = yaml.safe_load(params.read_text())
    data["judge"].update(judge_keys)
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    load_params(params)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny workspace up to rollout@1 (one iteration, 4 prompts x 4 samples)."""
    root = tmp_path_factory.mktemp("pairwise-stages") / "base"
    for name in ("prompts", "judges"):
        shutil.copytree(REPO / "params" / name, root / "params" / name)
    (root / layout.IMPORT_DIR).mkdir(parents=True)
    params = root / layout.PARAMS_FILE
    params.write_text((REPO / "params" / "tiny.yaml").read_text())
    set_params(params, iterations={"1": {"prev": 0}}, offpolicy__n_prompts=4,
               rollout__n_prompts=4)
    for main in (prompts.main, prepare_model.main, collect_offpolicy.main):
        run(main, root)
    run(rollout.main, root, 1)
    return root


@pytest.fixture(scope="module")
def llm_workspace(base: Path) -> Path:
    root = base.parent / "llm"
    shutil.copytree(base, root)
    set_judge(root, kind="llm", model="models/iter_0/policy", decoding="logprob",
              comparisons_per_prompt=3)
    run(collect_offpolicy.main, root)
    run(judge.main, root, 1)
    return root


class Consistent(BaseHTTPRequestHandler):
    """An OpenAI-style judge that prefers the shorter response (swap-consistent)."""
    requests = 0

    def do_POST(self) -> None:      # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][0]["content"]
        a = text.split("Response A:\n")[1].split("\n\nResponse B:")[0]
        b = text.split("Response B:\n")[1].split("\n\nWhich response")[0]
        verdict = "tie" if len(a) == len(b) else "A" if len(a) < len(b) else "B"
        type(self).requests += 1
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}],
                           "usage": {"prompt_tokens": 50, "completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_workspace(base: Path) -> Iterator[Path]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Consistent)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    root = base.parent / "http"
    shutil.copytree(base, root)
    set_judge(root, kind="http", model="judge-m", comparisons_per_prompt=6, pool_pairs="all")
    old = os.environ.get("ALIGNLOOP_JUDGE_URL")
    os.environ["ALIGNLOOP_JUDGE_URL"] = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    try:
        run(judge.main, root, 1)
        yield root
    finally:
        if old is None:
            os.environ.pop("ALIGNLOOP_JUDGE_URL", None)
        else:
            os.environ["ALIGNLOOP_JUDGE_URL"] = old
        srv.shutdown()
        srv.server_close()


def test_logprob_backend_is_deterministic_and_always_answers(base: Path) -> None:
    be = LocalLMBackend(base / layout.policy(0), "logprob", 4)
    texts = ["Which is better? A or B", "Another question entirely"]
    first, second = be.ask_many(texts, JudgeStats()), be.ask_many(texts, JudgeStats())
    assert first == second and all(r.verdict in ("A", "B", "tie") for r in first)
    greedy = LocalLMBackend(base / layout.policy(0), "greedy", 3)
    stats = JudgeStats()
    replies = greedy.ask_many(texts, stats)
    assert [r.verdict for r in replies] == [r.verdict for r in greedy.ask_many(texts, stats)]
    assert stats.requests == 4 and stats.prompt_tokens > 0


METRICS = ("judge/rate_invalid", "judge/rate_tie", "judge/position_bias_rate", "judge/requests",
           "judge/tokens", "judge/seconds", "judge/cache_hits", "judge/cache_misses",
           "judge/lexicon_agreement")


def test_llm_judge_stage_reports_its_rates(llm_workspace: Path) -> None:
    """A random tiny model as judge: it says the same word whatever the order, so its position
    bias shows and its verdicts are ties: measured, not hidden."""
    m = json.loads((llm_workspace / layout.metrics(1, "judge")).read_text())
    assert all(k in m for k in METRICS)
    assert m["judge/n"] == 4 * 3 and m["judge/requests"] == m["judge/cache_misses"] > 0
    assert m["judge/rate_tie"] + m["judge/rate_A"] + m["judge/rate_B"] == pytest.approx(1.0)
    md5 = hashlib.md5((REPO / TEMPLATE).read_bytes()).hexdigest()
    for _, p in jsonl.read(llm_workspace / layout.pairs_pool(1)):
        assert p["meta"]["judge"].startswith("llm:policy@") and \
            f"|template={md5}|logprob" in p["meta"]["judge"] or p["source"] == "cold_start"


def test_http_judge_stage_records_template_md5_and_metrics(http_workspace: Path) -> None:
    md5 = hashlib.md5((REPO / TEMPLATE).read_bytes()).hexdigest()
    pairs = [r for _, r in jsonl.read(http_workspace / layout.pairs(1))]
    pool = [r for _, r in jsonl.read(http_workspace / layout.pairs_pool(1))
            if r["source"] == "iter_1"]
    assert pairs and len(pool) >= len(pairs)
    assert {p["meta"]["judge"] for p in pool} == \
        {f"http:judge-m|template={md5}|greedy,max_tokens=4"}
    assert all(len(p["chosen"]) < len(p["rejected"]) for p in pool)
    m = json.loads((http_workspace / layout.metrics(1, "judge")).read_text())
    assert all(k in m for k in METRICS)
    assert m["judge/requests"] == Consistent.requests > 0 and m["judge/failed"] == 0
    assert m["judge/position_bias_rate"] == 0.0 and m["judge/tokens"] == 51 * m["judge/requests"]


def test_http_judge_rerun_is_answered_from_the_cache(http_workspace: Path) -> None:
    before, asked = (http_workspace / layout.pairs(1)).read_bytes(), Consistent.requests
    run(judge.main, http_workspace, 1)
    m = json.loads((http_workspace / layout.metrics(1, "judge")).read_text())
    assert Consistent.requests == asked and m["judge/requests"] == 0
    assert m["judge/cache_hits"] == m["judge/comparisons"] > 0 and m["judge/cache_misses"] == 0
    assert (http_workspace / layout.pairs(1)).read_bytes() == before


def test_http_judge_reports_its_agreement_with_the_audit_labels(http_workspace: Path) -> None:
    """People audited some earlier pairs (audit/labels.jsonl): the judge stage shows each one to
    the judge in both orders and reports how often it sides with the person. The server prefers
    the shorter response, so its agreement is known exactly from the labels."""
    from tasks.data.audit import pair_id
    from tasks.data.records import parse_pair
    path = http_workspace / layout.pairs_pool(0)
    pool = [parse_pair(r, str(path), n, "unknown") for n, r in jsonl.read(path)]
    sided = [p for p in pool if len(p.chosen) != len(p.rejected)]
    assert len(sided) >= 4
    verdicts = ["chosen_ok", "swap", "drop", "chosen_ok"] * len(sided)
    labels = [{"pair_id": pair_id(p), "verdict": v} for p, v in zip(sided, verdicts)]
    (http_workspace / layout.AUDIT_LABELS).write_text(
        "".join(json.dumps(x) + "\n" for x in labels))
    run(judge.main, http_workspace, 1)
    m = json.loads((http_workspace / layout.metrics(1, "judge")).read_text())
    kept = [(p, v) for p, v in zip(sided, verdicts) if v != "drop"]
    agree = [(len(p.chosen) < len(p.rejected)) == (v == "chosen_ok") for p, v in kept]
    assert m["judge/audit_labelled_n"] == len(kept) == m["judge/audit_agreement_n"]
    assert m["judge/audit_agreement"] == pytest.approx(sum(agree) / len(agree))
    assert 0 < m["judge/audit_agreement"] < 1


@pytest.fixture(scope="module")
def user_rm(base: Path) -> Path:
    """A user's own reward model from elsewhere: an HF sequence-classification model with one
    label and its tokenizer, outside the workspace (here the tiny backbone with a seeded head)."""
    import torch
    import transformers
    out = base.parent / "user-rm"
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        base / layout.policy(0), num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(base / layout.policy(0)).save_pretrained(out)
    return out


def test_reward_model_judge_scores_as_the_models_own_forward(base: Path, user_rm: Path) -> None:
    """The judge's reward of (prompt, response) is the sequence-classification model's own
    output on the chat-rendered prompt followed by the response and EOS."""
    import torch
    import transformers

    from tasks.data.records import parse_rollout
    from tasks.judging.judge_rm import RewardModelJudge
    from tasks.models import lm
    path = base / layout.rollouts(1)
    rollouts = [parse_rollout(r, str(path), n) for n, r in jsonl.read(path)][:6]
    judge = RewardModelJudge(user_rm, 0.05, 1, 512)
    got = judge.score([r.prompt for r in rollouts], [r.text for r in rollouts])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(user_rm).eval()
    tok = lm.load_tokenizer(user_rm)
    for r, g in zip(rollouts, got):
        ids = lm.render_prompt(tok, r.prompt, 512) + lm.encode_response(tok, r.text, 512)
        with torch.no_grad():
            want = float(model(torch.tensor([ids])).logits[0, 0])
        assert g == pytest.approx(want, abs=1e-4)
    assert len(set(got)) == len(got)


def test_reward_model_judge_stage_pairs_best_against_worst(base: Path, user_rm: Path) -> None:
    """judge.kind: reward_model through the judge stage: per prompt the highest-reward sample is
    chosen over the lowest; the pairs name the model and its weights' md5."""
    from tasks.data.records import parse_rollout
    from tasks.judging.judge_rm import RewardModelJudge, rm_md5
    root = base.parent / "rm-judge"
    shutil.copytree(base, root)
    set_judge(root, kind="reward_model", model=str(user_rm))
    run(judge.main, root, 1)
    pairs = [r for _, r in jsonl.read(root / layout.pairs(1))]
    path = root / layout.rollouts(1)
    rollouts = [parse_rollout(r, str(path), n) for n, r in jsonl.read(path)]
    scorer = RewardModelJudge(user_rm, 0.05, 1, 512)
    by_prompt: dict[str, list[tuple[float, str]]] = {}
    for r, s in zip(rollouts, scorer.score([r.prompt for r in rollouts],
                                           [r.text for r in rollouts])):
        by_prompt.setdefault(r.prompt_id, []).append((s, r.text))
    assert len(pairs) == len(by_prompt)
    for p in pairs:
        scored = sorted(by_prompt[p["meta"]["prompt_id"]])
        score = {text: s for s, text in scored}
        # the stage scores each prompt's samples in a batch of their own, this all at once:
        # the scores agree to rounding (CPU-dependent bits), so a near-tie may go either way
        assert p["meta"]["score_chosen"] == pytest.approx(score[p["chosen"]], abs=1e-4)
        assert p["meta"]["score_rejected"] == pytest.approx(score[p["rejected"]], abs=1e-4)
        assert score[p["chosen"]] >= scored[-1][0] - 1e-5, (p["chosen"], scored)
        assert score[p["rejected"]] <= scored[0][0] + 1e-5, (p["rejected"], scored)
        assert p["meta"]["judge"] == f"reward_model:user-rm@{rm_md5(user_rm)}"
    m = json.loads((root / layout.metrics(1, "judge")).read_text())
    assert m["judge/n_pairs"] == len(pairs) and m["judge/rate_A"] == 1.0


def test_reward_model_judge_refuses_a_model_that_is_not_one(base: Path) -> None:
    from tasks.judging.judge_rm import RewardModelJudge
    from tasks.models.lm import ModelError
    with pytest.raises(ModelError, match="not a reward model"):
        RewardModelJudge(base / layout.policy(0), 0.05, 1, 512)


def test_reward_model_judge_on_two_ray_workers_writes_the_same_bytes(
        base: Path, user_rm: Path, ray_address: str) -> None:
    """judge.workers: 2 with the reward_model judge: two Ray tasks, each loading the RM from
    its directory and scoring a shard of the prompts, give the one-process pairs, pool and
    metrics byte for byte (the scores' bits included). That holds on every CPU because each
    worker scores whole prompts (the same batches, so the same shapes) on the stage's torch
    thread count (`judge_shard`), on this machine's kernels."""
    outs = (layout.pairs(1), layout.pairs_pool(1), layout.metrics(1, "judge"))
    written = []
    for workers in (1, 2):
        root = base.parent / f"rm-judge-workers-{workers}"
        shutil.copytree(base, root)
        set_judge(root, kind="reward_model", model=str(user_rm), workers=workers)
        run(judge.main, root, 1)
        written.append([(root / rel).read_bytes() for rel in outs])
    assert written[0] == written[1] and b"score_chosen" in written[0][0]
