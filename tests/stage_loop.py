"""One iteration of the tiny profile's loop in a temp workspace, every stage's main() called
directly in DAG order, and the helpers the per-stage smoke tests read and copy it with
(tests/test_stages.py, tests/test_stages_training.py, tests/test_stages_evaluate.py). The loop
runs once per test session: the `stage_loop` fixture (tests/conftest.py)."""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import set_params as set_workspace_params
from flows.shipped import PARAMS_DATA
from tasks.core import jsonl, layout
from tasks.models import lm
from tasks.runtime import stage
from tasks.stages import (
    collect_offpolicy,
    evaluate,
    judge,
    prepare_model,
    prompts,
    reference_samples,
    rollout,
    train_rm,
    update,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "params" / "tiny.yaml"
SETUP: list[tuple[str, Callable[[list[str] | None], None]]] = [
    ("prompts", prompts.main), ("prepare_model", prepare_model.main),
    ("collect_offpolicy", collect_offpolicy.main), ("reference_samples", reference_samples.main)]
LOOP: list[tuple[str, Callable[[list[str] | None], None]]] = [
    ("rollout", rollout.main), ("judge", judge.main), ("train_rm", train_rm.main),
    ("update", update.main), ("evaluate", evaluate.main)]


@dataclass
class Workspace:
    root: Path
    policy0_md5: str = ""                                   # right after prepare_model
    fresh_rm: dict[str, torch.Tensor] = field(default_factory=dict)   # train_rm's initial model

    def path(self, rel: str) -> Path:
        return self.root / rel

    def records(self, rel: str) -> list[dict[str, Any]]:
        return [rec for _, rec in jsonl.read(self.path(rel))]

    def metrics(self, rel: str) -> dict[str, float]:
        return json.loads(self.path(rel).read_text())

    def weights(self, rel: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.path(rel) / "model.safetensors"))


def run(main: Callable[[list[str] | None], None], root: Path, it: int = 0) -> None:
    main(["--root", str(root), "--it", str(it)])


def new_workspace(root: Path, params_text: str | None = None) -> Path:
    (root / "params").mkdir(parents=True)
    for name in PARAMS_DATA:                          # the versioned data the stages read
        shutil.copytree(REPO / "params" / name, root / "params" / name)
    (root / layout.PARAMS_FILE).write_text(params_text or TINY.read_text())
    (root / layout.IMPORT_DIR).mkdir(parents=True)
    return root


def copy_workspace(src: Workspace, dst: Path) -> Workspace:
    shutil.copytree(src.root, dst)
    return Workspace(dst, src.policy0_md5)


def set_params(ws: Workspace, **edits: Any) -> None:
    set_workspace_params(ws.path(layout.PARAMS_FILE), **edits)


def tree_digest(path: Path) -> dict[str, str]:
    """{relative path: md5} of every file below path (hidden temp files included)."""
    return {str(f.relative_to(path)): hashlib.md5(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> set[str]:
    assert a.keys() == b.keys()
    return {k for k in a if not torch.equal(a[k], b[k])}


def loop_workspace(root: Path) -> Workspace:
    """One iteration of the whole loop in a new workspace at root, every stage's main() called
    in DAG order."""
    w = Workspace(new_workspace(root))
    init = train_rm.init_reward_model

    def spy(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = init(*args, **kwargs)
        w.fresh_rm.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(stage.THREADS_ENV, "2")
        mp.setattr(train_rm, "init_reward_model", spy)
        for name, main in SETUP:
            run(main, w.root)
            if name == "prepare_model":
                w.policy0_md5 = lm.weights_md5(w.path(layout.policy(0)))
        for _, main in LOOP:
            run(main, w.root, 1)
    return w
