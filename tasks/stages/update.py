"""Stage `update`: one policy update per iteration, DPO or PPO as params select.

- `dpo`: DPO (sigmoid, IPO or cDPO) on best-vs-worst pairs of this iteration's samples from
  the current policy (online/iterative DPO), ranked by the judge or by this iteration's reward
  model, optionally mixed with off-policy pairs from the previous pool (fresh enough, weighted
  by a fixed weight or a truncated importance ratio: tasks/policy/pair_reuse.py); against the
  reference. An offline iteration (`rollout.offline`) has no samples of its own and trains on
  the previous pool alone (`update.dpo.offline_pairs` of its fresh pairs, weighted the same
  way): a new base re-aligned from the mistake book.
- `ppo`: clipped PPO with a value head (GAE, value clipping, early stop on approx KL) on this
  iteration's rollouts (optionally also those of up to N earlier policy versions, kept in the
  previous policy directory's replay file and reweighted by truncated importance ratios),
  rewarded by this iteration's reward model, KL to the reference in the reward or the loss;
  the value head is saved in the policy directory for the next iteration.
The reference is an explicit, versioned input: the initial model or the previous policy.

With `update.lora.r > 0` the policy trains a LoRA adapter (tasks/models/adapters.py): iteration
1 attaches a fresh one to the initial model, iteration k continues from k-1's, and the policy
directory holds the adapter alone, naming its base by path and md5. The reference is computed by
the same model: `initial` with the adapter switched off, `previous` with k-1's adapter, loaded
frozen beside the trained one (a second adapter, not a second base).
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase as Tokenizer

from tasks.config import conditions
from tasks.config.params import Params, lineage, sampler_of
from tasks.core import atomic, jsonl, layout
from tasks.core.jsonl import DataError
from tasks.data.records import Rollout, parse_pair, parse_rollout
from tasks.functional import offpolicy
from tasks.models import adapters, lm, mlflow_model, model_card
from tasks.policy import pair_reuse, value_head
from tasks.policy.dpo import offpolicy_indices, rm_best_vs_worst, train_dpo
from tasks.policy.kl_budget import KLGuard, guard_prompts
from tasks.policy.ppo import REPLAY_FILE, Staleness, replay_for_next, reuse_window, train_ppo
from tasks.reward.features import EncodedPair
from tasks.reward.reward_model import encode_pairs, load_reward_model, load_stats, rewards
from tasks.runtime import distributed
from tasks.runtime.device import device_of
from tasks.runtime.distributed import SINGLE, Group

CONTRACT = stage.Contract(
    "update",
    params=("device", "seed", "model.max_prompt_tokens", "update",
            "offpolicy.source",       # update.dpo.offpolicy_mix: auto resolves by it
            "rollout.offline",        # an offline iteration trains on the pool alone
            "evaluate.generation"),   # the KL budget samples as the evaluation does
    deps=lambda it, prev: (layout.pairs(it), layout.rollouts(it), layout.pairs_pool(prev),
                           layout.reward_model(it), layout.policy(0), layout.policy(prev)),
    outs=lambda it, prev: (layout.policy(it),),
    metrics=lambda it, prev: (layout.metrics(it, "update"),),
    when={"update_reads_judge_pairs": lambda it, prev: (layout.pairs(it),),
          "update_reads_reward_model": lambda it, prev: (layout.rollouts(it),
                                                         layout.reward_model(it)),
          "update_reads_pair_pool": lambda it, prev: (layout.pairs_pool(prev),),
          "update_reads_initial_policy": lambda it, prev: (layout.policy(0),)})


def reference_dir(p: Params, it: int) -> str:
    return layout.policy(0) if p.update.reference == "initial" else \
        layout.policy(stage.prev_of(p, it))


Writer = Callable[[Path], None]   # writes an extra file into the new policy directory


@dataclass(frozen=True)
class UpdateResult:
    """What every update algorithm hands the stage: its `update/` metrics, and the files it
    keeps beside the new policy's weights (PPO: its value head and the rollouts update@{it+1}
    reuses; DPO: none), each written into the policy directory before it is committed."""
    metrics: dict[str, float]
    extra_files: tuple[Writer, ...] = ()
    curve: tuple[dict[str, float], ...] = ()    # per optimiser step (training_curve.json)


@dataclass
class Models:
    """The policy an update trains and its reference; `initial()` is the initial model (the KL
    budget's measure), loaded only when neither of them computes it already."""
    policy: torch.nn.Module
    ref: torch.nn.Module
    root: Path
    reference: str                     # update.reference
    base_is_initial: bool = False      # a LoRA policy on iteration 0's model

    def initial(self) -> torch.nn.Module:
        if self.reference == "initial":
            return self.ref
        if self.base_is_initial:        # the adapter switched off
            return adapters.ReferenceView(self.policy)
        initial = lm.load_causal_lm(self.root / layout.policy(0), device_of(self.policy))
        for q in initial.parameters():
            q.requires_grad_(False)
        return initial


def staleness_of(p: Params, it: int) -> Staleness:
    """Policy versions between the sampler of an iteration's samples and the policy update@it
    starts from, along the `prev` chain (0: on-policy)."""
    chain = lineage(p, it)
    return lambda origin: offpolicy.versions_back([sampler_of(p, origin)], chain)[0]


def run_dpo(models: Models, tok: Tokenizer, p: Params, root: Path, it: int, rng: torch.Generator,
            group: Group = SINGLE) -> UpdateResult:
    """DPO on this iteration's on-policy pairs (picked by `pair_source`), plus `offpolicy_mix`
    of the previous pool's pairs no more than `max_staleness` versions old, each at its
    `offpolicy_weighting` weight; every rank reads and encodes the same pairs, then trains on
    its shard of each batch."""
    policy, ref = models.policy, models.ref
    d, pad = p.update.dpo, tok.pad_token_id
    mpt, max_len = p.model.max_prompt_tokens, p.update.max_length
    encode = lambda ps: encode_pairs(tok, ps, mpt, max_len)
    metrics: dict[str, float] = {}
    offline = it in p.rollout.offline
    if offline:                     # no samples of its own: the pool alone
        onpolicy: list[EncodedPair] = []
    elif conditions.holds("update_reads_reward_model", p):   # best vs worst of K by this RM
        path = str(root / layout.rollouts(it))
        rollouts = [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]
        rm = load_reward_model(root / layout.reward_model(it), device_of(policy))
        onpolicy, metrics = rm_best_vs_worst(rm, rollouts, pad, max_len)
    else:                           # best vs worst by the judge (judge@it)
        path = str(root / layout.pairs(it))
        onpolicy = encode([parse_pair(rec, path, n, f"iter_{it}") for n, rec in jsonl.read(path)])
    offpolicy, off_weights = [], torch.zeros(0)
    if conditions.holds("update_reads_pair_pool", p):   # a share of the previous pool
        offpolicy, off_weights, reuse = reused_pairs(models, tok, p, root, it, len(onpolicy),
                                                     offline)
        metrics.update(reuse)
    if offline and not offpolicy:
        raise DataError(f"{root / layout.pairs_pool(stage.prev_of(p, it))}: no pairs fresh "
                        f"enough to train offline iteration {it} on (update.dpo.max_staleness "
                        f"{d.max_staleness}); bring a book with `alignloop import`")
    weights = torch.cat([torch.ones(len(onpolicy)), off_weights.float()]).to(device_of(policy))
    curve: list[dict[str, float]] = []
    guard = kl_guard(models, tok, p, it, [x.prompt_ids for x in onpolicy or offpolicy],
                     stage.generator(p.seed, 10, it))
    metrics.update(train_dpo(policy, ref, onpolicy + offpolicy, p=d, pad_id=pad, rng=rng,
                             weights=weights, group=group, curve=curve, guard=guard))
    bf16 = lm.effective_precision(d.precision, device_of(policy)) == "bf16"
    metrics.update({"update/bf16": float(bf16),
                    "update/n_onpolicy_pairs": float(len(onpolicy)),
                    "update/n_offpolicy_pairs": float(len(offpolicy)),
                    "update/offline": float(offline),
                    "update/offpolicy_weight": d.offpolicy_weight})
    return UpdateResult(metrics, curve=tuple(curve))


def reused_pairs(models: Models, tok: Tokenizer, p: Params, root: Path, it: int,
                 n_onpolicy: int, offline: bool = False
                 ) -> tuple[list[EncodedPair], torch.Tensor, dict[str, float]]:
    """The previous pool's pairs DPO reuses, encoded, their loss weights (N,) and metrics:
    the pool less the pairs older than `max_staleness`, `offpolicy_mix` of it drawn (offline:
    `offline_pairs` of it, 0 = all), weighted (tasks/policy/pair_reuse.py)."""
    d = p.update.dpo
    pool_path = str(root / layout.pairs_pool(stage.prev_of(p, it)))
    pool, origins = [], []
    for n, rec in jsonl.read(pool_path):
        pair = parse_pair(rec, pool_path, n, "unknown")
        pool.append(pair)
        origins.append(pair_reuse.origin_of(pair, f"{pool_path}:{n}"))
    age = staleness_of(p, it)
    ages = [age(o) for o in origins]
    keep = [i for i, ok in enumerate(pair_reuse.fresh(ages, d.max_staleness)) if ok]
    rng = stage.generator(p.seed, 7, it)
    pick = [keep[i] for i in (pair_reuse.offline_indices(
                                  [pair_reuse.is_dpo_pair(pool[k]) for k in keep],
                                  d.offline_pairs, rng)
                              if offline else
                              offpolicy_indices(n_onpolicy, len(keep), d.offpolicy_mix, rng))]
    picked = [pool[i] for i in pick]
    encoded = encode_pairs(tok, picked, p.model.max_prompt_tokens, p.update.max_length)
    behaviour = [pair_reuse.behaviour_logprobs(x, e) for x, e in zip(picked, encoded)]
    has = [b is not None for b in behaviour]
    lr_c = lr_r = torch.zeros(len(picked))
    if d.offpolicy_weighting == "is" and any(has):
        at = [i for i, h in enumerate(has) if h]
        c, r = pair_reuse.start_log_ratios(models.policy, [encoded[i] for i in at],
                                           [behaviour[i] for i in at],  # type: ignore[misc]
                                           tok.pad_token_id, d.batch_size, d.precision)
        lr_c, lr_r = lr_c.clone(), lr_r.clone()
        lr_c[at], lr_r[at] = c.cpu(), r.cpu()
    weights, metrics = pair_reuse.pair_weights(lr_c, lr_r, has, [pair_reuse.origin_label(
                                                   pool[i], origins[i]) for i in pick],
                                               [ages[i] for i in pick], d)
    metrics["update/offpolicy_dropped_stale"] = float(len(pool) - len(keep))
    return encoded, weights, metrics


def kl_guard(models: Models, tok: Tokenizer, p: Params, it: int,
             prompts: list[tuple[int, ...]], rng: torch.Generator) -> KLGuard | None:
    """The KL budget's guard (tasks/policy/kl_budget.py) on this iteration's on-policy prompts,
    against the initial model; None when the profile sets no budget. Starting from the initial
    model (prev 0; a LoRA policy's new adapter changes nothing before its first step), the
    start's KL is 0 and is not measured."""
    b = p.update.kl_budget
    if b.total <= 0:
        return None
    return KLGuard(models.policy, models.initial(), guard_prompts(prompts, b.n_prompts),
                   p.evaluate.generation,
                   b, tok.eos_token_id, tok.pad_token_id, rng,
                   start_known=0.0 if stage.prev_of(p, it) == 0 else None)


def _scores(rm: torch.nn.Module, stats: dict[str, float], rollouts: list[Rollout],
            pad: int) -> torch.Tensor:
    """RM scores normalised with the stats stored with the RM, shape (B,)."""
    with torch.no_grad():
        raw = torch.cat([rewards(rm, [r.prompt_ids for r in rollouts[s: s + 32]],
                                 [r.response_ids for r in rollouts[s: s + 32]], pad)
                         for s in range(0, len(rollouts), 32)]) if rollouts else \
            torch.zeros(0, device=device_of(rm))
    return (raw - stats["mean"]) / max(stats["std"], 1e-6)               # normalised RM reward


def _read_rollouts(path: Path) -> list[Rollout]:
    if not path.is_file():
        return []
    rollouts = [parse_rollout(rec, str(path), n) for n, rec in jsonl.read(path)]
    return [r for r in rollouts if r.response_ids]


def run_ppo(models: Models, tok: Tokenizer, p: Params, root: Path, it: int, rng: torch.Generator,
            group: Group = SINGLE) -> UpdateResult:
    """PPO on this iteration's rollouts; with reuse.iterations_back = N also on those of up to
    N policy versions before, which the previous update kept in its policy directory (its
    replay file: a declared out of update@prev and dep of update@it, so the lineage's
    rollouts, never a sibling branch's); this update keeps its own and those still within N
    for the next. The critic starts from update@prev's value head (value_reuse). On several
    ranks rank 0 scores the rollouts and shares the scores."""
    policy, ref = models.policy, models.ref
    q, pad = p.update.ppo, tok.pad_token_id
    rollouts = _read_rollouts(root / layout.rollouts(it))
    prev_dir = root / layout.policy(stage.prev_of(p, it))
    reused = _read_rollouts(prev_dir / REPLAY_FILE) if reuse_window(q) >= 1 else []
    age = staleness_of(p, it)
    rm_dir = root / layout.reward_model(it)
    device = device_of(policy)
    rm, stats = load_reward_model(rm_dir, device), load_stats(rm_dir)
    head, loaded = value_head.load_or_init(prev_dir, policy.config.hidden_size,
                                           q.value_reuse, device)

    def scored(rs: list[Rollout]) -> torch.Tensor:     # rank 0 scores, the others receive
        if not rs or group.world == 1:
            return _scores(rm, stats, rs, pad)
        return group.share(_scores(rm, stats, rs, pad) if group.main else None, len(rs), 0,
                           device)

    curve: list[dict[str, float]] = []
    metrics = train_ppo(policy, head, ref, rollouts, scored(rollouts), p=q, pad_id=pad, rng=rng,
                        it=it, reused=reused, reused_scores=scored(reused), group=group,
                        curve=curve, staleness=age)
    metrics["update/value_head_reused"] = float(loaded)
    writers: list[Writer] = [lambda d: value_head.save(head, d)]
    if reuse_window(q) >= 1:                   # what the next update may reuse
        replay = replay_for_next(rollouts, reused, q, age)
        writers.append(lambda d: jsonl.write(d / REPLAY_FILE, [r.to_record() for r in replay]))
    return UpdateResult(metrics, tuple(writers), tuple(curve))


ALGORITHMS: dict[str, Callable[..., UpdateResult]] = {"dpo": run_dpo, "ppo": run_ppo}


def write_policy(policy: torch.nn.Module, tok: Tokenizer, p: Params, root: Path, it: int,
                 result: UpdateResult, base: tuple[str, str] | None = None) -> None:
    """The policy directory (atomically) and the metrics file: rank 0's outputs. base: a LoRA
    policy's base (workspace-relative path, weights md5); the directory then holds the adapter
    alone."""
    metrics = result.metrics
    with atomic.directory(root / layout.policy(it)) as tmp:
        if base is None:
            policy.save_pretrained(tmp)
        else:                                 # the adapter alone, naming its base
            adapters.save_adapter(policy, tmp, *base)  # type: ignore[arg-type]
        tok.save_pretrained(tmp)
        for write in result.extra_files:      # e.g. PPO's value head
            write(tmp)
        if result.curve:
            atomic.write_json(tmp / layout.TRAINING_CURVE, list(result.curve))
        atomic.write_json(tmp / layout.MODEL_META, {
            "iteration": it, "role": "policy", "algo": p.update.algo,
            "parent": layout.policy(stage.prev_of(p, it)), "reference": reference_dir(p, it)})
        mlflow_model.write_mlflow_model(tmp, mlflow_model.CHAT, {"model_path": layout.policy(it)},
                                        base and (base[0], root / base[0]))
        model_card.write_model_card(tmp, root, "update", it, p, metrics)
    stage.write_metrics(root, layout.metrics(it, "update"), metrics)


def load_models(p: Params, root: Path, it: int, start_dir: Path, device: str
                ) -> tuple[Models, tuple[str, str] | None]:
    """The policy to train (from `start_dir`, the policy it starts from) and its reference, and
    a LoRA policy's base (None for a full fine-tune)."""
    if p.update.lora.r <= 0:
        policy = lm.load_causal_lm(start_dir, device)
        ref = lm.load_causal_lm(root / reference_dir(p, it), device)
        for q in ref.parameters():
            q.requires_grad_(False)
        return Models(policy, ref, root, p.update.reference), None
    base = adapters.base_of(start_dir, root)
    policy = adapters.start_policy(start_dir, root, p.update.lora,
                                   stage.generator(p.seed, 11, it), device)
    on_initial = base[0] == layout.policy(0)
    if p.update.reference == "previous":      # pi_{k-1}: its adapter, or the base it is
        ref = (adapters.add_reference(policy, start_dir) if adapters.is_adapter_dir(start_dir)
               else adapters.ReferenceView(policy))
    elif on_initial:                          # the base under the adapter
        ref = adapters.ReferenceView(policy)
    else:                                     # an adapter on a later full model
        ref = lm.load_causal_lm(root / layout.policy(0), device)
        for q in ref.parameters():
            q.requires_grad_(False)
    return Models(policy, ref, root, p.update.reference, on_initial), base


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p, it, root = args.params, args.it, args.root
    conditions.check(CONTRACT, p, root)       # what it reads is declared for these params
    group = distributed.enter("tasks.stages.update", argv, p.update.processes)
    if group is None:                         # ran on N ranks under torchrun
        return
    start_dir = root / layout.policy(args.prev)
    tok = lm.load_tokenizer(start_dir)
    models, base = load_models(p, root, it, start_dir, args.device)
    result = ALGORITHMS[p.update.algo](models, tok, p, root, it,
                                       stage.generator(p.seed, 3, it), group)
    if group.main:                            # ranks > 0 write nothing
        write_policy(models.policy, tok, p, root, it, result, base)
        stage.say(f"update@{it}: {p.update.algo}, {int(result.metrics['update/steps'])} steps"
                  + (f" on {group.world} processes" if group.world > 1 else ""))
    distributed.close(group)


if __name__ == "__main__":
    stage.run_main(lambda: main())
