"""LoRA through the CLI (params/tiny-lora.yaml): a copy of the shared tiny workspace switched to
adapters and run again, as a team would switch an existing workspace. Each iteration's policy
directory holds the adapter alone and names its base; rollout declares the base as a DVC dep;
the registered adapter loads with MLflow and with PEFT from the workspace root and computes
what the loop sampled; a second run recomputes nothing (an adapter's bytes are a function of
its inputs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, copy_workspace, ran_stages, run_cli, serve_and_chat
from tasks.core import layout
from tasks.models import adapters, lm

LORA = ROOT / "params" / "tiny-lora.yaml"
pytestmark = pytest.mark.slow      # a whole extra loop through the CLI (make test-slow, CI);
#                                    tests/test_adapters.py covers the adapters in make test


@pytest.fixture(scope="module")
def lora_run(tiny_run: dict[str, object], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, object]:
    ws = copy_workspace(Path(str(tiny_run["ws"])), tmp_path_factory.mktemp("lora") / "ws")
    first = run_cli("run", "--params", str(LORA), "--workspace", str(ws))
    second = run_cli("run", "--params", str(LORA), "--workspace", str(ws))
    return {"ws": ws, "first": first, "second": second}


def test_each_iteration_stores_the_adapter_alone_naming_its_base(
        lora_run: dict[str, object]) -> None:
    ws = Path(str(lora_run["ws"]))
    base = ws / layout.policy(0)
    base_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    for it in (1, 2):
        d = ws / layout.policy(it)
        assert adapters.is_adapter_dir(d) and not (d / "model.safetensors").exists()
        assert adapters.read_base(d) == (layout.policy(0), lm.weights_md5(base))
        assert (d / adapters.ADAPTER_WEIGHTS).stat().st_size <= 0.05 * base_bytes
        card = (d / layout.MODEL_CARD).read_text()
        assert "A LoRA adapter (PEFT) on the base `models/iter_0/policy`" in card
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    for stage in ("rollout@2", "update@2"):     # the adapter's base is a declared input
        assert layout.policy(0) in [d["path"] for d in lock[stage]["deps"]], stage


def test_a_second_run_recomputes_nothing(lora_run: dict[str, object]) -> None:
    first = str(lora_run["first"].stdout)  # type: ignore[attr-defined]
    assert "[ran] update@1" in first and "[ran] update@2" in first
    second = str(lora_run["second"].stdout)  # type: ignore[attr-defined]
    assert "everything was cached" in second and not ran_stages(second), second


LOAD = """
import json, sys, torch, mlflow, peft
from tasks.models import adapters, lm
ws, uri = sys.argv[1], sys.argv[2]
pipe = mlflow.transformers.load_model(uri, return_type="components")
model, tok = pipe["model"], pipe["tokenizer"]
peft_model = peft.AutoPeftModelForCausalLM.from_pretrained("models/iter_2/policy")
ours = adapters.load_for_inference("models/iter_2/policy", ws)
text = tok.apply_chat_template([{"role": "user", "content": "A film?"}], tokenize=False,
                              add_generation_prompt=True)
ids = tok(text, return_tensors="pt").input_ids
with torch.no_grad():
    a, b, c = (m(input_ids=ids).logits.float() for m in (model, peft_model, ours))
print(json.dumps({"type": type(model).__name__, "mlflow_vs_ours": float((a - c).abs().max()),
                  "peft_vs_ours": float((b - c).abs().max())}))
"""


def test_the_registered_adapter_loads_with_mlflow_and_peft_from_the_workspace(
        lora_run: dict[str, object]) -> None:
    """What the model card promises a user: from the workspace root, MLflow's registry URI and
    PEFT's AutoPeftModelForCausalLM load base + adapter and compute the merged policy."""
    ws = Path(str(lora_run["ws"]))
    env_uri = f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}"      # the workspace's own store
    out = subprocess.run([sys.executable, "-c", LOAD, str(ws), "models:/alignloop-policy/2"],
                         capture_output=True, text=True, cwd=ws, timeout=300,
                         env={**os.environ, "MLFLOW_TRACKING_URI": env_uri,
                              "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["type"] == "PeftModelForCausalLM"
    assert got["mlflow_vs_ours"] <= 1e-3 and got["peft_vs_ours"] <= 1e-3


@pytest.mark.slow                  # MLflow's scoring server starts in ~30 s
def test_alignloop_serve_chats_with_the_lora_champion(lora_run: dict[str, object]) -> None:
    """`alignloop serve` of an adapter version: MLflow's server loads the base the adapter
    names (from the workspace, whatever directory the command runs in) and answers a chat."""
    reply = serve_and_chat(Path(str(lora_run["ws"])),
                           {"messages": [{"role": "user", "content": "A film?"}],
                            "max_tokens": 6})
    out = reply["predictions"] if "predictions" in reply else reply  # type: ignore[operator,index]
    completion = out[0] if isinstance(out, list) else out
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["role"] == "assistant"


def test_lineage_names_the_base_once_per_stage(lora_run: dict[str, object]) -> None:
    """rollout@1 and update@1 read iteration 0's model as `prev` and as the adapter's base:
    dvc.yaml names it twice (dvc.lock may record it once or twice), lineage lists it once."""
    from flows.lineage import stage_tree
    ws = Path(str(lora_run["ws"]))
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    for stage in ("rollout@1", "update@1"):
        paths = [d["path"] for d in lock[stage]["deps"] if not d["path"].startswith("tasks/")]
        assert layout.policy(0) in paths, stage
        inputs = [i["path"] for i in stage_tree(ws, lock, stage, set())["inputs"]]
        assert inputs.count(layout.policy(0)) == 1 and len(inputs) == len(set(inputs)), stage


@pytest.mark.slow                  # a whole extra loop through the CLI
def test_ppo_with_an_adapter_and_the_previous_policy_as_reference(
        tiny_run: dict[str, object], tmp_path: Path) -> None:
    """PPO trains the adapter (its value head beside it), against k-1's adapter loaded as the
    reference beside the trained one: both iterations run and each policy is an adapter."""
    ws = copy_workspace(Path(str(tiny_run["ws"])), tmp_path / "ws")
    params = tmp_path / "ppo-lora.yaml"
    params.write_text(f"base: {LORA}\nupdate:\n  algo: ppo\n  reference: previous\n")
    out = run_cli("run", "--params", str(params), "--workspace", str(ws))
    assert "update@2: ppo" in out.stdout
    for it in (1, 2):
        d = ws / layout.policy(it)
        assert adapters.is_adapter_dir(d) and (d / layout.VALUE_HEAD).is_file()
    meta = json.loads((ws / layout.policy(2) / layout.MODEL_META).read_text())
    assert meta["reference"] == layout.policy(1)


def test_gc_then_a_tick_continues_the_champions_adapter_on_the_kept_base(
        lora_run: dict[str, object], tmp_path: Path) -> None:
    """A LoRA workspace on a weekly schedule: `gc --keep-last 0` archives the adapters no alias
    or kept stage needs and never the base every adapter names; the next tick trains iteration
    3's adapter from the champion's, on that base, and lineage verifies it to the base's bytes."""
    ws = copy_workspace(Path(str(lora_run["ws"])), tmp_path / "ws")
    base_md5 = lm.weights_md5(ws / layout.policy(0))
    run_cli("gc", "--keep-last", "0", "--workspace", str(ws))
    assert lm.weights_md5(ws / layout.policy(0)) == base_md5
    tick = run_cli("tick", "--workspace", str(ws))
    ran = ran_stages(tick.stdout)
    assert "update@3" in ran and all(s.endswith("@3") or s == "report" for s in ran), ran
    d = ws / layout.policy(3)
    assert adapters.is_adapter_dir(d) and adapters.read_base(d) == (layout.policy(0), base_md5)
    meta = json.loads((d / layout.MODEL_META).read_text())
    declared = yaml.safe_load((ws / "params.yaml").read_text())["iterations"]
    start = int(declared[next(k for k in declared if str(k) == "3")]["prev"])
    assert meta["parent"] == layout.policy(start)                 # the champion it started from
    assert (ws / layout.policy(start)).is_dir()                   # kept: the tick read it
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / '.alignloop' / 'mlflow.db'}")
    v3 = next(v for v in client.search_model_versions("name = 'alignloop-policy'")
              if v.tags.get("iteration") == "3")
    verify = run_cli("lineage", f"models:/alignloop-policy/{v3.version}", "--verify",
                     "--workspace", str(ws))
    assert "verify: ok" in verify.stdout and layout.policy(0) in verify.stdout, verify.stdout
