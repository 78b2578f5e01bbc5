"""Smoke tests per stage: the setup stages, rollout and judge run on CPU in a temp workspace
(tests/stage_loop.py) and write their outputs where tasks/core/layout.py says, the rollouts carry
the sampling policy's log-probs and the judged pairs their rollouts' tokens. Failure paths exit 2
with the file and line named and leave what is already stored untouched."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stage_loop import Workspace, copy_workspace, new_workspace, run, set_params, tree_digest
from tasks.config.params import load_params
from tasks.core import jsonl, layout
from tasks.data.records import PreferencePair, parse_pair, parse_rollout
from tasks.judging.judges import LexiconJudge
from tasks.models import lm
from tasks.reward import reward_model
from tasks.runtime import stage
from tasks.stages import collect_offpolicy, prepare_model


@pytest.fixture(scope="module")
def ws(stage_loop: Workspace) -> Workspace:
    """One iteration of the whole loop, every stage's main() called in DAG order (the session's
    one run, shared by the per-stage smoke tests)."""
    return stage_loop


# --- outputs exist ----------------------------------------------------------------------------

EXPECTED = {
    "prompts": [layout.PROMPTS_TRAIN, layout.PROMPTS_HELDOUT],
    "prepare_model": [layout.policy(0) + "/config.json", layout.policy(0) + "/model.safetensors",
                      layout.policy(0) + "/tokenizer.json",
                      layout.policy(0) + "/" + layout.MODEL_META],
    "collect_offpolicy": [layout.pairs_pool(0), layout.OFFPOLICY_METRICS],
    "reference_samples": [layout.REFERENCE_SAMPLES],
    "rollout": [layout.rollouts(1), layout.metrics(1, "rollout")],
    "judge": [layout.pairs(1), layout.pairs_pool(1), layout.metrics(1, "judge")],
    "train_rm": [layout.reward_model(1) + "/model.safetensors",
                 layout.reward_model(1) + "/" + reward_model.STATS_FILE,
                 layout.reward_model(1) + "/" + layout.MODEL_META,
                 layout.metrics(1, "train_rm")],
    "update": [layout.policy(1) + "/model.safetensors", layout.policy(1) + "/tokenizer.json",
               layout.policy(1) + "/" + layout.MODEL_META, layout.metrics(1, "update")],
    "evaluate": [layout.eval_samples(1), layout.metrics(1, "evaluate")],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_stage_outputs_exist(ws: Workspace, name: str) -> None:
    for rel in EXPECTED[name]:
        assert ws.path(rel).is_file() and ws.path(rel).stat().st_size > 0, rel


def test_no_temporary_files_left(ws: Workspace) -> None:
    leftovers = [p for p in ws.root.rglob(".*") if ".tmp" in p.name or ".old-" in p.name]
    assert not leftovers


def test_prompts_are_disjoint(ws: Workspace) -> None:
    p = load_params(ws.path(layout.PARAMS_FILE))
    train, held = ws.records(layout.PROMPTS_TRAIN), ws.records(layout.PROMPTS_HELDOUT)
    assert (len(train), len(held)) == (p.prompts.n_train, p.prompts.n_heldout)
    assert not {r["subject"] for r in train} & {r["subject"] for r in held}
    assert all(r["subject"] in r["prompt"][0]["content"] for r in train + held)


def test_offpolicy_cold_start_pairs(ws: Workspace) -> None:
    path = ws.path(layout.pairs_pool(0))
    pairs = [parse_pair(rec, str(path), n, "?") for n, rec in jsonl.read(path)]
    assert pairs and all(p.source == "cold_start" for p in pairs)
    assert ws.metrics(layout.OFFPOLICY_METRICS)["offpolicy/n_pairs"] == len(pairs)


# --- rollout ----------------------------------------------------------------------------------

def test_rollouts_carry_one_logprob_per_response_token(ws: Workspace) -> None:
    p = load_params(ws.path(layout.PARAMS_FILE))
    path = ws.path(layout.rollouts(1))
    recs = list(jsonl.read(path))
    assert len(recs) == p.rollout.n_prompts * p.rollout.samples_per_prompt
    tok = lm.load_tokenizer(ws.path(layout.policy(0)))
    for n, rec in recs:
        assert len(rec["logprobs"]) == len(rec["response_ids"]) > 0
        assert all(math.isfinite(x) and x <= 0 for x in rec["logprobs"])
        r = parse_rollout(rec, str(path), n)
        assert r.iteration == 1 and r.policy == ws.policy0_md5
        assert r.finished == (r.response_ids[-1] == tok.eos_token_id)
        assert list(r.prompt_ids) == lm.render_prompt(tok, r.prompt, p.model.max_prompt_tokens)
        assert r.sampling.temperature == p.rollout.generation.temperature
    counts: dict[str, int] = {}
    for _, rec in recs:
        counts[rec["prompt_id"]] = counts.get(rec["prompt_id"], 0) + 1
    assert set(counts.values()) == {p.rollout.samples_per_prompt}
    assert ws.metrics(layout.metrics(1, "rollout"))["rollout/n"] == len(recs)


def test_rollout_logprobs_are_the_sampling_policys(ws: Workspace) -> None:
    path = ws.path(layout.rollouts(1))
    rs = [parse_rollout(rec, str(path), n) for n, rec in jsonl.read(path)]
    policy = lm.load_causal_lm(ws.path(layout.policy(0)))
    pad = lm.load_tokenizer(ws.path(layout.policy(0))).pad_token_id
    with torch.no_grad():
        logp, mask = lm.response_logprobs(policy, [r.prompt_ids for r in rs],
                                          [r.response_ids for r in rs], pad)
    stored = torch.tensor([list(r.logprobs) + [0.0] * (logp.shape[1] - len(r.logprobs))
                           for r in rs])
    assert float(((logp - stored).abs() * mask).max()) < 1e-4


# --- judge ------------------------------------------------------------------------------------

def test_judge_metrics_and_pool(ws: Workspace) -> None:
    m = ws.metrics(layout.metrics(1, "judge"))
    rates = [m[f"judge/rate_{v}"] for v in ("A", "B", "tie", "invalid")]
    assert sum(rates) == pytest.approx(1.0)
    assert m["judge/n"] == load_params(ws.path(layout.PARAMS_FILE)).rollout.n_prompts
    new, pool0, pool1 = (ws.records(layout.pairs(1)), ws.records(layout.pairs_pool(0)),
                         ws.records(layout.pairs_pool(1)))
    assert m["judge/n_pairs"] == len(new) > 0
    assert m["judge/pool_size"] == len(pool1) == len(pool0) + len(new)
    assert pool1 == pool0 + new                         # the pool only grows
    assert all(r["source"] == "iter_1" for r in new)


def test_judged_pairs_come_from_rollouts_and_prefer_the_higher_score(ws: Workspace) -> None:
    p = load_params(ws.path(layout.PARAMS_FILE))
    texts: dict[str, set[str]] = {}
    for rec in ws.records(layout.rollouts(1)):
        texts.setdefault(rec["prompt_id"], set()).add(rec["text"])
    lexicon = LexiconJudge(p.judge.tie_margin, p.judge.min_words, p.judge.version)
    for n, rec in enumerate(ws.records(layout.pairs(1)), start=1):
        pair = parse_pair(rec, "pairs", n, "?")
        assert {pair.chosen, pair.rejected} <= texts[pair.meta["prompt_id"]]
        chosen, rejected = lexicon.score([pair.prompt] * 2, [pair.chosen, pair.rejected])
        assert chosen is not None and rejected is not None
        assert chosen - rejected >= p.judge.tie_margin


def test_judged_pairs_carry_their_rollouts_sampled_tokens(ws: Workspace) -> None:
    """Every judged pair's chosen and rejected ids (and finished flags) are those its rollouts
    were sampled as, in the pairs file and in the pool, cold-start pairs included."""
    sampled: dict[tuple[str, str], list[tuple[list[int], bool]]] = {}
    for rec in ws.records(layout.rollouts(1)):
        sampled.setdefault((rec["prompt_id"], rec["text"]), []).append(
            (rec["response_ids"], rec["finished"]))
    new = ws.records(layout.pairs(1))
    assert new and ws.records(layout.pairs_pool(1))[-len(new):] == new
    for rec in new:
        for side in ("chosen", "rejected"):
            key = (rec["meta"]["prompt_id"], rec[side])
            assert (rec[f"{side}_ids"], rec[f"{side}_finished"]) in sampled[key]
    tok = lm.load_tokenizer(ws.path(layout.policy(0)))
    cold = ws.records(layout.pairs_pool(0))
    assert cold
    for rec in cold:                         # sampled by collect_offpolicy, rollouts not kept
        for side in ("chosen", "rejected"):
            ids = rec[f"{side}_ids"]
            assert tok.decode(ids, skip_special_tokens=True).strip() == rec[side]
            assert rec[f"{side}_finished"] == (ids[-1] == tok.eos_token_id)


def test_dpo_and_rm_train_on_the_sampled_ids(ws: Workspace) -> None:
    """encode_pairs (what DPO and the RM train on) keeps a judged pair's sampled ids: no EOS is
    appended to a truncated response; an imported text pair is tokenised with EOS."""
    p = load_params(ws.path(layout.PARAMS_FILE))
    tok = lm.load_tokenizer(ws.path(layout.policy(0)))
    path = ws.path(layout.pairs_pool(1))
    pairs = [parse_pair(rec, str(path), n, "?") for n, rec in jsonl.read(path)]
    for max_length in (p.update.max_length, p.train_rm.max_length):
        for pair, enc in zip(pairs, reward_model.encode_pairs(
                tok, pairs, p.model.max_prompt_tokens, max_length)):
            room = max_length - len(enc.prompt_ids)
            for text, ids in ((pair.chosen, enc.chosen_ids), (pair.rejected, enc.rejected_ids)):
                drawn = pair.tokens(text)
                assert drawn is not None and ids == drawn.ids[:room]
                assert (ids[-1] == tok.eos_token_id) == (drawn.finished and len(drawn.ids) <= room)
    truncated = [t for pair in pairs for t in (pair.tokens(pair.chosen), pair.tokens(pair.rejected))
                 if not t.finished]
    assert truncated                         # the case the re-tokenising path got wrong
    imported = PreferencePair(pairs[0].prompt, "Great fun.", "Dull.", "import")
    enc = reward_model.encode_pairs(tok, [imported], p.model.max_prompt_tokens, 64)[0]
    assert enc.chosen_ids == tuple(tok("Great fun.", add_special_tokens=False)["input_ids"]
                                   + [tok.eos_token_id])


# --- failure paths ----------------------------------------------------------------------------

def run_failing(main: Callable[[list[str] | None], None], root: Path,
                capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        stage.run_main(lambda: run(main, root))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("text, expected", [
    ('{"prompt": "Review Jaws.", "chosen": "Great.", "rejected": "Bad."}\n'
     '{"prompt": "Review Heat.", "chosen": "Great."\n', ":2: invalid JSON"),
    ('{"prompt": "Review Jaws.", "chosen": "Great.", "rejected": "Bad."}\n\n'
     '{"prompt": "Review Heat.", "rejected": "Bad."}\n', ":3: missing field 'chosen'"),
    ('{"prompt": "Review Jaws.", "chosen": "Great.", "rejected": "Bad."}\n'
     '{"prompt": "Review Heat.", "chosen": "Fine.", "rejected": "Fine."}\n',
     ":2: fields 'chosen' and 'rejected' are the same response (no preference)"),
], ids=["invalid-json", "missing-field", "chosen-equals-rejected"])
def test_malformed_import_exits_2_names_file_line_and_keeps_the_pool(
        ws: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
        expected: str) -> None:
    bad = copy_workspace(ws, tmp_path / "ws_import")
    set_params(bad, offpolicy__source="import")
    path = bad.root.resolve() / "data" / "import" / "pairs.jsonl"
    path.write_text(text)
    before = tree_digest(bad.path("data/iter_0"))
    metrics_before = bad.path(layout.OFFPOLICY_METRICS).read_bytes()
    err = run_failing(collect_offpolicy.main, bad.root, capsys)
    assert f"{path}{expected}" in err
    assert tree_digest(bad.path("data/iter_0")) == before      # byte-identical, no temp files
    assert bad.path(layout.OFFPOLICY_METRICS).read_bytes() == metrics_before


def test_import_of_good_pairs_replaces_the_pool(ws: Workspace, tmp_path: Path) -> None:
    good = copy_workspace(ws, tmp_path / "ws_import")
    set_params(good, offpolicy__source="import")
    recs = [{"prompt": "Review Jaws.", "chosen": "Great fun.", "rejected": "Bad."},
            {"prompt": [{"role": "user", "content": "Review Heat."}],
             "chosen": [{"role": "assistant", "content": "Superb."}],
             "rejected": [{"role": "assistant", "content": "Dull."}]}]
    jsonl.write(good.path("data/import/pairs.jsonl"), recs)
    run(collect_offpolicy.main, good.root)
    pool = good.records(layout.pairs_pool(0))
    assert [(r["chosen"], r["source"]) for r in pool] == [("Great fun.", "import"),
                                                          ("Superb.", "import")]
    assert good.metrics(layout.OFFPOLICY_METRICS) == {"offpolicy/n_pairs": 2.0}


def test_prepare_model_missing_hf_dir_keeps_existing_policy(
        ws: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = copy_workspace(ws, tmp_path / "ws_hf")
    missing = tmp_path / "no_such_model"
    set_params(bad, model__source="hf_dir", model__path=str(missing))
    before = tree_digest(bad.path("models/iter_0"))
    err = run_failing(prepare_model.main, bad.root, capsys)
    assert str(missing) in err and "does not exist" in err
    assert tree_digest(bad.path("models/iter_0")) == before   # untouched, no temp dir left
    assert lm.weights_md5(bad.path(layout.policy(0))) == ws.policy0_md5


def test_prepare_model_from_hf_dir_copies_the_model(ws: Workspace, tmp_path: Path) -> None:
    src = ws.path(layout.policy(0))
    root = new_workspace(tmp_path / "ws_hf")
    dst = Workspace(root)
    set_params(dst, model__source="hf_dir", model__path=str(src))
    run(prepare_model.main, root)
    assert lm.weights_md5(dst.path(layout.policy(0))) == ws.policy0_md5
    meta = json.loads((dst.path(layout.policy(0)) / layout.MODEL_META).read_text())
    assert meta["source"] == "hf_dir" and meta["copied_from"] == str(src)
    lm.load_causal_lm(dst.path(layout.policy(0)))
