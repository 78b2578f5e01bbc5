"""The model card (README.md, Hugging Face format) of every model directory a stage writes: what
the model is, what made it (algorithm, params md5, input datasets with md5s, judge, metrics,
parent policy) and how to trace its registered version.

The params md5 is the registry's (`flows/registry.params_md5`): md5 of the values of the params
the stage declares in dvc.yaml, read from params.yaml as DVC records them in dvc.lock. The
datasets are the stage's declared data deps with their md5 (as dvc.lock has them); the judge is
read from the pairs themselves (`meta.judge`). The card holds no timestamp, so a rerun writes
identical bytes (DVC's caching depends on it).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData  # transformers imports it anyway
from ruamel.yaml import YAML  # DVC's own YAML loader: same values

import tasks
from tasks.config.params import Params, prev_of
from tasks.core import layout
from tasks.models import lm

CARD_FILE = layout.MODEL_CARD
LINEAGE_URI = {"policy": "models:/alignloop-policy",
               "reward_model": "models:/alignloop-reward-model"}


@dataclass(frozen=True)
class Card:
    stage: str                              # the DVC stage instance, e.g. update@1
    role: str                               # policy | reward_model
    iteration: int
    model_path: str                         # the directory in the workspace (layout)
    task: str                               # the pipeline tag
    base_model: str
    base_meta: dict[str, object]            # what prepare_model recorded of the initial model
    algorithm: dict[str, object]
    params_md5: str
    datasets: dict[str, str]                # path -> md5 (as dvc.lock records it)
    judges: list[str]                       # kind:version found in the datasets
    metrics: dict[str, float]
    parent: str | None                      # the parent policy (or RM backbone) directory
    weights_md5: dict[str, str] = field(default_factory=dict)   # member dir -> md5
    notes: list[str] = field(default_factory=list)
    flavor: str = "transformers"            # the MLflow flavor MLmodel offers for it


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _stage_decl(root: Path, stage: str, it: int) -> tuple[dict[str, Any], list[str]]:
    """(the values of the params stage `stage` declares in dvc.yaml, its deps with `${key}` and
    `${item.*}` filled in for iteration `it`)."""
    loader = YAML(typ="safe")
    declared = root / "dvc.yaml"          # run by hand (tests): the project's, the same file
    if not declared.is_file():
        declared = Path(tasks.__file__).resolve().parent.parent / "dvc.yaml"
    dvc = loader.load(declared.read_text())["stages"][stage]
    params = loader.load((root / layout.PARAMS_FILE).read_text())
    ctx = {"key": str(it)}
    if "foreach" in dvc:
        ctx.update({f"item.{k}": str(v) for k, v in params["iterations"][str(it)].items()})
        dvc = dvc["do"]
    values = {k: _lookup(params, k) for k in dvc.get("params", []) if isinstance(k, str)}
    deps = [re.sub(r"\$\{\s*([^}]+?)\s*\}", lambda m: ctx[m[1]], d) for d in dvc.get("deps", [])]
    return values, deps


def params_md5(values: Mapping[str, Any]) -> str:
    """As flows/registry.params_md5 computes it from the dvc.lock entry."""
    return hashlib.md5(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def _dataset(path: Path) -> tuple[str, set[str]]:
    """md5 of a file (DVC 3's file md5) and the `meta.judge` values of its JSONL records."""
    data, judges = path.read_bytes(), set()
    if path.suffix == ".jsonl":
        for line in data.splitlines():
            if b'"judge"' in line:
                judge = (json.loads(line).get("meta") or {}).get("judge")
                if judge:
                    judges.add(str(judge))
    return hashlib.md5(data).hexdigest(), judges


def provenance(root: Path, stage: str, it: int) -> tuple[str, dict[str, str], list[str]]:
    """(params md5, {declared data file: md5}, judges) of stage instance `stage`@`it`."""
    values, deps = _stage_decl(root, stage, it)
    datasets: dict[str, str] = {}
    judges: set[str] = set()
    for dep in deps:
        path = root / dep
        if dep.startswith(("data/", "audit/")) and path.is_file():
            datasets[dep], found = _dataset(path)
            judges |= found
    return params_md5(values), datasets, sorted(judges)


def base_model(meta: Mapping[str, Any]) -> str:
    """The initial model, from what prepare_model recorded (its alignloop_model.json)."""
    source = meta.get("source")
    if source == "gguf":
        return str(meta.get("source_file"))
    if source == "hf_dir":
        return str(meta.get("copied_from"))
    return f"tiny-random-llama (tokenizer: {meta.get('tokenizer_from')})"


def algorithm(p: Params, stage: str) -> dict[str, object]:
    """The training recipe a card shows: update.algo with its loss and beta (or kl_coef), the
    reward model's Bradley-Terry loss, or the initial model's source."""
    if stage == "update":              # each stage reads its own section only (its contract)
        u = p.update
        if u.algo == "dpo":
            return {"algo": "dpo", "loss": u.dpo.loss, "beta": u.dpo.beta,
                    "reference": u.reference, "pair_source": u.dpo.pair_source,
                    "lr": u.dpo.lr, "epochs": u.dpo.epochs}
        return {"algo": "ppo", "loss": "clipped PPO, value head", "kl_coef": u.ppo.kl_coef,
                "kl_mode": u.ppo.kl_mode, "reference": u.reference, "lr": u.ppo.lr}
    if stage == "train_rm":
        t = p.train_rm
        return {"algo": "bradley-terry", "loss": "-log sigmoid(r_c - r_r - margin)",
                "margin": t.margin, "ensemble": t.ensemble, "lr": t.lr, "epochs": t.epochs}
    return {"source": p.model.source}                # prepare_model: nothing trained


def _weights(model_dir: Path) -> dict[str, str]:
    dirs = sorted(model_dir.glob(f"{layout.RM_MEMBER_PREFIX}*")) or [model_dir]
    return {d.relative_to(model_dir).as_posix(): lm.weights_md5(d) for d in dirs}


def _table(rows: Mapping[str, object]) -> str:
    def cell(v: object) -> str:
        return f"{v:.6g}" if isinstance(v, float) else str(v)
    return "\n".join(["| key | value |", "|---|---|",
                      *(f"| `{k}` | {cell(v)} |" for k, v in sorted(rows.items()))])


def render(card: Card) -> str:
    """The README.md text: YAML front matter, then sections."""
    algo = str(card.algorithm.get("algo", ""))
    data = ModelCardData(base_model=card.base_model, library_name="transformers",
                         pipeline_tag=card.task, datasets=sorted(card.datasets) or None,
                         tags=["alignloop", "rlhf", card.role.replace("_", "-"),
                               *([algo] if algo else [])])
    weights = ", ".join(f"`{d}`: `{m}`" for d, m in card.weights_md5.items())
    datasets = "\n".join(f"- `{p}` md5 `{m}`" for p, m in sorted(card.datasets.items()))
    return "\n".join([
        "---", data.to_yaml(), "---", "",
        f"# alignloop {card.role.replace('_', ' ')}, iteration {card.iteration}", "",
        f"`{card.model_path}` in an alignloop workspace, written by DVC stage `{card.stage}`; "
        f"this directory is also an MLflow model (`MLmodel`, {card.flavor} flavor, task "
        f"`{card.task}`).", "", *[f"{n}\n" for n in card.notes],
        "## Base model", "", card.base_model, "", _table(card.base_meta), "",
        "## Training", "", _table(card.algorithm), "",
        f"Params md5 (the stage's declared params, as the registry's `params_md5` tag): "
        f"`{card.params_md5}`", "",
        "## Input datasets", "", "The stage's declared data deps, with their md5 as dvc.lock "
        "records them:", "", datasets or "none", "",
        "## Judge", "", ", ".join(card.judges) or "none (no judged pairs among the inputs)", "",
        "## Metrics", "", _table(card.metrics) if card.metrics else "none", "",
        "## Parent policy", "", _parent(card), "",
        "## Lineage", "", f"Weights md5 (md5 of the `*.safetensors` bytes): {weights}.", "",
        *_lineage(card), ""])


def _parent(card: Card) -> str:
    if card.parent is None:
        return "none (this is the initial model)"
    return f"`{card.parent}`" + (" (the backbone it starts from)" if card.role == "reward_model"
                                 else "")


def _lineage(card: Card) -> list[str]:
    """How to find the registered version (its number is not known when the stage runs)."""
    if card.stage == "prepare_model":
        return ["The initial model is not registered itself: it is the root of the lineage of "
                "every registered policy and reward model (`alignloop lineage "
                "models:/alignloop-policy@champion`)."]
    uri = LINEAGE_URI[card.role]
    return [f"The registered version is the one tagged `iteration` = `{card.iteration}` and "
            f"`model_path` = `{card.model_path}` (its `model_md5` tag is DVC's md5 of this "
            "directory, card included); find its number with `MlflowClient()."
            f"search_model_versions(\"name = '{uri.split('/', 1)[1]}' and tags.model_path = "
            f"'{card.model_path}'\")`, then:", "",
            f"    alignloop lineage {uri}/<version> --verify"]


# stage -> (role, pipeline task) of the model directory it writes
STAGES = {"prepare_model": ("policy", "text-generation"), "update": ("policy", "text-generation"),
          "train_rm": ("reward_model", "text-classification")}


def parent_of(stage: str, it: int, prev: int) -> str | None:
    """The policy a stage's model starts from: the policy of iteration `prev` (update), the
    initial model (train_rm's backbone), none (prepare_model)."""
    return {"update": layout.policy(prev), "train_rm": layout.policy(0)}.get(stage)


def adapter_note(model_dir: Path, model_path: str) -> str:
    """How to load a LoRA adapter directory: it holds the adapter alone and names its base."""
    base = json.loads((model_dir / lm.ADAPTER_BASE).read_text())
    return (f"A LoRA adapter (PEFT) on the base `{base['base_path']}` (weights md5 "
            f"`{base['base_md5']}`), which this directory names in `{lm.ADAPTER_BASE}` and "
            "does not hold. From the workspace root: `peft.AutoPeftModelForCausalLM."
            f"from_pretrained(\"{model_path}\")` (the adapter's `base_model_name_or_path` is "
            "the base's path relative to the root), or `mlflow.transformers.load_model(\"models:"
            "/alignloop-policy/<version>\")`; from elsewhere, add `base_model_path=` with the "
            "base's directory to MLflow's call. `alignloop export ... --merge` writes a "
            "standalone model with the adapter merged into the base's weights.")


def write_model_card(model_dir: Path, root: Path, stage: str, it: int, p: Params,
                     metrics: Mapping[str, float], notes: Sequence[str] = ()) -> None:
    """Write README.md into `model_dir`, the new directory of stage `stage`@`it` (before it is
    renamed into place, after its alignloop_model.json and MLmodel); the base model comes from
    the initial policy's alignloop_model.json. `notes`: the stage's own, shown first."""
    model_dir = Path(model_dir)
    role, task = STAGES[stage]
    model_path = layout.policy(it) if role == "policy" else layout.reward_model(it)
    meta_dir = model_dir if stage == "prepare_model" else root / layout.policy(0)
    meta = json.loads((meta_dir / layout.MODEL_META).read_text())
    md5, datasets, judges = provenance(root, stage, it)
    weights = _weights(model_dir)
    mlmodel = model_dir / layout.MLMODEL
    flavors = (YAML(typ="safe").load(mlmodel.read_text())["flavors"] if mlmodel.is_file()
               else {"transformers": {}})
    flavor = "transformers" if "transformers" in flavors else "python_function"
    notes = list(notes)
    if len(weights) > 1 and flavor == "transformers":
        notes.append(f"An ensemble of {len(weights)} members: MLflow loads `member_0` alone; "
                     "alignloop's `tasks.reward.reward_model.load_reward_model` loads them all.")
    if stage == "train_rm" and p.train_rm.pooling == "mean" and flavor == "transformers":
        notes.append("The reward is the head applied to the mean of the backbone's final states "
                     "over the response's tokens (`train_rm.pooling: mean`); a plain "
                     "text-classification pipeline reads the last token instead, so score with "
                     "`tasks.reward.reward_model.load_reward_model` for the rewards the loop used.")
    if role == "policy" and (model_dir / lm.ADAPTER_BASE).is_file():   # an RM's: its note
        notes.append(adapter_note(model_dir, model_path))
    name = stage if stage == "prepare_model" else f"{stage}@{it}"
    card = Card(name, role, it, model_path, task, base_model(meta), meta, algorithm(p, stage), md5,
                datasets, judges, {k: float(v) for k, v in metrics.items()},
                parent_of(stage, it, prev_of(p, it)), weights, notes, flavor)
    ModelCard(render(card)).save(model_dir / CARD_FILE)
