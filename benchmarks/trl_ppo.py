"""Our PPO update against TRL's PPO trainer on the same rollouts, sides alternating, one run.

    python -m benchmarks.trl_ppo [--model DIR] [--prompts 6] [--k 8] [--repeats 3]

TRL 1.16 (the `[bench]` extra) ships no PPO trainer; 1.12.0 is the last release that does
(`trl.experimental.ppo.PPOTrainer`: huggingface/trl#4482 moved it there in v1.10; the
1.13 wheel has no ppo module). It cannot share a process with 1.16, so this benchmark
installs it once, without dependencies, into benchmarks/.cache/trl-1.12.0 (`pip install
--no-deps --target`; it runs on the installed transformers, accelerate and datasets) and runs
every side in a fresh process started from the checkout root: ours (`python -m
benchmarks.trl_ppo --side ours`) and TRL's (the same with --side trl and that directory first
on PYTHONPATH), alternating, `--repeats` each; fastest and median reported.

Same on both sides: the frozen reference (the converted default model, or --model) and the
policy (`moved_policy`: the same weights plus seeded noise of 2% of each tensor's spread, so
that it sits away from the reference as at any iteration after the first); the rollouts
(`build_rollouts`: `--prompts` default train prompts chat-rendered as the stages render them,
`--k` responses each, as the rollout stage samples K per prompt, made of hand-written review
sentences, 40 tokens each; pi_old = the policy's own log-probs, computed once here and
stored, as the sampler stores them); the scores (standard normal, seeded: the RM's scoring
pass is not timed on either side, it belongs to the update stage's edge); the profile's PPO
settings (params/default-ppo.yaml: clip, value clip, KL coefficient k1 in the reward, gamma,
lambda, whitened advantages, 1 epoch of minibatches of 8, lr), fp32, AdamW without weight
decay at a constant lr, no gradient clipping.

Timed: ours, the whole `train_ppo` call (pi_old values, reference log-probs, rewards, GAE,
the epochs); TRL's, the whole `train()` of one batch (the same passes and its epochs), model
loading excluded on both sides. TRL generates inside `train()`: its `batch_generation` is
replaced by a lookup that returns the stored rollouts and logits whose log-softmax at each
sampled token is the stored log-prob (built before the clock starts), and its `get_reward` for
the reward model by a lookup of the same scores (its reward model is then a placeholder).

What differs, and why (TRL's design, not a setting): TRL's critic is a second full network
(`value_model`, here the policy's checkpoint with a scalar head, as TRL's examples build it),
run forward at rollout time and forward and backward at every step, one AdamW over both at one
lr (its `vf_coef` 0.1 weighs the value loss); ours is a linear value head on the policy's own
final states (its own lr, `value_lr`). TRL runs each rollout as one left-padded row through
the vocabulary head at every position; ours packs a prompt's K responses behind one prompt
(`lm.pack`) and runs the head at the response positions. TRL draws its minibatches at random
over rollouts, ours by whole prompt groups; so the two update trajectories differ and only
the rollout-time figures are compared for equality: the KL to the reference of the stored
rollouts (TRL's `objective/kl`, per rollout; ours per token times tokens) and the mean score.
TRL's pad token is `<|endoftext|>` (SmolLM2's pad is its EOS, `<|im_end|>`, which closes every
chat turn inside the prompts: TRL masks by pad value and would mask those).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import isolation
from benchmarks.common import build_pairs, cache_dir, ensure_model, log, review_responses
from tasks.config.params import PPOParams, load_params
from tasks.core import heap
from tasks.models import lm

ROOT = Path(__file__).resolve().parent.parent

TRL_PPO_VERSION = "1.12.0"
RESPONSE_TOKENS = 40
PPO_K = 8                  # responses per prompt, as the rollout stage samples them
TRL_PAD = "<|endoftext|>"


def trl_ppo_dir() -> Path:
    """Where TRL 1.12 lives: benchmarks/.cache, which git ignores (common.cache_dir)."""
    return cache_dir() / f"trl-{TRL_PPO_VERSION}"


def ensure_trl_ppo(install: bool = True) -> tuple[Path | None, str]:
    """The directory holding TRL 1.12.0 (installed there once, no dependencies), or None and
    why not."""
    d = trl_ppo_dir()
    if (d / "trl" / "experimental" / "ppo" / "ppo_trainer.py").is_file():
        return d, "cached"
    if not install:
        return None, f"TRL {TRL_PPO_VERSION} is not in {d}"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", str(d), f"trl=={TRL_PPO_VERSION}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"pip could not install trl=={TRL_PPO_VERSION}: {tail}"
    return d, "installed"


# 1. the rollouts ---------------------------------------------------------------------------

def moved_policy(model_dir: Path, out: Path, scale: float = 0.02, seed: int = 0) -> Path:
    """The model at `model_dir` with seeded Gaussian noise of `scale` times each weight
    tensor's standard deviation added, saved (with its tokenizer) to `out`."""
    model, g = lm.load_causal_lm(model_dir), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn(w.shape, generator=g) * (scale * float(w.std())))
    model.save_pretrained(out)
    lm.load_tokenizer(model_dir).save_pretrained(out)
    return out


def build_rollouts(model_dir: Path, n_prompts: int, k: int, seed: int = 0) -> dict[str, Any]:
    """n_prompts default train prompts x k distinct responses of hand-written review
    sentences (RESPONSE_TOKENS ids, no EOS), their log-probs under the policy at `model_dir`
    (pi_old) and seeded standard-normal scores; the rollouts of one prompt are adjacent, as
    the stage's are."""
    params = load_params(ROOT / "params" / "default.yaml")
    tok = lm.load_tokenizer(model_dir)
    prompts = [e.prompt_ids for e in build_pairs(tok, params, n_prompts, seed)]
    responses = review_responses(tok, n_prompts * k, seed, RESPONSE_TOKENS)
    rows = [(p, responses[i * k + j]) for i, p in enumerate(prompts) for j in range(k)]
    model = lm.load_causal_lm(model_dir)
    with torch.no_grad():
        logp, _ = lm.response_logprobs(model, [p for p, _ in rows], [r for _, r in rows],
                                       tok.pad_token_id)
    scores = torch.randn(len(rows), generator=torch.Generator().manual_seed(seed + 6))
    return {"prompts": [list(p) for p, _ in rows], "responses": [list(r) for _, r in rows],
            "logprobs": [logp[i, : len(r)].tolist() for i, (_, r) in enumerate(rows)],
            "scores": scores.tolist(), "k": k}


def ppo_params(epochs: int | None = None) -> PPOParams:
    p = load_params(ROOT / "params" / "default-ppo.yaml").update.ppo
    return replace(p, epochs=epochs or p.epochs)


# 2. the two sides, each run in its own process (`--side`) ----------------------------------

def run_ours(policy_dir: Path, ref_dir: Path, data: dict[str, Any], p: PPOParams
             ) -> dict[str, Any]:
    from benchmarks.train_bench import frozen_ref
    from tasks.data.records import Rollout
    from tasks.policy.ppo import train_ppo
    from tasks.policy.value_head import ValueHead
    from tasks.schemas.generation import GenerationParams
    pad = lm.load_tokenizer(policy_dir).pad_token_id
    rollouts = [Rollout(f"bench-{i}", (), tuple(pr), tuple(r), tuple(lp), False, "", "bench", 1,
                        GenerationParams(temperature=1.0))
                for i, (pr, r, lp) in enumerate(zip(data["prompts"], data["responses"],
                                                    data["logprobs"]))]
    policy, ref = lm.load_causal_lm(policy_dir), frozen_ref(ref_dir)
    head = ValueHead(policy.config.hidden_size)
    t0 = time.perf_counter()
    m = train_ppo(policy, head, ref, rollouts, torch.tensor(data["scores"]), p=p, pad_id=pad,
                  rng=torch.Generator().manual_seed(0), it=1)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r) for r in data["responses"])
    return {"seconds": seconds, "steps": int(m["update/steps"]),
            "kl_per_rollout": m["update/kl_k1_per_token"] * tokens / len(rollouts),
            "score_mean": m["update/score_mean"]}


def synthetic_logits(logprobs: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, T, V) logits, zero but at each sampled token, where log_softmax equals `logprobs`:
    e^c / (e^c + V - 1) = p  <=>  c = log p + log(V - 1) - log(1 - p)."""
    lp = logprobs.double().clamp(max=-1e-9)
    c = lp + math.log(vocab - 1) - torch.log1p(-lp.exp())
    out = torch.zeros(*tokens.shape, vocab)
    out.scatter_(2, tokens.unsqueeze(-1), c.float().unsqueeze(-1))
    return out


class StoredRollouts:
    """What TRL's `train()` would sample and score, looked up instead: `generate(queries)`
    gives the stored responses of TRL's batch, in its order, and logits whose log-softmax at
    each response token is the stored log-prob; `score(query_responses)` the stored scores."""

    def __init__(self, data: dict[str, Any], pad: int, vocab: int):
        self.pad, self.vocab = pad, vocab
        self.stored: dict[tuple[int, ...], deque[tuple[list[int], list[float]]]] = {}
        self.scores: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
        for pr, r, lp, s in zip(data["prompts"], data["responses"], data["logprobs"],
                                data["scores"]):
            self.stored.setdefault(tuple(pr), deque()).append((r, lp))
            self.scores[(tuple(pr), tuple(r))] = s

    def _strip(self, ids: list[int]) -> tuple[int, ...]:
        return tuple(t for t in ids if t != self.pad)

    def generate(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, lps, resp = [], [], []
        for q in queries.tolist():
            r, lp = self.stored[self._strip(q)].popleft()
            rows.append(q + r)
            resp.append(r)
            lps.append(lp)
        tokens = torch.tensor(resp)
        return torch.tensor(rows), synthetic_logits(torch.tensor(lps), tokens, self.vocab)

    def score(self, query_responses: torch.Tensor, context_length: int) -> torch.Tensor:
        return torch.tensor([self.scores[(self._strip(row[:context_length]),
                                          self._strip(row[context_length:]))]
                             for row in query_responses.tolist()])


def _trl_config(out_dir: str, n: int, width: int, p: PPOParams) -> Any:
    """TRL's PPOConfig for one batch of n rollouts at the profile's settings (docstring)."""
    from trl.experimental.ppo import PPOConfig
    return PPOConfig(
        output_dir=out_dir, per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_mini_batches=n // p.minibatch_size, total_episodes=n, num_ppo_epochs=p.epochs,
        learning_rate=p.lr, lr_scheduler_type="constant", weight_decay=0.0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, kl_coef=p.kl_coef,
        kl_estimator=p.kl_estimator, cliprange=p.clip, cliprange_value=p.value_clip,
        gamma=p.gamma, lam=p.lam, whiten_rewards=False, response_length=width, temperature=1.0,
        stop_token=None, missing_eos_penalty=None, num_sample_generations=0,
        local_rollout_forward_batch_size=min(64, n), report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, bf16=False, seed=0,
        use_cpu=True)


def run_trl(policy_dir: Path, ref_dir: Path, data: dict[str, Any], p: PPOParams
            ) -> dict[str, Any]:
    """TRL 1.12's PPOTrainer.train() on the stored rollouts (module docstring)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers
    import trl
    from datasets import Dataset
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as mod
    if trl.__version__ != TRL_PPO_VERSION:
        raise RuntimeError(f"expected TRL {TRL_PPO_VERSION} on the path, found {trl.__version__}")
    tok = transformers.AutoTokenizer.from_pretrained(policy_dir)
    tok.pad_token, tok.padding_side = TRL_PAD, "left"
    if tok.pad_token_id in {t for row in data["prompts"] + data["responses"] for t in row}:
        raise RuntimeError(f"TRL's pad token {TRL_PAD} occurs in the rollouts")
    load = transformers.AutoModelForCausalLM.from_pretrained
    policy, ref = load(policy_dir, dtype=torch.float32), load(ref_dir, dtype=torch.float32)
    value = transformers.AutoModelForSequenceClassification.from_pretrained(
        policy_dir, num_labels=1, dtype=torch.float32)
    store = StoredRollouts(data, tok.pad_token_id, policy.config.vocab_size)
    placeholder = torch.nn.Linear(1, 1)           # the reward model: its scores are looked up
    original_get_reward, prepared = mod.get_reward, {}

    def get_reward(model: Any, query_responses: torch.Tensor, pad: int, context: int) -> Any:
        if model is not placeholder:                                # the value model's pass
            return original_get_reward(model, query_responses, pad, context)
        return None, store.score(query_responses, context), None

    mod.batch_generation = lambda *args: prepared.pop("generated")
    mod.get_reward = get_reward
    logged: list[dict[str, float]] = []

    class Trainer(PPOTrainer):
        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            logged.append(dict(logs))

    with tempfile.TemporaryDirectory() as out_dir:
        n, width = len(data["prompts"]), max(len(r) for r in data["responses"])
        trainer = Trainer(args=_trl_config(out_dir, n, width, p), processing_class=tok,
                          model=policy, ref_model=ref, reward_model=placeholder,
                          value_model=value,
                          train_dataset=Dataset.from_dict({"input_ids": data["prompts"]}))
        queries = next(iter(trainer.dataloader))["input_ids"]    # TRL's one batch, its order
        prepared["generated"] = store.generate(queries)           # before the clock starts
        trainer.dataloader = [{"input_ids": queries}]
        steps: list[int] = []
        trainer.optimizer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "steps": len(steps), "kl_per_rollout": logged[0]["objective/kl"],
            "score_mean": logged[0]["objective/scores"]}


def _side_main(a: argparse.Namespace) -> int:
    torch.set_num_threads(int(os.environ.get("ALIGNLOOP_THREADS", isolation.THREADS)))
    data = json.loads(Path(a.data).read_text())
    p = ppo_params(a.epochs)
    run = run_ours if a.side == "ours" else run_trl
    Path(a.out).write_text(json.dumps(run(Path(a.policy), Path(a.model), data, p)))
    return 0


# 3. alternating, each side in a fresh process ----------------------------------------------

def _spawn(side: str, policy_dir: Path, model_dir: Path, data_file: Path, epochs: int | None,
           trl_dir: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{side}.json"
    env = dict(os.environ)
    if side == "trl":      # ahead of site-packages' TRL 1.16 (sys.path[0], the checkout, has none)
        env["PYTHONPATH"] = os.pathsep.join([str(trl_dir), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "benchmarks.trl_ppo", "--side", side, "--model",
           str(model_dir.resolve()), "--policy", str(policy_dir.resolve()), "--data",
           str(data_file.resolve()), "--out", str(out.resolve())]
    if epochs:
        cmd += ["--epochs", str(epochs)]
    # from the checkout root, where `-m benchmarks.trl_ppo` finds this checkout's benchmarks
    # and tasks (sys.path[0]); every path passed is absolute
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} side failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(out.read_text())


def measure_vs_trl_ppo(model_dir: Path, n_prompts: int = 6, k: int = PPO_K, repeats: int = 3,
                       epochs: int | None = None, seed: int = 0,
                       log: Callable[[str], None] = print, install: bool = True
                       ) -> dict[str, Any]:
    """{"trl": version, "ours": ..., "trl_side": ..., "ratio": ...}, or {"skipped": why}."""
    trl_dir, how = ensure_trl_ppo(install)
    if trl_dir is None:
        log(f"vs_trl ppo: skipped: {how}")
        return {"skipped": how}
    p = ppo_params(epochs)
    if (n_prompts * k) % p.minibatch_size:
        raise ValueError(f"{n_prompts} x {k} rollouts: not a multiple of the minibatch "
                         f"size {p.minibatch_size} (TRL splits the batch evenly)")
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        policy_dir = moved_policy(model_dir, Path(tmp) / "policy", seed=seed)
        data = build_rollouts(policy_dir, n_prompts, k, seed)
        n = len(data["prompts"])
        data_file = Path(tmp) / "rollouts.json"
        data_file.write_text(json.dumps(data))
        for i in range(repeats):
            for side in ("ours", "trl"):
                r = _spawn(side, policy_dir, model_dir, data_file, epochs, trl_dir, Path(tmp))
                runs[side].append(r)
                log(f"vs_trl ppo pass {i + 1}/{repeats}: {side} {r['seconds']:.1f} s")
    tokens = sum(len(pr) + len(r) for pr, r in zip(data["prompts"], data["responses"]))

    def rates(rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        fast = min(r["seconds"] for r in rs)
        return {"seconds": [round(r["seconds"], 2) for r in rs], "fastest_s": round(fast, 2),
                "median_s": round(statistics.median(r["seconds"] for r in rs), 2),
                "rollouts_per_s": round(n * p.epochs / fast, 3),
                "tokens_per_s": round(tokens * p.epochs / fast, 1), "steps": rs[0]["steps"],
                "kl_per_rollout": rs[0]["kl_per_rollout"], "score_mean": rs[0]["score_mean"]}
    ours, theirs = rates(runs["ours"]), rates(runs["trl"])
    out = {"trl": TRL_PPO_VERSION, "trl_dir": str(trl_dir), "rollouts": n, "prompts": n_prompts,
           "k": k, "epochs": p.epochs, "minibatch_size": p.minibatch_size, "lr": p.lr,
           "precision": "fp32", "ours": ours, "trl_side": theirs,
           "ratio": round(theirs["fastest_s"] / ours["fastest_s"], 3),
           "ratio_median": round(theirs["median_s"] / ours["median_s"], 3),
           "kl_per_rollout_abs_diff": abs(ours["kl_per_rollout"] - theirs["kl_per_rollout"]),
           "score_mean_abs_diff": abs(ours["score_mean"] - theirs["score_mean"]),
           "glibc_tunables": os.environ.get(heap.ENV)}
    log(f"vs_trl ppo: ours {ours['rollouts_per_s']} vs trl {theirs['rollouts_per_s']} "
        f"rollouts/s (x{out['ratio']}, median x{out['ratio_median']}); KL per rollout "
        f"{ours['kl_per_rollout']:.4f} vs {theirs['kl_per_rollout']:.4f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a converted HF model directory (default: the default "
                                    "model, converted into benchmarks/.cache)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--k", type=int, default=PPO_K, help="rollouts per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per side")
    ap.add_argument("--epochs", type=int, help="default: the profile's")
    ap.add_argument("--heap", choices=isolation.HEAP_CHOICES, default="stage",
                    help=isolation.HEAP_HELP)
    ap.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        return _side_main(a)
    if argv is None:
        isolation.restart_with_heap(a.heap)
    out = measure_vs_trl_ppo(ensure_model(a.model), a.prompts, a.k, a.repeats, a.epochs, log=log)
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
