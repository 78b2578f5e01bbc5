"""A reward model whose backbone stayed frozen (`train_rm.epochs: 0`) stores its heads and the
backbone's record, not a copy of the backbone: the same scores, bit for bit, as the model saved
whole; a backbone with other weights refused in one line; an identity that follows the head and
the backbone; MLflow still loads it (tiny models, seconds)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_stage, tiny_stage_workspace
from tasks.core import jsonl, layout
from tasks.data.records import Message, PreferencePair
from tasks.models import lm, mlflow_model, model_card
from tasks.models.lm import ModelError
from tasks.reward import reward_model
from tasks.reward.reward_model import (
    BACKBONE_FILE,
    HEAD_FILE,
    BackboneRef,
    init_reward_model,
    load_reward_model,
    member_rewards,
    save_reward_model,
)
from tasks.runtime import stage

FILES = {HEAD_FILE, BACKBONE_FILE, reward_model.STATS_FILE, layout.MODEL_META, layout.MODEL_CARD,
         layout.MLMODEL, "conda.yaml", "python_env.yaml", "requirements.txt"}


def _pairs(n: int) -> list[PreferencePair]:
    return [PreferencePair((Message("user", f"Tell me about topic {i}."),),
                           f"A kind, helpful and clear answer about topic {i}.",
                           f"No. Topic {i} is boring.", "iter_1") for i in range(n)]


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny initial model and iteration 1's pool of hand-written pairs; train_rm not run."""
    from tasks.stages import prepare_model
    root = tiny_stage_workspace(tmp_path_factory.mktemp("rm_storage") / "ws")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        run_stage(prepare_model.main, root)
    jsonl.write(root / layout.pairs_pool(1), [p.to_record() for p in _pairs(24)])
    _train_rm_params(root, epochs=0, num_layers=1, pooling="mean", head_init="probe")
    yield root


def _train_rm_params(root: Path, **edits: object) -> None:
    """Set train_rm keys, those the tiny profile leaves at their defaults included."""
    import yaml

    from tasks.config.params import load_params
    path = root / layout.PARAMS_FILE
    data = yaml.safe_load(path.read_text())
    data["train_rm"].update(edits)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_params(path)


def _train_rm(base: Path, dst: Path, **edits: object) -> Path:
    from tasks.stages import train_rm
    root = Path(shutil.copytree(base, dst))
    if edits:
        _train_rm_params(root, **edits)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        run_stage(train_rm.main, root, 1)
    return root


@pytest.fixture(scope="module")
def single(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_rm(base, tmp_path_factory.mktemp("single") / "ws")


@pytest.mark.parametrize("ensemble", [1, 2])
def test_a_frozen_backbone_stores_the_heads_and_the_backbones_record(
        base: Path, single: Path, tmp_path: Path, ensemble: int) -> None:
    """No config, full weights or tokenizer: each member's head, the backbone named by its
    workspace path with its weights md5 and the depth kept, under 1% of the model saved
    whole; it loads with that depth and the backbone's own blocks."""
    root = single if ensemble == 1 else _train_rm(base, tmp_path / "ws", ensemble=2)
    rm = root / layout.reward_model(1)
    policy = root / layout.policy(0)
    heads = [rm] if ensemble == 1 else [rm / f"member_{i}" for i in range(ensemble)]
    assert {f.relative_to(rm).as_posix() for f in rm.rglob("*") if f.is_file()} == \
        (FILES - {HEAD_FILE}) | {(h / HEAD_FILE).relative_to(rm).as_posix() for h in heads}
    assert json.loads((rm / BACKBONE_FILE).read_text()) == {
        "base_path": layout.policy(0), "base_md5": lm.weights_md5(policy), "num_layers": 1}
    loaded = load_reward_model(rm)
    assert len(loaded) == ensemble and loaded.pooling == "mean"
    initial = load_file(str(policy / "model.safetensors"))
    for m in loaded.members:
        assert len(m.model.layers) == 1
        assert all(torch.equal(v, initial[f"model.{k}"]) for k, v in m.model.state_dict().items())
    whole = tmp_path / "whole"
    save_reward_model(list(loaded.members), whole)
    lm.load_tokenizer(policy).save_pretrained(whole)
    mlflow_model.write_mlflow_model(whole, "text-classification", {"model_path": "rm"})
    assert _bytes(rm) < 0.01 * _bytes(whole)
    card = (rm / model_card.CARD_FILE).read_text()
    assert "python_function flavor" in card and lm.weights_md5(policy) in card
    assert "LoRA" not in card                   # the base file is named as an adapter's


@pytest.mark.parametrize("ensemble, pooling", [(1, "mean"), (2, "last")])
def test_the_head_only_model_scores_exactly_as_the_model_saved_whole(
        tmp_path: Path, ensemble: int, pooling: str) -> None:
    """The same members saved both ways, loaded back: every member's rewards equal bit for bit
    (same CPU, same code path)."""
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    root = tmp_path / "ws"
    policy = root / layout.policy(0)
    policy.mkdir(parents=True)
    save_tiny(TinyModelParams(num_layers=2), 0, policy)
    members = [init_reward_model(policy, torch.Generator().manual_seed(i), 1)
               for i in range(ensemble)]
    stats = json.dumps({"pooling": pooling, "precision": "fp32", "mean": 0.0, "std": 1.0})
    whole, heads = tmp_path / "whole", root / layout.reward_model(1)
    save_reward_model(members, whole)
    save_reward_model(members, heads, BackboneRef(layout.policy(0), lm.weights_md5(policy), 1))
    for d in (whole, heads):
        (d / reward_model.STATS_FILE).write_text(stats)
    g = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(20, 900, (5,), generator=g).tolist()) for _ in range(6)]
    responses = [tuple(torch.randint(20, 900, (1 + i,), generator=g).tolist()) for i in range(6)]
    with torch.no_grad():
        a, b = (member_rewards(load_reward_model(d), prompts, responses, 0)
                for d in (whole, heads))
    assert a.shape == (ensemble, 6) and torch.equal(a, b)


def test_a_backbone_with_other_weights_or_none_is_refused_in_one_line(single: Path,
                                                                     tmp_path: Path) -> None:
    root = Path(shutil.copytree(single, tmp_path / "ws"))
    rm, policy = root / layout.reward_model(1), root / layout.policy(0)
    recorded = json.loads((rm / BACKBONE_FILE).read_text())["base_md5"]
    weights = load_file(str(policy / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
    save_file(weights, str(policy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError) as e:
        load_reward_model(rm)
    msg = str(e.value)
    assert msg.startswith(f"{rm / BACKBONE_FILE}: base_md5: {recorded} recorded")
    assert "\n" not in msg
    shutil.rmtree(policy)
    with pytest.raises(ModelError, match=r"_base\.json: base_path: .* holds no saved model$"):
        load_reward_model(rm)
    elsewhere = Path(shutil.copytree(rm, tmp_path / "copy" / "rm"))   # outside its workspace
    with pytest.raises(ModelError, match="holds no saved model"):
        load_reward_model(elsewhere)
    assert len(load_reward_model(elsewhere, root=single)) == 1     # its workspace named


@pytest.mark.parametrize("edit, field", [({"num_layers": "12"}, "num_layers"),
                                         ({"base_md5": ""}, "base_md5"),
                                         ({"base_path": "../elsewhere/policy"}, "base_path")])
def test_a_malformed_base_record_is_one_line_naming_the_field(single: Path, tmp_path: Path,
                                                             edit: dict, field: str) -> None:
    rm = Path(shutil.copytree(single / layout.reward_model(1), tmp_path / "rm"))
    record = json.loads((rm / BACKBONE_FILE).read_text())
    (rm / BACKBONE_FILE).write_text(json.dumps({**record, **edit}))
    with pytest.raises(ModelError) as e:
        load_reward_model(rm, root=single)
    assert str(e.value).startswith(f"{rm / BACKBONE_FILE}: {field}: ") and "\n" not in str(e.value)


def test_the_judges_identity_follows_the_head_and_the_backbone(single: Path,
                                                               tmp_path: Path) -> None:
    """rm_md5 (the judge's `version`, the registry's judge_model_md5) changes with the head's
    weights and with the backbone's recorded md5 or depth; the judge reads the backbone's
    tokenizer."""
    from tasks.judging.judge_rm import RewardModelJudge, rm_md5
    rm = Path(shutil.copytree(single / layout.reward_model(1), tmp_path / "rm"))
    first = rm_md5(rm)
    judge = RewardModelJudge(single / layout.reward_model(1), 0.0, 0, 64)
    assert judge.version == f"rm@{first}"
    assert judge.tok.get_vocab() == lm.load_tokenizer(single / layout.policy(0)).get_vocab()
    head = load_file(str(rm / HEAD_FILE))
    save_file({k: v * 2 for k, v in head.items()}, str(rm / HEAD_FILE))
    second = rm_md5(rm)
    record = json.loads((rm / BACKBONE_FILE).read_text())
    seen = {first, second}
    for edit in ({"base_md5": "0" * 32}, {"num_layers": 2}):
        (rm / BACKBONE_FILE).write_text(json.dumps({**record, **edit}))
        seen.add(rm_md5(rm))
    assert len(seen) == 4


def test_mlflow_loads_it_as_a_python_function_scoring_texts(single: Path) -> None:
    """MLmodel: a python_function model (the transformers flavor needs weights in the
    directory); its rewards are the reward_model judge's."""
    import mlflow
    import pandas as pd

    from tasks.judging.judge_rm import RewardModelJudge
    rm = single / layout.reward_model(1)
    model = mlflow.pyfunc.load_model(str(rm))
    prompts, responses = ["Tell me about topic 3.", "Hi"], ["A kind answer.", "No."]
    got = model.predict(pd.DataFrame({"prompt": prompts, "response": responses}))
    judge = RewardModelJudge(rm, 0.0, 0, 512)
    want = judge.score([(Message("user", x),) for x in prompts], responses)
    assert list(got) == want


def test_export_rebuilds_a_head_only_model_whole(single: Path, tmp_path: Path) -> None:
    """`alignloop export` of a head-only reward model writes it whole: a standalone
    sequence-classification model with the backbone's tokenizer, scoring as the loop did."""
    import transformers

    from flows.export import export_dir
    src = single / layout.reward_model(1)
    what = export_dir(single, src, tmp_path / "rm", merge=False)
    assert what.startswith("reward model: its heads on the first blocks of models/iter_0/policy")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "rm")
    want = load_reward_model(src).members[0]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(20, 900, (1, 7), generator=g)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want(input_ids=ids).logits)


PYFUNC = """
import json, sys, mlflow, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
got = model.predict(pd.DataFrame({"prompt": ["Write a short review of Heat."] * 2,
                                  "response": ["A tense, wonderful film.", "Dull."]}))
print(json.dumps([float(x) for x in got]))
"""


@pytest.mark.slow                  # a whole extra loop through the CLI
def test_a_probe_only_workspace_runs_audits_and_serves_its_reward_models_through_the_cli(
        tiny_run: dict[str, object], tmp_path: Path) -> None:
    """A team switches an existing workspace to the probe alone (`train_rm.epochs: 0`): the run
    retrains each iteration's reward model as heads plus the backbone's record; lineage verifies
    the registered version down to the backbone's bytes; MLflow's registry URI scores texts
    from the workspace root."""
    import os
    import subprocess
    import sys

    import yaml

    from conftest import ROOT, copy_workspace, run_cli
    ws = copy_workspace(Path(str(tiny_run["ws"])), tmp_path / "ws")
    _train_rm_params(ws, epochs=0, num_layers=1, pooling="mean", head_init="probe")
    out = run_cli("run", "--workspace", str(ws)).stdout
    assert "[ran] train_rm@1" in out and "[ran] train_rm@2" in out, out
    backbone = BackboneRef(layout.policy(0), lm.weights_md5(ws / layout.policy(0)), 1)
    for it in (1, 2):
        rm = ws / layout.reward_model(it)
        assert reward_model.read_backbone(rm) == backbone
        assert not list(rm.glob("model*.safetensors")) and _bytes(rm) < 200_000, it
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    assert layout.policy(0) in [d["path"] for d in lock["train_rm@2"]["deps"]]
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}"
    versions = MlflowClient(tracking_uri=uri).search_model_versions(
        "name = 'alignloop-reward-model'")
    newest = max((v for v in versions if v.tags.get("iteration") == "2"),
                 key=lambda v: int(v.version))
    assert newest.tags["model_md5"] == next(    # the version holds iteration 2's bytes
        o["md5"] for o in lock["train_rm@2"]["outs"] if o["path"] == layout.reward_model(2))
    model_uri = f"models:/alignloop-reward-model/{newest.version}"
    verify = run_cli("lineage", model_uri, "--verify", "--workspace", str(ws))
    assert "verify: ok" in verify.stdout, verify.stdout
    scored = subprocess.run([sys.executable, "-c", PYFUNC, model_uri],
                            capture_output=True, text=True, cwd=ws, timeout=300,
                            env={**os.environ, "MLFLOW_TRACKING_URI": uri,
                                 "PYTHONPATH": str(ROOT)})
    assert scored.returncode == 0, scored.stderr[-3000:]
    rewards = json.loads(scored.stdout.strip().splitlines()[-1])
    assert len(rewards) == 2 and rewards[0] != rewards[1]
