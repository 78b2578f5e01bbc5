"""Stage `update`: one policy update per iteration, DPO or PPO as params select.

- `dpo`: DPO (sigmoid, IPO or cDPO) on best-vs-worst pairs of this iteration's samples from
  the current policy (online/iterative DPO), ranked by the judge or by this iteration's reward
  model, optionally mixed with off-policy pairs from the previous pool; against the reference.
- `ppo`: clipped PPO with a value head (GAE, value clipping, early stop on approx KL) on this
  iteration's rollouts (optionally also the previous iteration's, reweighted by truncated
  importance ratios), rewarded by this iteration's reward model, KL to the reference in the
  reward or the loss; the value head is saved in the policy directory for the next iteration.
The reference is an explicit, versioned input: the initial model or the previous policy.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer

from tasks.config import conditions
from tasks.config.params import Params
from tasks.core import atomic, jsonl, layout
from tasks.data.records import Rollout, parse_pair, parse_rollout
from tasks.models import lm, mlflow_model, model_card
from tasks.policy import value_head
from tasks.policy.dpo import offpolicy_indices, rm_best_vs_worst, train_dpo
from tasks.policy.kl_budget import KLGuard, guard_prompts
from tasks.policy.ppo import REPLAY_FILE, train_ppo
from tasks.reward.reward_model import encode_pairs, load_reward_model, load_stats, rewards
from tasks.runtime import distributed
from tasks.runtime.device import device_of
from tasks.runtime.distributed import SINGLE, Group

CONTRACT = stage.Contract(
    "update",
    params=("device", "seed", "model.max_prompt_tokens", "update",
            "offpolicy.source",       # update.dpo.offpolicy_mix: auto resolves by it
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


def run_dpo(policy: PreTrainedModel, ref: PreTrainedModel, tok: Tokenizer, p: Params, root: Path,
            it: int, rng: torch.Generator, group: Group = SINGLE) -> UpdateResult:
    """DPO on this iteration's on-policy pairs (picked by `pair_source`), plus `offpolicy_mix`
    of pairs from the previous pool at loss weight `offpolicy_weight`; every rank reads and
    encodes the same pairs, then trains on its shard of each batch."""
    d, pad = p.update.dpo, tok.pad_token_id
    mpt, max_len = p.model.max_prompt_tokens, p.update.max_length
    encode = lambda ps: encode_pairs(tok, ps, mpt, max_len)
    metrics: dict[str, float] = {}
    if conditions.holds("update_reads_reward_model", p):   # best vs worst of K by this RM
        path = str(root / layout.rollouts(it))
        rollouts = [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]
        rm = load_reward_model(root / layout.reward_model(it), device_of(policy))
        onpolicy, metrics = rm_best_vs_worst(rm, rollouts, pad, max_len)
    else:                           # best vs worst by the judge (judge@it)
        path = str(root / layout.pairs(it))
        onpolicy = encode([parse_pair(rec, path, n, f"iter_{it}") for n, rec in jsonl.read(path)])
    offpolicy = []
    if conditions.holds("update_reads_pair_pool", p):   # a share of the previous pool
        pool_path = str(root / layout.pairs_pool(stage.prev_of(p, it)))
        pool = [parse_pair(rec, pool_path, n, "unknown") for n, rec in jsonl.read(pool_path)]
        pick = offpolicy_indices(len(onpolicy), len(pool), d.offpolicy_mix,
                                 stage.generator(p.seed, 7, it))
        offpolicy = encode([pool[i] for i in pick])
    weights = torch.tensor([1.0] * len(onpolicy) + [d.offpolicy_weight] * len(offpolicy),
                           device=device_of(policy))
    curve: list[dict[str, float]] = []
    guard = kl_guard(policy, ref, tok, p, root, [x.prompt_ids for x in onpolicy],
                     stage.generator(p.seed, 10, it))
    metrics.update(train_dpo(policy, ref, onpolicy + offpolicy, p=d, pad_id=pad, rng=rng,
                             weights=weights, group=group, curve=curve, guard=guard))
    bf16 = lm.effective_precision(d.precision, device_of(policy)) == "bf16"
    metrics.update({"update/bf16": float(bf16),
                    "update/n_onpolicy_pairs": float(len(onpolicy)),
                    "update/n_offpolicy_pairs": float(len(offpolicy)),
                    "update/offpolicy_weight": d.offpolicy_weight})
    return UpdateResult(metrics, curve=tuple(curve))


def kl_guard(policy: PreTrainedModel, ref: PreTrainedModel, tok: Tokenizer, p: Params, root: Path,
             prompts: list[tuple[int, ...]], rng: torch.Generator) -> KLGuard | None:
    """The KL budget's guard (tasks/policy/kl_budget.py) on this iteration's on-policy prompts,
    against the initial model (the DPO reference unless `update.reference: previous`); None when the
    profile sets no budget."""
    b = p.update.kl_budget
    if b.total <= 0:
        return None
    initial = ref if p.update.reference == "initial" else \
        lm.load_causal_lm(root / layout.policy(0), device_of(policy))
    return KLGuard(policy, initial, guard_prompts(prompts, b.n_prompts), p.evaluate.generation,
                   b, tok.eos_token_id, tok.pad_token_id, rng)


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


def run_ppo(policy: PreTrainedModel, ref: PreTrainedModel, tok: Tokenizer, p: Params, root: Path,
            it: int, rng: torch.Generator, group: Group = SINGLE) -> UpdateResult:
    """PPO on this iteration's rollouts; with reuse.iterations_back = 1 also on the previous
    iteration's, which update@{it-1} kept in its policy directory (a declared out of update@{it-1}
    and dep of update@{it}); the critic starts from update@{it-1}'s value head (value_reuse).
    On several ranks rank 0 scores the rollouts and shares the scores."""
    q, pad = p.update.ppo, tok.pad_token_id
    rollouts = _read_rollouts(root / layout.rollouts(it))
    prev_dir = root / layout.policy(stage.prev_of(p, it))
    reused = _read_rollouts(prev_dir / REPLAY_FILE) if q.reuse.iterations_back >= 1 else []
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
                        curve=curve)
    metrics["update/value_head_reused"] = float(loaded)
    writers: list[Writer] = [lambda d: value_head.save(head, d)]
    if q.reuse.iterations_back >= 1:          # keep this iteration's rollouts for update@{it+1}
        writers.append(lambda d: jsonl.write(d / REPLAY_FILE, [r.to_record() for r in rollouts]))
    return UpdateResult(metrics, tuple(writers), tuple(curve))


ALGORITHMS: dict[str, Callable[..., UpdateResult]] = {"dpo": run_dpo, "ppo": run_ppo}


def write_policy(policy: PreTrainedModel, tok: Tokenizer, p: Params, root: Path, it: int,
                 result: UpdateResult) -> None:
    """The policy directory (atomically) and the metrics file: rank 0's outputs."""
    metrics = result.metrics
    with atomic.directory(root / layout.policy(it)) as tmp:
        policy.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for write in result.extra_files:      # e.g. PPO's value head
            write(tmp)
        if result.curve:
            atomic.write_json(tmp / layout.TRAINING_CURVE, list(result.curve))
        atomic.write_json(tmp / layout.MODEL_META, {
            "iteration": it, "role": "policy", "algo": p.update.algo,
            "parent": layout.policy(stage.prev_of(p, it)), "reference": reference_dir(p, it)})
        mlflow_model.write_mlflow_model(tmp, mlflow_model.CHAT, {"model_path": layout.policy(it)})
        model_card.write_model_card(tmp, root, "update", it, p, metrics)
    stage.write_metrics(root, layout.metrics(it, "update"), metrics)


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    p, it, root = args.params, args.it, args.root
    conditions.check(CONTRACT, p, root)       # what it reads is declared for these params
    group = distributed.enter("tasks.stages.update", argv, p.update.processes)
    if group is None:                         # ran on N ranks under torchrun
        return
    start_dir = root / layout.policy(args.prev)
    policy, tok = lm.load_causal_lm(start_dir, args.device), lm.load_tokenizer(start_dir)
    ref = lm.load_causal_lm(root / reference_dir(p, it), args.device)
    for q in ref.parameters():
        q.requires_grad_(False)
    result = ALGORITHMS[p.update.algo](policy, ref, tok, p, root, it,
                                       stage.generator(p.seed, 3, it), group)
    if group.main:                            # ranks > 0 write nothing
        write_policy(policy, tok, p, root, it, result)
        stage.say(f"update@{it}: {p.update.algo}, {int(result.metrics['update/steps'])} steps"
                  + (f" on {group.world} processes" if group.world > 1 else ""))
    distributed.close(group)


if __name__ == "__main__":
    stage.run_main(lambda: main())
