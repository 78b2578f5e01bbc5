"""Rollouts and judging on Ray workers write what one process writes, byte for byte."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, run_cli
from tasks.config.params import JudgeParams, TinyModelParams
from tasks.core import layout
from tasks.core.errors import InputError
from tasks.data.records import Message
from tasks.judging.judge_factory import make_judge
from tasks.judging.labelling import judge_all
from tasks.models import lm, sampling
from tasks.models.tiny_model import save_tiny

TEXTS = ["Write a short review of Jaws (1975).", "Hi.", "What did you think of Heat?",
         "In two sentences: the acting and the ending of Alien.", "A film."]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ray") / "policy"
    out.mkdir()
    save_tiny(TinyModelParams(), 0, out)
    return out


def draw(policy: Path, workers: int, seed: int = 3) -> list[sampling.Sample]:
    """5 prompts x K = 4 in batches of 16: a batch split into 2 shards, then one of 4 rows
    that is not split (it runs on the process's 2 threads)."""
    tok = lm.load_tokenizer(policy)
    rows = [lm.render_prompt(tok, (Message("user", t),), 52) for t in TEXTS for _ in range(4)]
    kw = {"batch_size": 16, "max_new_tokens": 12, "eos_id": tok.eos_token_id,
          "pad_id": tok.pad_token_id, "temperature": 1.0, "top_p": 1.0,
          "generator": torch.Generator().manual_seed(seed)}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if workers == 0:                     # no Ray: the path every workers: 1 run takes
            return sampling.sample(lm.load_causal_lm(policy), rows, **kw)  # type: ignore[arg-type]
        return sampling.sample_on_workers(policy, rows, workers, **kw)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)


def as_bytes(samples: list[sampling.Sample]) -> bytes:
    return json.dumps([[s.response_ids, s.logprobs, s.finished] for s in samples]).encode()


def test_two_ray_workers_sample_byte_identical_to_one_process(ray_address: str,
                                                              policy: Path) -> None:
    alone = draw(policy, 0)
    assert [(len(s.prompts), s.threads) for s in sampling.plan(
        [[i] for i in range(5) for _ in range(4)], batch_size=16, max_new_tokens=1,
        generator=torch.Generator(), threads=2)] == [(8, 1), (8, 1), (4, 2)]
    # bits: each worker samples the plan's shards (same rows, uniforms, shapes and threads as
    # one process) on the same machine's kernels, so the same bits on every CPU
    assert as_bytes(draw(policy, 2)) == as_bytes(alone)
    assert as_bytes(draw(policy, 0, seed=4)) != as_bytes(alone)    # the check can fail


def test_a_worker_error_is_one_line(ray_address: str, tmp_path: Path) -> None:
    with pytest.raises(InputError) as e:
        draw(tmp_path / "missing", 2)
    assert "missing" in str(e.value) and "\n" not in str(e.value)


def test_judging_on_two_workers_equals_one_process(ray_address: str, tmp_path: Path) -> None:
    good = ["A wonderful, moving film with great acting.", "Dull and boring.",
            "It was fine I guess.", "Terrible, awful, a waste of time."]
    groups = [((Message("user", f"Review film {i}."),), good[i % 4:] + good[: i % 4],
               {"prompt_id": f"p{i}"}) for i in range(6)]
    jp = JudgeParams(pool_pairs="all", workers=2)
    judge = make_judge(jp, tmp_path)
    alone = judge_all(judge, groups, "iter_1", JudgeParams(pool_pairs="all"), tmp_path)
    spread = judge_all(judge, groups, "iter_1", jp, tmp_path)
    # the lexicon judge: plain Python, no torch kernels
    assert spread == alone and alone[0] and alone[1]


@pytest.mark.slow
def test_distributed_profile_through_the_cli_writes_the_tiny_run_bytes(
        tiny_run: dict[str, object], ray_address: str, tmp_path: Path) -> None:
    """`alignloop run --params params/tiny-distributed.yaml`: rollouts, judging and evaluate's
    samples on 2 Ray workers each (the session's cluster, through RAY_ADDRESS), the DPO update
    and the RM on 2 torchrun processes, everything else as tiny. What the initial policy
    samples and the judge pairs are tiny's bytes; the updates' losses are tiny's within 1e-5;
    one set of outputs, one commit and one registered policy per iteration."""
    ws, tiny = tmp_path / "ws", Path(str(tiny_run["ws"]))
    run_cli("run", "--params", str(ROOT / "params" / "tiny-distributed.yaml"),
            "--workspace", str(ws), env={"RAY_ADDRESS": ray_address})
    # bytes: these are sampled by the initial policy on the plan's shards and threads (both
    # runs: ALIGNLOOP_THREADS=2, this machine) and judged by the lexicon (plain Python); the
    # updates' weights are not (2 processes sum in another order): their losses to 1e-5
    for rel in ("data/reference/heldout_samples.jsonl", layout.pairs_pool(0),
                layout.rollouts(1), layout.pairs(1), layout.pairs_pool(1)):
        assert (ws / rel).read_bytes() == (tiny / rel).read_bytes(), rel
    for it in (1, 2):
        for name, keys in (("update", ("update/loss_first", "update/loss_last")),
                           ("train_rm", ("rm/loss_first", "rm/loss_last"))):
            got, want = (json.loads((root / layout.metrics(it, name)).read_text())
                         for root in (ws, tiny))
            for k in keys:
                assert got[k] == pytest.approx(want[k], abs=1e-5), (it, k)
        assert (ws / layout.policy(it) / "model.safetensors").is_file()
    outs = lambda root: {o["path"] for e in yaml.safe_load(
        (root / "dvc.lock").read_text())["stages"].values() for o in e["outs"]}
    assert outs(ws) == outs(tiny)                 # one set of outputs, the same ones
    log = subprocess.run(["git", "log", "--format=%s"], cwd=ws, capture_output=True,
                         text=True).stdout.splitlines()
    assert [m for m in log if m.startswith("alignloop: iteration")] == [
        "alignloop: iteration 2", "alignloop: iteration 1", "alignloop: iteration 0"]
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'alignloop-policy'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
