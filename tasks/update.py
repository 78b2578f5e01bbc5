"""Stage `update`: one policy update per iteration, DPO or PPO as params select.

- `dpo`: sigmoid DPO on this iteration's judged pairs, sampled from the current policy
  (online/iterative DPO), against the reference policy.
- `ppo`: clipped PPO on this iteration's rollouts, rewarded by this iteration's reward model,
  with a per-token KL penalty to the reference.
The reference is an explicit, versioned input: the initial model or the previous policy.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tasks import atomic, jsonl, layout, lm, stage
from tasks.dpo import train_dpo
from tasks.params import Params
from tasks.ppo import train_ppo
from tasks.records import parse_pair, parse_rollout
from tasks.reward_model import encode_pairs, load_reward_model, load_stats, rewards


def reference_dir(p: Params, it: int) -> str:
    return layout.policy(0) if p.update.reference == "initial" else layout.policy(it - 1)


def run_dpo(policy: torch.nn.Module, ref: torch.nn.Module, tok: object, p: Params, root: Path,
            it: int, rng: torch.Generator) -> dict[str, float]:
    path = str(root / layout.pairs(it))
    pairs = [parse_pair(rec, path, n, f"iter_{it}") for n, rec in jsonl.read(path)]
    enc = encode_pairs(tok, pairs, p.model.max_prompt_tokens, p.update.max_length)  # type: ignore[arg-type]
    return train_dpo(policy, ref, enc, p.update.dpo, tok.pad_token_id, rng)  # type: ignore[attr-defined]


def run_ppo(policy: torch.nn.Module, ref: torch.nn.Module, tok: object, p: Params, root: Path,
            it: int, rng: torch.Generator) -> dict[str, float]:
    path = str(root / layout.rollouts(it))
    rollouts = [parse_rollout(rec, path, n) for n, rec in jsonl.read(path)]
    rollouts = [r for r in rollouts if r.response_ids]
    rm_dir = root / layout.reward_model(it)
    rm, stats = load_reward_model(rm_dir), load_stats(rm_dir)
    pad = tok.pad_token_id  # type: ignore[attr-defined]
    with torch.no_grad():
        raw = torch.cat([rewards(rm, [r.prompt_ids for r in rollouts[s: s + 32]],
                                 [r.response_ids for r in rollouts[s: s + 32]], pad)
                         for s in range(0, len(rollouts), 32)])
    scores = (raw - stats["mean"]) / max(stats["std"], 1e-6)             # normalised RM reward
    return train_ppo(policy, ref, rollouts, scores, p.update.ppo, pad, rng)


ALGORITHMS: dict[str, Callable[..., dict[str, float]]] = {"dpo": run_dpo, "ppo": run_ppo}


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "")
    p, it, root = args.params, args.it, args.root
    start_dir = root / layout.policy(it - 1)
    policy, tok = lm.load_causal_lm(start_dir), lm.load_tokenizer(start_dir)
    ref = lm.load_causal_lm(root / reference_dir(p, it))
    for q in ref.parameters():
        q.requires_grad_(False)
    metrics = ALGORITHMS[p.update.algo](policy, ref, tok, p, root, it,
                                        stage.generator(p.seed, 3, it))
    with atomic.directory(root / layout.policy(it)) as tmp:
        policy.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic.write_json(tmp / layout.MODEL_META, {
            "iteration": it, "role": "policy", "algo": p.update.algo,
            "parent": layout.policy(it - 1), "reference": reference_dir(p, it)})
    stage.write_metrics(root, layout.metrics(it, "update"), metrics)
    print(f"update@{it}: {p.update.algo}, {int(metrics['update/steps'])} steps")


if __name__ == "__main__":
    stage.run_main(lambda: main())
