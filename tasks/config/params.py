"""Typed, frozen parameters for every stage, loaded from one profile YAML file.

Each top-level section of a profile (``params/tiny.yaml``, ``params/default.yaml``) maps to one
frozen dataclass, defined in its own module in tasks/schemas/; this module is the loader and
what spans sections (the iterations, the run seed and device, the checks across sections).
Unknown keys, wrong types and out-of-range values fail at load time with the file, line and
dotted key named, e.g. ``params.yaml:12: train_rm.lr: expected a finite number, got 'x'``.
"""
from __future__ import annotations

import dataclasses
import math
import posixpath
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# the loader's names, re-exported
from tasks.config.profiles import (  # noqa: F401
    SAFE_LOADER,
    ParamsError,
    Profile,
    Where,
    parse_text,
    read_profile,
)
from tasks.core import layout

# the schema, one module per section (tasks/schemas/), re-exported here for the flow, the tests
# and the benchmarks, which load whole profiles. Modules in tasks/ import a class from its own
# schema module: a stage's source deps hold the schemas of the sections it declares only.
from tasks.schemas.evaluate import (  # noqa: F401
    BestOfNParams,
    EvaluateParams,
    GoldParams,
    MonitorParams,
)
from tasks.schemas.gate import GateParams  # noqa: F401
from tasks.schemas.generation import GenerationParams  # noqa: F401
from tasks.schemas.judge import JudgeParams  # noqa: F401
from tasks.schemas.model import ModelParams, TinyModelParams  # noqa: F401
from tasks.schemas.offpolicy import OffpolicyParams  # noqa: F401
from tasks.schemas.prompts import PromptParams  # noqa: F401
from tasks.schemas.rollout import RolloutParams  # noqa: F401
from tasks.schemas.targets import TargetParams  # noqa: F401
from tasks.schemas.train_rm import TrainRMParams  # noqa: F401
from tasks.schemas.update import (  # noqa: F401
    DPOParams,
    KLBudgetParams,
    LoraParams,
    PPOParams,
    ReuseParams,
    UpdateParams,
)


@dataclass(frozen=True)
class Iteration:
    """One item of the `iterations` mapping: its key names the iteration ("1", "2", ...)."""
    prev: int                       # the iteration whose policy and pair pool this one starts
                                    #   from (0 = the initial model and the off-policy pool);
                                    #   a tick writes the champion's, so a refused iteration is
                                    #   a branch nothing builds on


@dataclass(frozen=True)
class Params:
    iterations: dict[str, Iteration]  # the DAG is unrolled over these: "1": {prev: 0}, "2": {prev:
                                    #   1}, ... (the key names the iteration; prev: the earlier one
                                    #   whose policy and pair pool it starts from, 0 = the initial
                                    #   model)
    seed: int = 0                   # one seed for the run; every stage derives its RNG from it
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto (cuda when torch sees one) | cpu |
                                    #   cuda: where the torch stages run; bf16 autocast on cuda; a
                                    #   DVC param of those stages (moving it reruns them)
    model: ModelParams = field(default_factory=ModelParams)
    prompts: PromptParams = field(default_factory=PromptParams)
    offpolicy: OffpolicyParams = field(default_factory=OffpolicyParams)
    judge: JudgeParams = field(default_factory=JudgeParams)
    rollout: RolloutParams = field(default_factory=RolloutParams)
    train_rm: TrainRMParams = field(default_factory=TrainRMParams)
    update: UpdateParams = field(default_factory=UpdateParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    gate: GateParams = field(default_factory=GateParams)
    targets: TargetParams = field(default_factory=TargetParams)


class _Builder:
    def __init__(self, source: str, lines: dict[tuple[str, ...], Where]):
        self.source, self.lines = source, lines

    def fail(self, path: tuple[str, ...], msg: str) -> typing.NoReturn:
        """Fail naming the file and line of the key (or of the nearest key above it that a
        file wrote: a default has none), base or overlay."""
        file, line = next((self.lines[path[:n]] for n in range(len(path), -1, -1)
                           if path[:n] in self.lines), (self.source, 1))
        raise ParamsError(f"{file}:{line}: {'.'.join(path) or '<top>'}: {msg}")

    def build(self, tp: Any, value: Any, path: tuple[str, ...]) -> Any:
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            return self._dataclass(tp, value, path)
        if origin is Literal:
            if value not in typing.get_args(tp):
                self.fail(path, f"expected one of {list(typing.get_args(tp))}, got {value!r}")
            return value
        if origin is dict:
            if not isinstance(value, dict) or not value:
                self.fail(path, "expected a non-empty mapping")
            item_tp = typing.get_args(tp)[1]
            return {str(k): self.build(item_tp, v, path + (str(k),)) for k, v in value.items()}
        if origin is tuple:             # empty: what the field says it means (no grid, ...)
            if not isinstance(value, list):
                self.fail(path, "expected a list")
            item_tp = typing.get_args(tp)[0]
            return tuple(self.build(item_tp, v, path + (str(i),)) for i, v in enumerate(value))
        if tp is bool:
            if not isinstance(value, bool):
                self.fail(path, f"expected true/false, got {value!r}")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                self.fail(path, f"expected an integer, got {value!r}")
            return value
        if tp is float:
            return self._float(value, path)
        if tp is str:
            if not isinstance(value, str):
                self.fail(path, f"expected a string, got {value!r}")
            return value
        raise TypeError(f"unsupported params type {tp!r}")  # a schema bug, not a user error

    def _float(self, value: Any, path: tuple[str, ...]) -> float:
        if isinstance(value, bool):
            self.fail(path, f"expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):   # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None or not math.isfinite(number):
            self.fail(path, f"expected a finite number, got {value!r}")
        return number

    def _dataclass(self, tp: type, value: Any, path: tuple[str, ...]) -> Any:
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            self.fail(path + (str(unknown[0]),),
                      f"unknown key (allowed: {', '.join(sorted(fields))})")
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = self.build(hints[name], value[name], path + (name,))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self.fail(path + (name,), "missing required key")
        return tp(**kwargs)


def parse_params(text: str, source: str = "<params>") -> Params:
    """Parse and validate a profile's text (no `base:`: that needs its file, `load_params`);
    raises ParamsError naming source, line and key."""
    return _build(parse_text(text, source), source)


def _build(profile: Profile, source: str) -> Params:
    builder = _Builder(source, profile.lines)
    params = builder.build(Params, _resolve_auto_mix(profile.data), ())
    _check_ranges(params, builder)
    return params


AUTO = "auto"
IMPORT_OFFPOLICY_MIX = 0.5   # auto, offpolicy.source: import: half of DPO's pairs from the pool


def _resolve_auto_mix(data: Any) -> Any:
    """`update.dpo.offpolicy_mix: auto` (or the key left out) -> a number: with imported pairs
    (`offpolicy.source: import`) IMPORT_OFFPOLICY_MIX, so they train the policy as well as the
    reward model; with a cold start 0.0 (DPO on the on-policy pairs alone). A malformed file is
    returned as it is, for the builder to report."""
    if not isinstance(data, dict):
        return data
    update, off = data.get("update", {}), data.get("offpolicy", {})
    dpo = update.get("dpo", {}) if isinstance(update, dict) else None
    if not (isinstance(dpo, dict) and isinstance(off, dict)) or \
            dpo.get("offpolicy_mix", AUTO) != AUTO:
        return data
    source = off.get("source", OffpolicyParams.source)
    mix = IMPORT_OFFPOLICY_MIX if source == "import" else 0.0
    return {**data, "update": {**update, "dpo": {**dpo, "offpolicy_mix": mix}}}


def load_params(path: str | Path) -> Params:
    """A profile file, with the profile it names as its `base:` merged under it (and that
    one's, ...: tasks/config/profiles.py); errors name the file that holds the bad key."""
    return _build(read_profile(path), str(path))


def _check_ranges(p: Params, b: _Builder) -> None:
    keys = list(p.iterations)
    if keys != [str(k) for k in range(1, len(keys) + 1)]:
        b.fail(("iterations",), f"iterations must be keyed \"1\"..\"N\" in order, got {keys}")
    for key, item in p.iterations.items():
        if not 0 <= item.prev < int(key):
            b.fail(("iterations", key, "prev"), f"prev must be an earlier iteration (0 to "
                   f"{int(key) - 1}), got {item.prev}")
    positive = {
        ("prompts", "n_train"): p.prompts.n_train, ("prompts", "n_heldout"): p.prompts.n_heldout,
        ("rollout", "samples_per_prompt"): p.rollout.samples_per_prompt,
        ("train_rm", "lr"): p.train_rm.lr, ("update", "dpo", "beta"): p.update.dpo.beta,
        ("update", "ppo", "clip"): p.update.ppo.clip,
        ("judge", "pairs_per_prompt"): p.judge.pairs_per_prompt,
        ("judge", "max_new_tokens"): p.judge.max_new_tokens,
        ("judge", "comparisons_per_prompt"): p.judge.comparisons_per_prompt,
        ("judge", "max_concurrency"): p.judge.max_concurrency,
        ("judge", "timeout_s"): p.judge.timeout_s,
    }
    for path, value in positive.items():
        if value <= 0:
            b.fail(path, f"must be > 0, got {value}")
    _check_sizes(p, b)
    _check_device(p, b)
    _check_import_path(p, b)
    if p.rollout.samples_per_prompt < 2:
        b.fail(("rollout", "samples_per_prompt"), "need at least 2 samples to form a pair")
    if 2 * p.judge.pairs_per_prompt > p.rollout.samples_per_prompt:
        b.fail(("judge", "pairs_per_prompt"), f"{p.judge.pairs_per_prompt} disjoint pairs need "
               f"{2 * p.judge.pairs_per_prompt} samples, rollout has "
               f"{p.rollout.samples_per_prompt}")
    if not 0.0 < p.train_rm.heldout_fraction < 1.0:
        b.fail(("train_rm", "heldout_fraction"), "must be in (0, 1)")
    if p.gate.production != 0 and str(p.gate.production) not in p.iterations:
        b.fail(("gate", "production"), f"must be 0 (nothing in production: the reference) or "
               f"an iteration the params list, got {p.gate.production}")
    _check_dpo_and_rm(p, b)
    _check_ppo(p, b)
    _check_lora(p, b)
    _check_judge(p, b)
    if p.model.source == "hf_dir" and not p.model.path:
        b.fail(("model", "path"), "model.source is hf_dir but model.path is empty")


# sizes, counts, epochs and learning rates a stage divides by or loops over: 0 or less runs no
# step (a negative batch size trained nothing, silently), so they fail here, file and line named
POSITIVE = (
    "model.max_prompt_tokens", "model.tiny.hidden_size", "model.tiny.num_layers",
    "model.tiny.num_heads", "model.tiny.intermediate_size", "model.tiny.max_position_embeddings",
    "offpolicy.n_prompts", "offpolicy.samples_per_prompt",
    "offpolicy.generation.max_new_tokens", "offpolicy.generation.batch_size",
    "rollout.n_prompts", "rollout.generation.max_new_tokens", "rollout.generation.batch_size",
    "rollout.workers", "judge.workers", "evaluate.workers",
    "train_rm.batch_size", "train_rm.max_length",
    "update.max_length", "update.dpo.lr", "update.dpo.epochs", "update.dpo.batch_size",
    "update.ppo.lr", "update.ppo.epochs", "update.ppo.minibatch_size", "update.ppo.value_lr",
    "update.kl_budget.check_every", "update.kl_budget.n_prompts",
    "evaluate.n_prompts", "evaluate.bootstrap", "evaluate.generation.max_new_tokens",
    "evaluate.generation.batch_size", "evaluate.best_of_n.n_prompts",
    "evaluate.redteam.samples_per_prompt",
)


def _check_sizes(p: Params, b: _Builder) -> None:
    for dotted in POSITIVE:
        path = tuple(dotted.split("."))
        value: Any = p
        for part in path:
            value = getattr(value, part)
        if value <= 0:
            b.fail(path, f"must be > 0, got {value}")
    if p.train_rm.epochs < 0 or (p.train_rm.epochs == 0 and p.train_rm.head_init != "probe"):
        b.fail(("train_rm", "epochs"), f"must be > 0 (or 0 with head_init: probe, the probe "
               f"alone), got {p.train_rm.epochs}")
    kl = p.update.kl_budget
    for key in ("total", "per_iteration", "backtrack"):
        if getattr(kl, key) < 0:
            b.fail(("update", "kl_budget", key), f"must be >= 0 (0 = off), got {getattr(kl, key)}")
    if p.evaluate.best_of_n.n < 0:
        b.fail(("evaluate", "best_of_n", "n"), f"must be >= 0 (0 = off), got "
               f"{p.evaluate.best_of_n.n}")


def _check_device(p: Params, b: _Builder) -> None:
    if p.device == "cuda":
        import torch  # only here: loading a cpu or auto profile imports no torch
        if not torch.cuda.is_available():
            b.fail(("device",), "cuda requested, but torch sees no CUDA device "
                   "(torch.cuda.is_available() is False); use device: auto or cpu")


def _check_import_path(p: Params, b: _Builder) -> None:
    """Imports are read from inside the workspace's data/import/ only: the one import location
    dvc.yaml declares (a path outside it is read, yet no edit of it reruns anything)."""
    raw = p.offpolicy.import_path
    norm = posixpath.normpath(raw.replace("\\", "/")) if raw else ""
    if raw.startswith(("/", "~")) or ".." in norm.split("/") or \
            not norm.startswith(layout.IMPORT_DIR + "/"):
        b.fail(("offpolicy", "import_path"), f"{raw!r} is not inside the workspace's "
               f"{layout.IMPORT_DIR}/; bring the file in with `alignloop import FILE "
               f"--workspace WORKSPACE` (it writes {layout.IMPORT_PAIRS})")


def _check_judge(p: Params, b: _Builder) -> None:
    j = p.judge
    if j.max_retries < 0 or j.backoff_s < 0:
        b.fail(("judge", "max_retries" if j.max_retries < 0 else "backoff_s"), "must be >= 0")
    if j.kind in ("llm", "reward_model") and not j.model:
        b.fail(("judge", "model"), f"judge.kind {j.kind} needs judge.model (a local model "
               "directory)")
    if j.max_length < 1:
        b.fail(("judge", "max_length"), "must be >= 1")
    if j.workers > 1 and j.kind in ("llm", "http"):
        b.fail(("judge", "workers"), f"judge.kind {j.kind} compares its pairs in the stage "
               "process (http: max_concurrency sets its parallelism); workers > 1 is for the "
               "pointwise kinds (lexicon, lexicon_topic, lexicon_review, reward_model)")
    if j.kind == "http" and j.decoding != "greedy":
        b.fail(("judge", "decoding"), "the http judge decodes greedily (temperature 0); "
               "logprob is for judge.kind: llm")
    if j.kind in ("llm", "http") and not j.template.startswith("params/judges/"):
        b.fail(("judge", "template"), f"{j.template!r}: templates live in params/judges/ (the "
               "versioned files synced into the workspace)")


def _check_dpo_and_rm(p: Params, b: _Builder) -> None:
    d, rm = p.update.dpo, p.train_rm
    if not 0.0 <= d.label_smoothing < 0.5:
        b.fail(("update", "dpo", "label_smoothing"), "must be in [0, 0.5)")
    if d.label_smoothing > 0 and d.loss != "cdpo":
        b.fail(("update", "dpo", "label_smoothing"), f"only used by loss: cdpo, not {d.loss}")
    if d.sft_weight < 0:
        b.fail(("update", "dpo", "sft_weight"), f"must be >= 0, got {d.sft_weight}")
    if not 0.0 <= d.offpolicy_mix < 1.0:
        b.fail(("update", "dpo", "offpolicy_mix"), "must be in [0, 1)")
    if d.offpolicy_weight < 0:
        b.fail(("update", "dpo", "offpolicy_weight"), "must be >= 0")
    if d.is_truncate < 1.0:
        b.fail(("update", "dpo", "is_truncate"), f"must be >= 1 (a pair as likely under the "
               f"policy as under its sampler keeps weight 1), got {d.is_truncate}")
    if d.max_staleness < 0:
        b.fail(("update", "dpo", "max_staleness"), f"must be >= 0 (0 = keep all), got "
               f"{d.max_staleness}")
    if d.offline_pairs < 0:
        b.fail(("update", "dpo", "offline_pairs"), f"must be >= 0 (0 = all), got "
               f"{d.offline_pairs}")
    for it in p.rollout.offline:
        if str(it) not in p.iterations:
            b.fail(("rollout", "offline"), f"{it} is not an iteration (iterations: "
                   f"{', '.join(p.iterations) or 'none'})")
    if p.rollout.offline and p.update.algo != "dpo":
        b.fail(("rollout", "offline"), f"offline iterations train on the pair pool, which only "
               f"DPO reads; update.algo is {p.update.algo}")
    if rm.margin < 0:
        b.fail(("train_rm", "margin"), "must be >= 0")
    if rm.ensemble < 1:
        b.fail(("train_rm", "ensemble"), "must be >= 1")
    for key in ("audit_top_n", "audit_random_n", "num_layers", "stats_pairs", "freeze_layers"):
        if getattr(rm, key) < 0:
            b.fail(("train_rm", key), "must be >= 0")
    if any(n < 1 for n in rm.num_layers_grid):
        b.fail(("train_rm", "num_layers_grid"), f"every entry must be >= 1, got "
               f"{list(rm.num_layers_grid)}")
    kept = min(rm.num_layers_grid) if rm.num_layers_grid else rm.num_layers
    if rm.freeze_layers > 0 and 0 < kept <= rm.freeze_layers:
        b.fail(("train_rm", "freeze_layers"), f"must be below the blocks the reward model keeps "
               f"({kept}: the last one trains), got {rm.freeze_layers}")
    for path, n in ((("train_rm", "processes"), rm.processes),
                    (("update", "processes"), p.update.processes)):
        if n < 1:
            b.fail(path, f"must be >= 1, got {n}")


def _check_ppo(p: Params, b: _Builder) -> None:
    q, path = p.update.ppo, ("update", "ppo")
    for key in ("gamma", "lam"):
        if not 0.0 <= getattr(q, key) <= 1.0:
            b.fail(path + (key,), "must be in [0, 1]")
    for key in ("value_clip", "target_kl", "no_eos_penalty", "reward_clip"):
        if getattr(q, key) < 0:
            b.fail(path + (key,), "must be >= 0")
    r = q.reuse
    if r.iterations_back < 0:
        b.fail(path + ("reuse", "iterations_back"), f"must be >= 0, got {r.iterations_back}")
    if len(r.truncate) != 2 or not 0.0 <= r.truncate[0] <= 1.0 <= r.truncate[1]:
        b.fail(path + ("reuse", "truncate"), f"must be [lo, hi] with 0 <= lo <= 1 <= hi, "
               f"got {list(r.truncate)}")
    if r.max_staleness < 1:
        b.fail(path + ("reuse", "max_staleness"), "must be >= 1")
    if r.max_staleness < r.iterations_back:
        b.fail(path + ("reuse", "max_staleness"), f"must be >= iterations_back "
               f"({r.iterations_back}), got {r.max_staleness}: rollouts older than it are "
               "dropped, so it would cap iterations_back")


def _check_lora(p: Params, b: _Builder) -> None:
    lo, path = p.update.lora, ("update", "lora")
    if lo.r < 0:
        b.fail(path + ("r",), f"must be >= 0 (0 = off: a full fine-tune), got {lo.r}")
    if lo.alpha <= 0:
        b.fail(path + ("alpha",), f"must be > 0, got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        b.fail(path + ("dropout",), f"must be in [0, 1), got {lo.dropout}")
    names = list(lo.target_modules)
    if not names:
        b.fail(path + ("target_modules",), "expected a non-empty list")
    if not all(names) or len(set(names)) != len(names):
        b.fail(path + ("target_modules",), f"must be distinct, non-empty module names, got {names}")
    if lo.r > 0 and p.update.processes > 1:
        b.fail(path + ("r",), "LoRA trains on one process: set update.processes: 1 (an adapter's "
               "update is small; its ranks would each hold the whole base)")


def prev_of(params: Any, it: int) -> int:
    """Iteration `it`'s `prev` as params.yaml declares it (dvc.yaml's `${item.prev}`: the DAG's
    shape, which every stage may read); it - 1 for an iteration the params do not list."""
    item = params.iterations.get(str(it)) if it > 0 else None
    return item.prev if item is not None else max(it - 1, 0)


def lineage(params: Any, it: int) -> list[int]:
    """The policy versions behind update@it, newest first: the policy it starts from (its
    `prev`), that one's prev, ..., 0. A sample drawn by lineage[j] is j versions stale."""
    chain = [prev_of(params, it)]
    while chain[-1] > 0:
        chain.append(prev_of(params, chain[-1]))
    return chain


def sampler_of(params: Any, origin: int) -> int:
    """The policy that drew iteration `origin`'s samples: rollout@k samples policy(prev of k);
    iteration 0's (the cold start, and imported pairs) the initial model."""
    return prev_of(params, origin) if origin > 0 else 0


def iteration_numbers(p: Params) -> list[int]:
    return [int(k) for k in p.iterations]


def to_dict(obj: Any) -> Any:
    """Plain-data view (for MLflow params and metadata files)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    return obj

