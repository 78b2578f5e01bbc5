"""Registered versions load through MLflow's own API from the DVC-tracked directory (no second
copy of the weights), and every model directory carries a deterministic model card."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tasks.config.params import load_params
from tasks.core import layout
from tasks.models import lm, mlflow_model, model_card

CHAT = [{"role": "user", "content": "Write a short movie review of Alien (1979)."}]


def _digest(path: Path) -> dict[str, str]:
    return {f.relative_to(path).as_posix(): hashlib.md5(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


META = "registered_model_meta"   # MLflow < 3.18 writes it into the directory a models:/ URI
                                 #   names; 3.18 writes nothing there


def _mlflow_writes_meta() -> bool:
    from importlib.metadata import version
    major, minor = (int(x) for x in version("mlflow").split(".")[:2])
    return (major, minor) < (3, 18)


@pytest.fixture
def registry(tiny_run, monkeypatch):
    """The finished tiny workspace's MLflow store, through MLFLOW_TRACKING_URI. Afterwards the
    notes MLflow leaves in the model directories are removed: the session's workspace is
    shared, and DVC would see those directories as modified (test_dvc_sees_no_change...)."""
    ws: Path = tiny_run["ws"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    from mlflow.tracking import MlflowClient
    yield ws, MlflowClient()
    for note in ws.glob(f"models/*/*/{META}"):
        note.unlink()


def _lock(ws: Path) -> dict:
    return yaml.safe_load((ws / "dvc.lock").read_text())["stages"]


def test_champion_policy_loads_and_generates_from_its_own_weights(registry):
    import mlflow
    ws, client = registry
    mv = client.get_model_version_by_alias("alignloop-policy", "champion")
    model_dir = Path(mv.source)
    assert model_dir == ws / mv.tags["model_path"]
    before = _digest(model_dir)

    pipe = mlflow.transformers.load_model("models:/alignloop-policy@champion")
    assert pipe.task == "text-generation"
    assert pipe.tokenizer.chat_template == (model_dir / "chat_template.jinja").read_text()
    weights = load_file(str(model_dir / "model.safetensors"))         # the directory's bytes
    state = pipe.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    out = pipe(CHAT, max_new_tokens=8, do_sample=False, return_full_text=False)
    assert isinstance(out[0]["generated_text"], str)

    # the generated ids are what our own loader's greedy decoding of the same weights gives
    tok, model = lm.load_tokenizer(model_dir), lm.load_causal_lm(model_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    got = pipe(CHAT, max_new_tokens=8, do_sample=False, return_tensors=True)
    assert list(got[0]["generated_token_ids"]) == ref[0].tolist()

    pyfunc = mlflow.pyfunc.load_model(f"models:/alignloop-policy/{mv.version}")
    pred = pyfunc.predict({"messages": CHAT, "max_tokens": 8})
    completion = pred[0] if isinstance(pred, list) else pred
    [choice] = completion["choices"]
    assert choice["message"]["role"] == "assistant"
    assert CHAT[0]["content"] not in choice["message"]["content"]     # a reply, not an echo
    # the prompt it answered is the chat-templated one (not the raw text)
    assert completion["usage"]["prompt_tokens"] == ids.shape[1]
    assert completion["usage"]["completion_tokens"] <= 8
    after = _digest(model_dir)                  # a models:/ load writes at most MLflow's note
    assert {k: v for k, v in after.items() if k != META} == before
    if _mlflow_writes_meta():                   # the condition: MLflow < 3.18 writes it
        assert yaml.safe_load((model_dir / META).read_text()) == {
            "model_name": "alignloop-policy", "model_version": str(mv.version)}
    else:
        assert not (model_dir / META).exists()


def test_the_policy_signature_is_mlflows_chat_signature():
    """The chat signature a stage writes without importing MLflow is MLflow's own."""
    from mlflow.types.llm import CHAT_MODEL_INPUT_SCHEMA, CHAT_MODEL_OUTPUT_SCHEMA
    sig = mlflow_model.signature(mlflow_model.CHAT)
    assert json.loads(sig["inputs"]) == CHAT_MODEL_INPUT_SCHEMA.to_dict()
    assert json.loads(sig["outputs"]) == CHAT_MODEL_OUTPUT_SCHEMA.to_dict()


def test_reward_model_loads_as_text_classification(registry):
    import mlflow
    import pandas as pd
    import transformers
    ws, client = registry
    mv = client.get_model_version("alignloop-reward-model", "1")
    pipe = mlflow.transformers.load_model(f"models:/alignloop-reward-model/{mv.version}")
    assert pipe.task == "text-classification" and pipe.tokenizer.chat_template
    text = "A tense, beautifully shot thriller."
    score = pipe(text)[0]["score"]
    ours = transformers.AutoModelForSequenceClassification.from_pretrained(mv.source).eval()
    with torch.no_grad():
        logit = ours(**pipe.tokenizer(text, return_tensors="pt")).logits[0, 0]
    assert score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)   # sigmoid(r(text))
    pred = mlflow.pyfunc.load_model(mv.source).predict(pd.DataFrame({"text": [text]}))
    assert len(pred) == 1 and 0.0 <= float(pred["score"].iloc[0]) <= 1.0


def test_weights_are_stored_once(registry):
    ws, client = registry
    for name in ("alignloop-policy", "alignloop-reward-model"):
        for mv in client.search_model_versions(f"name = '{name}'"):
            files = sorted(p.relative_to(mv.source).as_posix()
                           for p in Path(mv.source).rglob("*.safetensors"))
            assert files == ["model.safetensors"], (mv.source, files)      # no model/ copy
            md5 = _lock(ws)[mv.tags["dvc_stage"]]["outs"]
            dir_md5 = next(o["md5"] for o in md5 if o["path"] == mv.tags["model_path"])
            manifest = json.loads((ws / ".dvc/cache/files/md5" / dir_md5[:2] /
                                   dir_md5[2:]).read_text())
            assert [e["relpath"] for e in manifest if e["relpath"].endswith(".safetensors")] \
                == ["model.safetensors"]
            assert (Path(mv.source) / mlflow_model.MLMODEL).is_file()
    assert not list(ws.glob(".alignloop/**/*.safetensors"))        # nothing logged to MLflow


def test_model_card_names_what_made_the_policy(registry):
    from huggingface_hub import ModelCard
    ws, client = registry
    mv = client.get_model_version_by_alias("alignloop-policy", "champion")
    it, model_dir = int(mv.tags["iteration"]), Path(mv.source)
    p = load_params(ws / layout.PARAMS_FILE)
    card = ModelCard.load(model_dir / model_card.CARD_FILE)
    assert card.data.library_name == "transformers" and "alignloop" in card.data.tags
    assert card.data.base_model.startswith("tiny-random-llama")
    assert p.update.algo in card.data.tags
    text = card.text
    assert f"| `loss` | {p.update.dpo.loss} |" in text and f"| `beta` | {p.update.dpo.beta:.6g} |" \
        in text
    assert f"`{mv.tags['params_md5']}`" in text                     # the registry's params md5
    entry = _lock(ws)[f"update@{it}"]
    data_deps = {d["path"]: d["md5"] for d in entry["deps"] if d["path"].startswith("data/")}
    assert set(card.data.datasets) == set(data_deps)
    for path, md5 in data_deps.items():
        assert f"- `{path}` md5 `{md5}`" in text and mv.tags[f"input:{path}"] == md5
    assert p.judge.kind + ":" + p.judge.version in text
    metrics = json.loads((ws / layout.metrics(it, "update")).read_text())
    assert all(f"| `{k}` |" in text for k in metrics)
    assert f"## Parent policy\n\n`{layout.policy(it - 1)}`" in text
    assert f"`{lm.weights_md5(model_dir)}`" in text
    assert "alignloop lineage models:/alignloop-policy/<version> --verify" in text

    rm_card = ModelCard.load(ws / layout.reward_model(it) / model_card.CARD_FILE)
    assert rm_card.data.pipeline_tag == "text-classification"
    assert "bradley-terry" in rm_card.data.tags and "lexicon:vader-v1" in rm_card.text
    assert ModelCard.load(ws / layout.policy(0) / model_card.CARD_FILE).data.tags == \
        ["alignloop", "rlhf", "policy"]


def test_rewriting_gives_identical_bytes(registry, tmp_path):
    """Same inputs, same files: DVC's caching of the model directories depends on it."""
    ws, client = registry
    mv = client.get_model_version_by_alias("alignloop-policy", "champion")
    it, src = int(mv.tags["iteration"]), Path(mv.source)
    copy = shutil.copytree(src, tmp_path / "policy")
    for f in (model_card.CARD_FILE, mlflow_model.MLMODEL, "conda.yaml", "requirements.txt"):
        (copy / f).unlink()
    shutil.rmtree(copy / mlflow_model.COMPONENTS_DIR)
    metrics = json.loads((ws / layout.metrics(it, "update")).read_text())
    mlflow_model.write_mlflow_model(copy, mlflow_model.CHAT, {"model_path": layout.policy(it)})
    model_card.write_model_card(copy, ws, "update", it, load_params(ws / layout.PARAMS_FILE),
                                metrics)
    assert _digest(copy) == _digest(src)


def test_an_ensemble_loads_as_its_member_0(tiny_run, tmp_path):
    """K > 1: MLflow loads member_0 alone (alignloop's load_reward_model loads them all)."""
    import mlflow

    from tasks.reward.reward_model import init_reward_model, save_reward_model
    backbone = tiny_run["ws"] / layout.policy(0)
    members = [init_reward_model(backbone, torch.Generator().manual_seed(i)) for i in range(2)]
    rm_dir = tmp_path / "rm"
    save_reward_model(members, rm_dir)
    lm.load_tokenizer(backbone).save_pretrained(rm_dir)
    mlflow_model.write_mlflow_model(rm_dir, "text-classification", {"model_path": "rm"})
    pipe = mlflow.transformers.load_model(str(rm_dir))
    member0 = load_file(str(rm_dir / "member_0" / "model.safetensors"))
    state = pipe.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in member0.items())
    assert 0.0 <= pipe("a fine film")[0]["score"] <= 1.0


def test_dvc_sees_no_change_after_a_models_uri_load(tiny_run, tmp_path):
    """The note MLflow < 3.18 writes on a models:/ load (the first test), in a copy of the
    workspace: DVC ignores it whichever MLflow made the workspace."""
    import subprocess
    import sys

    from conftest import copy_workspace
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    (ws / layout.policy(2) / META).write_text("model_name: alignloop-policy\nmodel_version: '2'\n")
    out = subprocess.run([sys.executable, "-m", "dvc", "status", "--quiet"], cwd=ws,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.slow                  # MLflow's scoring server starts in ~30 s
def test_alignloop_serve_answers_a_chat_request_over_http(tiny_run, tmp_path):
    """`alignloop serve` (MLflow's scoring server on the champion, the workspace's store, PATH
    without this interpreter's bin directory): a `messages` request gets the assistant's reply
    as a chat completion, not the prompt echoed; a mistyped alias is one line."""
    from conftest import copy_workspace, run_cli, serve_and_chat
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    bad = run_cli("serve", "models:/alignloop-policy@prod", "--workspace", str(ws), check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: models:/alignloop-policy@prod: "
                                                         "alignloop-policy has no alias prod")
    reply = serve_and_chat(ws, {"messages": CHAT, "max_tokens": 8})
    out = reply["predictions"] if "predictions" in reply else reply
    completion = out[0] if isinstance(out, list) else out
    assert completion["object"] == "chat.completion"
    [choice] = completion["choices"]
    assert choice["message"]["role"] == "assistant"
    content = choice["message"]["content"]
    assert isinstance(content, str) and CHAT[0]["content"] not in content
    assert completion["usage"]["completion_tokens"] <= 8
