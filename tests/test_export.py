"""`alignloop export`: a registered version as a standalone Hugging Face directory that a fresh
Python process loads with transformers (or PEFT, for an unmerged adapter) and that computes the
workspace model's logits."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import copy_workspace, run_cli

IDS = [[1, 5, 9, 14, 3, 7, 2]]
LOAD = """
import sys, torch, transformers
from pathlib import Path
loader = transformers.AutoModelForCausalLM if sys.argv[2] == "hf" else \\
    __import__("peft").AutoPeftModelForCausalLM
model = loader.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    torch.save(model(torch.tensor({ids})).logits, sys.argv[3])
"""


def fresh_logits(directory: Path, tmp_path: Path, loader: str = "hf") -> torch.Tensor:
    """The logits a fresh interpreter, in a directory of its own, computes from `directory`."""
    out, cwd = tmp_path / f"logits-{loader}.pt", tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-c", LOAD.format(ids=IDS), str(directory), loader,
                    str(out)], check=True, cwd=cwd, capture_output=True, timeout=300)
    return torch.load(out)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def test_a_full_model_exports_without_bookkeeping_and_computes_the_same_logits(tiny_run,
                                                                              tmp_path):
    from tasks.models import lm
    ws = copy_workspace(tiny_run["ws"], tmp_path / "ws")
    dest = tmp_path / "served"
    dest.mkdir()                                             # empty: allowed
    out = run_cli("export", "models:/alignloop-policy@champion", str(dest),
                  "--workspace", str(ws)).stdout
    assert "exported alignloop-policy v2" in out and "full model" in out
    names = {p.name for p in dest.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"MLmodel", "components", "conda.yaml", "training_curve.json",
                        "alignloop_model.json"}
    expected = logits(lm.load_causal_lm(ws / "models/iter_2/policy"))
    assert torch.allclose(fresh_logits(dest, tmp_path), expected, atol=1e-5)
    again = run_cli("export", "models:/alignloop-policy/2", str(dest), "--workspace", str(ws),
                    check=False)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "exists and is not an empty directory" in again.stderr
    merge = run_cli("export", "models:/alignloop-policy/2", str(tmp_path / "m"), "--merge",
                    "--workspace", str(ws), check=False)
    assert merge.returncode == 2 and "is a full model, not a LoRA adapter" in merge.stderr
    assert not (tmp_path / "m").exists()
    assert not list(tmp_path.glob(".m.export-*")) and not list(tmp_path.glob(".served*"))


@pytest.fixture
def adapter_root(tmp_path) -> tuple[Path, torch.Tensor]:
    """A workspace-like root: a tiny base at models/iter_0/policy and a trained-looking LoRA
    adapter on it at models/iter_1/policy; with the adapter's logits."""
    from tasks.models import adapters, lm
    from tasks.models.tiny_model import build_tiny_model
    from tasks.schemas.model import TinyModelParams
    from tasks.schemas.update import LoraParams
    root = tmp_path / "root"
    base_dir, adapter_dir = root / "models/iter_0/policy", root / "models/iter_1/policy"
    base = build_tiny_model(TinyModelParams(), 64, {"bos_token_id": 1, "eos_token_id": 2,
                                                    "pad_token_id": 0}, 0)
    base.save_pretrained(base_dir)
    policy = adapters.attach(base, LoraParams(r=4, alpha=8.0), torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, q in policy.named_parameters():
            if "lora_B" in name:
                q.copy_(torch.randn(q.shape, generator=g) * 0.05)
    adapters.save_adapter(policy, adapter_dir, "models/iter_0/policy", lm.weights_md5(base_dir))
    expected = logits(adapters.load_policy(adapter_dir, root))
    assert not torch.allclose(expected, logits(lm.load_causal_lm(base_dir)))   # it does change
    return root, expected


def test_an_adapter_exports_merged_or_beside_its_base_and_computes_the_same_logits(
        adapter_root, tmp_path):
    from flows import export
    root, expected = adapter_root
    src = root / "models/iter_1/policy"
    merged = tmp_path / "merged"
    assert "merged" in export.export_dir(root, src, merged, merge=True)
    assert not (merged / "adapter_config.json").exists()
    assert torch.allclose(fresh_logits(merged, tmp_path), expected, atol=1e-5)
    beside = tmp_path / "beside"
    assert "base/" in export.export_dir(root, src, beside, merge=False)
    assert (beside / "base/config.json").is_file()
    assert not (beside / "alignloop_base.json").exists()
    assert torch.allclose(fresh_logits(beside, tmp_path, "peft"), expected, atol=1e-5)


def _stored(store: Path, directory: Path) -> str:
    """`directory` as DVC stores it (its files by md5, a manifest listing them); the
    manifest's md5."""
    import hashlib
    import json
    import shutil

    from flows.verify import object_path
    entries = []
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        md5 = hashlib.md5(f.read_bytes()).hexdigest()
        object_path(store, md5).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, object_path(store, md5))
        entries.append({"md5": md5, "relpath": f.relative_to(directory).as_posix()})
    text = json.dumps(entries)
    md5 = hashlib.md5(text.encode()).hexdigest() + ".dir"
    object_path(store, md5).parent.mkdir(parents=True, exist_ok=True)
    object_path(store, md5).write_text(text)
    return md5


def test_lineage_reads_an_adapters_base_from_the_stores_and_its_weights_md5(adapter_root,
                                                                           tmp_path):
    """What `lineage --verify` checks of a LoRA version: the base its alignloop_base.json names
    has, in the DVC stores, the weights md5 recorded there."""
    import json
    import shutil

    from flows import verify
    from tasks.models import lm
    root, _ = adapter_root
    store = tmp_path / "store"
    base_md5 = _stored(store, root / "models/iter_0/policy")
    named = json.loads(verify.read_member([store], _stored(store, root / "models/iter_1/policy"),
                                          "alignloop_base.json"))
    assert named["base_path"] == "models/iter_0/policy"
    assert verify.weights_md5([store], base_md5) == named["base_md5"] == \
        lm.weights_md5(root / "models/iter_0/policy")
    other = tmp_path / "other"
    shutil.copytree(root / "models/iter_0/policy", other)
    (other / "model.safetensors").write_bytes(b"x" + (other / "model.safetensors").read_bytes())
    assert verify.weights_md5([store], _stored(store, other)) != named["base_md5"]
