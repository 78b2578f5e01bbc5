"""The MLflow model files inside a saved model directory, so that the directory DVC tracks is
itself a loadable MLflow model (`mlflow.transformers.load_model`, `mlflow.pyfunc.load_model`,
and `models:/NAME/VERSION` once the registry's version `source` points at it).

The weights are not copied. MLflow's transformers flavor loads the model from
`<dir>/<model_binary>` (`mlflow/transformers/model_io.py`: `path.joinpath(flavor_conf.get(
"model_binary"))`), so `model_binary: .` reads the save_pretrained files at the directory root
(an ensemble reward model: `member_0`). Its pipeline components have a fixed place,
`<dir>/components/<name>`, so the tokenizer files (a few MB, never weights) are copied there;
the root keeps its own, and every other reader (`lm.load_tokenizer`, `from_pretrained(dir)`,
`transformers serve`) goes on reading the root.

A LoRA policy directory (adapter only, tasks/models/adapters.py) is an MLflow PEFT model with a
local base: `peft_adaptor: .` and `local_base_model_path` naming the base by its
workspace-relative path, which MLflow resolves from the current directory; from elsewhere,
`mlflow.transformers.load_model(uri, base_model_path=<workspace>/models/iter_0/policy)` (MLflow's
override for a moved base; `mlflow/transformers/model_io.py`,
`load_model_and_components_from_local_base_path`).

The files are written by hand from the format MLflow 3.17's `save_model` writes (MLmodel,
conda.yaml, python_env.yaml, requirements.txt): importing mlflow costs a stage ~4 s. They hold
no timestamp or uuid, so a rerun writes identical bytes (DVC's caching depends on it).
tests/test_mlflow_model.py loads them with MLflow.
"""
from __future__ import annotations

import json
import platform
import shutil
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from tasks.core import layout
from tasks.models import chat_signature

MLMODEL = layout.MLMODEL
COMPONENTS_DIR = "components"          # MLflow's fixed place for pipeline components
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
_STRING = [{"type": "string", "required": True}]
_GENERATION_PARAMS = [                  # pyfunc predict(..., params=...) may set these
    {"name": "max_new_tokens", "type": "long", "default": 64, "shape": None},
    {"name": "do_sample", "type": "boolean", "default": False, "shape": None},
    {"name": "temperature", "type": "double", "default": 1.0, "shape": None}]
# task -> (pipeline class, output schema, params schema): MLflow's defaults for these tasks
# (mlflow/transformers/signature.py), plus the generation knobs
TASKS: dict[str, tuple[str, list[dict[str, object]], list[dict[str, object]] | None]] = {
    "text-generation": ("TextGenerationPipeline", _STRING, _GENERATION_PARAMS),
    "text-classification": ("TextClassificationPipeline",
                            [{"type": "string", "name": "label", "required": True},
                             {"type": "double", "name": "score", "required": True}], None),
}
# MLflow's chat task: a text-generation pipeline served as OpenAI chat completions (`messages`
# in, the assistant's reply out, the tokenizer's chat template applied); its signature is
# MLflow's (tasks/models/chat_signature.py), its knobs are the request's (max_tokens, temperature)
CHAT = "llm/v1/chat"


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _pinned(*packages: str) -> list[str]:
    """`name==version`, without a local label (torch's `+cpu`: not on PyPI), as MLflow pins."""
    return [f"{p}=={v.split('+')[0]}" if (v := _version(p)) else p for p in packages]


def model_binary(model_dir: Path) -> str:
    """Where the flavor finds config.json + weights: the root, or an ensemble's member 0
    (MLflow then loads member 0 alone; alignloop's `load_reward_model` loads every member)."""
    if (model_dir / "config.json").is_file():
        return "."
    member = f"{layout.RM_MEMBER_PREFIX}0"
    if (model_dir / member / "config.json").is_file():
        return member
    raise ValueError(f"{model_dir}: no config.json at the root or in {member}/")


ADAPTER_CONFIG = "adapter_config.json"   # PEFT's: the directory holds an adapter, not a model


def flavor_config(model_dir: Path, task: str, source_name: str,
                  base: tuple[str, Path] | None = None) -> dict[str, object]:
    """The `transformers` flavor block of MLmodel, as `build_flavor_config_from_local_checkpoint`
    would write it, with `model_binary` pointing into the directory itself; for an adapter
    (base: its workspace-relative path and its directory), the adapter here and the base at
    that path."""
    inference_task = task if task == CHAT else None
    task = "text-generation" if task == CHAT else task
    if base is None:
        binary = model_binary(model_dir)
        config = json.loads((model_dir / binary / "config.json").read_text())
    else:
        config = json.loads((base[1] / "config.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype")
    conf: dict[str, object] = {
        "code": None, "components": ["tokenizer"], "instance_type": TASKS[task][0],
        "pipeline_model_type": config["architectures"][0],
        "source_model_name": source_name, "task": task,
        "tokenizer_type": tok_config.get("tokenizer_class") or "AutoTokenizer",
        "transformers_version": _version("transformers")}
    if base is None:
        conf["model_binary"] = binary
    else:
        conf.update({"peft_adaptor": ".", "local_base_model_path": base[0]})
    if dtype:
        conf["torch_dtype"] = f"torch.{dtype}"
    if inference_task:
        conf["inference_task"] = inference_task
    return conf


def signature(task: str) -> dict[str, str | None]:
    if task == CHAT:
        return {"inputs": json.dumps(chat_signature.INPUTS),
                "outputs": json.dumps(chat_signature.OUTPUTS), "params": None}
    _, outputs, params = TASKS[task]
    return {"inputs": json.dumps(_STRING), "outputs": json.dumps(outputs),
            "params": json.dumps(params) if params else None}


def mlmodel(model_dir: Path, task: str, info: Mapping[str, object],
            base: tuple[str, Path] | None = None) -> dict[str, object]:
    metadata: dict[str, object] = {"alignloop": dict(info)}
    if task == CHAT:
        metadata["task"] = CHAT                 # as MLflow's save_model marks a chat model
    return {
        "flavors": {
            "python_function": {"env": {"conda": "conda.yaml", "virtualenv": "python_env.yaml"},
                                "loader_module": "mlflow.transformers",
                                "python_version": platform.python_version()},
            "transformers": flavor_config(model_dir, task, str(info.get("model_path", ".")),
                                          base),
        },
        "metadata": metadata,
        "mlflow_version": _version("mlflow"),
        "signature": signature(task),
    }


def _dump(path: Path, obj: object) -> None:
    path.write_text(yaml.safe_dump(obj, sort_keys=True, default_flow_style=False))


def write_mlflow_model(model_dir: Path, task: str, info: Mapping[str, object],
                       base: tuple[str, Path] | None = None) -> None:
    """Make `model_dir` (a save_pretrained directory with its tokenizer at the root, or an
    ensemble's member_<i> dirs) a valid MLflow transformers model for `task`
    ("text-generation" | "text-classification" | "llm/v1/chat"); `info` (plain, deterministic
    values; key `model_path` names the directory in the workspace) is kept as MLmodel
    metadata. base: for a LoRA adapter directory, its base model's workspace-relative path and
    directory."""
    if task not in (*TASKS, CHAT):
        raise ValueError(f"task {task!r}: expected one of {sorted((*TASKS, CHAT))}")
    model_dir = Path(model_dir)
    tok_dir = model_dir / COMPONENTS_DIR / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, tok_dir / name)
    _dump(model_dir / MLMODEL, mlmodel(model_dir, task, info, base))
    write_environment(model_dir, _pinned("mlflow", "transformers", "torch",
                                         *(("peft",) if base else ())))


def write_environment(model_dir: Path, requirements: list[str]) -> None:
    """MLflow's environment files beside MLmodel: requirements.txt, conda.yaml,
    python_env.yaml, as its save_model writes them."""
    (model_dir / "requirements.txt").write_text("\n".join(requirements) + "\n")
    python = platform.python_version()
    _dump(model_dir / "conda.yaml", {
        "channels": ["conda-forge"], "name": "mlflow-env",
        "dependencies": [f"python={python}", "pip", {"pip": requirements}]})
    _dump(model_dir / "python_env.yaml", {
        "python": python, "build_dependencies": _pinned("pip", "setuptools") + ["wheel"],
        "dependencies": ["-r requirements.txt"]})


def write_pyfunc_model(model_dir: Path, loader_module: str, model_signature: Mapping[str, object],
                       info: Mapping[str, object]) -> None:
    """Make `model_dir` an MLflow python_function model loaded by `loader_module`'s
    `_load_pyfunc(model_dir)`, for a directory that holds no transformers model of its own (a
    reward model's heads on a backbone stored elsewhere); `model_signature` as `signature`
    returns it, `info` as for write_mlflow_model. The same environment files; the loader
    module is alignloop's own, so MLflow loads it where alignloop is installed."""
    model_dir = Path(model_dir)
    python = platform.python_version()
    _dump(model_dir / MLMODEL, {
        "flavors": {"python_function": {
            "env": {"conda": "conda.yaml", "virtualenv": "python_env.yaml"},
            "loader_module": loader_module, "python_version": python}},
        "metadata": {"alignloop": dict(info)}, "mlflow_version": _version("mlflow"),
        "signature": dict(model_signature)})
    write_environment(model_dir, _pinned("mlflow", "transformers", "torch"))
