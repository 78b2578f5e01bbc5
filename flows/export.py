"""`alignloop export MODEL DIR [--merge]`: a registered version as a standalone Hugging Face
directory, for serving anywhere (`transformers.AutoModelForCausalLM.from_pretrained(DIR)`).

The version's exact bytes come from the DVC stores by its `model_md5` (flows/restore.py), not
from whatever the workspace has checked out. What is written:

- a full model: its weights, config, generation config and tokenizer files, without the
  workspace's bookkeeping (MLflow's `MLmodel`, environment files and `components/`, the model
  card that names the workspace, `training_curve.json`, `alignloop_*.json`);
- a reward model stored as its heads alone (a frozen backbone's, `train_rm.epochs: 0`): rebuilt
  on its backbone and saved whole (`save_pretrained`; an ensemble's members in `member_<i>/`),
  with the backbone's tokenizer;
- a LoRA adapter with `--merge`: base + adapter merged into plain weights
  (`save_pretrained`), with the adapter's tokenizer;
- a LoRA adapter without `--merge`: the adapter (PEFT's two files and the tokenizer) at DIR's
  root and its base exported as a full model into `DIR/base/`. PEFT loads the base from the
  adapter config's `base_model_name_or_path` as given (a relative path is resolved against the
  working directory, not DIR), so it is written as DIR/base's absolute path:
  `peft.AutoPeftModelForCausalLM.from_pretrained(DIR)` loads it from any working directory.
  A moved DIR loads with `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
  DIR/base), DIR)`.

DIR must not exist or be empty. Everything is written into a temporary sibling and renamed
into place, so a failure or a signal leaves no DIR behind (or the empty one it found).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tasks.core import layout
from tasks.core.errors import InputError

BOOKKEEPING = {"MLmodel", "conda.yaml", "python_env.yaml", "requirements.txt", "README.md",
               "input_example.json", "serving_input_example.json", "registered_model_meta",
               "training_curve.json", "components"}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
BASE_DIR = "base"                     # where an unmerged adapter's base goes, inside DIR


def _portable(name: str) -> bool:
    return name not in BOOKKEEPING and not name.startswith(("alignloop_", "."))


def copy_model_files(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy a model directory's top-level files, less the bookkeeping and `skip`."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and _portable(f.name) and f.name not in skip:
            shutil.copyfile(f, dst / f.name)
            copied.append(f.name)
    return copied


def check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InputError(f"{dest}: exists and is not an empty directory (export writes a new "
                         "one)")
    if not dest.parent.is_dir():
        raise InputError(f"{dest.parent}: no such directory")


def _base_dir(root: Path, src: Path) -> Path:
    """The checked-out base an adapter names, its weights checked against the recorded md5."""
    from tasks.models import adapters, lm
    base_path, base_md5 = adapters.read_base(src)
    base = root / base_path
    lm.check_model_dir(base)
    if lm.weights_md5(base) != base_md5:
        raise InputError(f"{base}: its weights are not the base the adapter names "
                         f"({adapters.BASE_FILE}: base_md5 {base_md5}); `dvc checkout "
                         f"{base_path}` restores it")
    return base


def write_adapter(root: Path, src: Path, out: Path, final: Path, merge: bool) -> str:
    """An adapter directory `src` exported into `out` (to be renamed to `final`)."""
    from tasks.models import adapters
    base = _base_dir(root, src)
    if merge:
        plain = adapters.merged(adapters.load_policy(src, root), in_place=True)
        plain.save_pretrained(out)
        copy_model_files(src, out, skip=ADAPTER_FILES)         # the tokenizer
        return f"LoRA adapter merged into its base ({base.relative_to(root).as_posix()})"
    copy_model_files(src, out)
    copy_model_files(base, out / BASE_DIR)
    config_file = out / adapters.ADAPTER_CONFIG
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(final / BASE_DIR)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return (f"LoRA adapter, its base ({base.relative_to(root).as_posix()}) in "
            f"{BASE_DIR}/")


def write_heads_only_rm(root: Path, src: Path, out: Path) -> str:
    """A head-only reward model `src` rebuilt on its backbone and saved whole into `out`."""
    from tasks.reward import reward_model
    backbone = reward_model.backbone_dir(src, root)              # checked against its md5
    ensemble = reward_model.load_reward_model(src, root=root)
    reward_model.save_reward_model(list(ensemble.members), out)
    for name in os.listdir(backbone):                             # its tokenizer
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens",
                            "chat_template")):
            shutil.copyfile(backbone / name, out / name)
    return (f"reward model: its heads on the first blocks of "
            f"{backbone.relative_to(root).as_posix()}, saved whole")


def export_dir(root: Path, src: Path, dest: Path, merge: bool, label: str = "") -> str:
    """Write the model directory `src` (a version's bytes) as the standalone `dest`; returns
    what was written, in words."""
    from tasks.models import adapters
    check_destination(dest)
    adapter = adapters.is_adapter_dir(src)
    if merge and not adapter:
        raise InputError(f"--merge: {label or src} is a full model, not a LoRA adapter; "
                         "export it without --merge")
    tmp = dest.parent / f".{dest.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if adapter:
            what = write_adapter(root, src, tmp, dest.resolve(), merge)
        elif (src / layout.ADAPTER_BASE).is_file():                   # a head-only reward model
            what = write_heads_only_rm(root, src, tmp)
        else:
            copy_model_files(src, tmp)
            what = "full model"
        if dest.exists():
            dest.rmdir()                                  # the empty directory it found
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return what


def export_version(root: Path, state: Path, mv: Any, dest: Path, merge: bool) -> str:
    """A registered version's bytes (from the DVC stores), exported to `dest`."""
    from flows import archived, restore
    tags = dict(mv.tags)
    try:
        src = restore.materialise(root, state, tags.get("model_path", "?"),
                                  tags.get("model_md5", ""))
    except restore.NotRestorable as e:
        if tags.get(archived.TAG):
            raise InputError(f"{mv.name} v{mv.version}: weights archived "
                             f"({tags[archived.TAG]}); nothing to export") from None
        raise InputError(f"{mv.name} v{mv.version}: {e}") from None
    return export_dir(root, src, dest, merge, f"{mv.name} v{mv.version}")
