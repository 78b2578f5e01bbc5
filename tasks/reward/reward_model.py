"""Bradley-Terry reward model: a scalar head on a transformer backbone, or an ensemble of K.

The reward of (prompt, response) is the head's output on the backbone's hidden states of the
chat-rendered sequence: at its last real token (`pooling: last`, HF's sequence-classification
read-out), or averaged over the response's tokens (`pooling: mean`). Most sampled responses end
at max_new_tokens, mid-sentence, where the last token's state of a small model says little about
the whole: on seed 0's first rollouts a linear head on frozen last-token states reached 0.50
held-out accuracy, on mean-pooled ones 0.83 (benchmarks/rm_probe.py). The head can be fitted
in closed form on frozen features first (`head_init: probe`: an L2 logistic regression on the
chosen-minus-rejected features), then fine-tuned with the backbone for `epochs` (0 = the probe
alone). An ensemble's reward is the mean over its members and its uncertainty
the (population) std. Saved layout: K = 1 is one model directory (`models/iter_k/rm/`);
K > 1 keeps each member in `models/iter_k/rm/member_<i>/`, with the stats beside them. A
fine-tuned backbone is saved whole (save_pretrained); a frozen one (epochs 0: only the heads
were fitted) is not copied: each member keeps its head (`head.safetensors`) and
`alignloop_base.json` names the blocks they read (the workspace's initial policy, its weights
md5, the depth kept), about 10 KB instead of a model's worth (`load_reward_model` rebuilds the
same model).
Loading, scoring and training live here, the features the head reads in
tasks/reward/features.py, the probe head in tasks/reward/probe.py; `train_rm` is the stage edge.
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import Tensor

from tasks.core import layout, progress
from tasks.data.records import PreferencePair, Prompt
from tasks.functional.losses import bradley_terry_margin_loss
from tasks.models import lm
from tasks.models.lm import ModelError
from tasks.reward.features import EncodedPair, FrozenFeatures, features, truncate
from tasks.runtime.device import Device, device_of
from tasks.runtime.distributed import SINGLE, Group, record_losses
from tasks.schemas.train_rm import TrainRMParams

STATS_FILE = layout.RM_STATS
HEAD_FILE = "head.safetensors"      # a frozen backbone's reward model: a member's score layer
BACKBONE_FILE = lm.ADAPTER_BASE     # ... and the base its members read (`BackboneRef`), named
#                                    as a LoRA adapter names its base (tasks/models/adapters.py)
# MLflow loads a head-only reward model as a python_function model through this module's
# `_load_pyfunc`: a table of prompt (a user message) and response texts in, their rewards out
SCORER_MODULE = "tasks.judging.judge_rm"
SCORER_SIGNATURE = {
    "inputs": json.dumps([{"type": "string", "name": "prompt", "required": True},
                          {"type": "string", "name": "response", "required": True}]),
    "outputs": json.dumps([{"type": "double", "required": True}]), "params": None}


def init_reward_model(backbone_dir: Path, rng: torch.Generator | None = None,
                      num_layers: int = 0, device: Device = "cpu") -> transformers.PreTrainedModel:
    """A fresh scalar head (num_labels=1) on the backbone's pretrained weights; with `rng`, the
    head is drawn from it (ensemble members differ by their head's seed). num_layers > 0 keeps
    only the backbone's first N transformer blocks (a cheaper reward model: scoring and training
    cost scale with depth); 0 keeps them all. The head is drawn on the CPU (rng is a CPU
    generator: the same head on every device), then the model moves to `device`."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        lm.check_model_dir(backbone_dir), num_labels=1, dtype=torch.float32)
    truncate(model, num_layers)
    if rng is not None:
        with torch.no_grad():
            model.score.weight.normal_(0.0, model.config.initializer_range, generator=rng)
    return model.to(device)


class RewardEnsemble(torch.nn.Module):
    """K reward models scored together; K = 1 is the plain single model. `precision` and
    `pooling` are the ones it was trained with (train_rm.*), which scoring uses too."""

    def __init__(self, members: Sequence[transformers.PreTrainedModel],
                 precision: str = "fp32", pooling: str = "last"):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = torch.nn.ModuleList(members)
        self.precision = precision
        self.pooling = pooling

    def __len__(self) -> int:
        return len(self.members)


RewardModel = transformers.PreTrainedModel | RewardEnsemble


@dataclass(frozen=True)
class BackboneRef:
    """The frozen backbone a head-only reward model reads: the first `num_layers` blocks of the
    model at `base_path` (relative to the workspace) whose weights have md5 `base_md5`
    (`lm.weights_md5`); stored as alignloop_base.json with these three keys."""
    base_path: str
    base_md5: str
    num_layers: int


def _member_dir(path: Path) -> Path:
    return path if (path / HEAD_FILE).is_file() else lm.check_model_dir(path)


def member_dirs(path: Path) -> list[Path]:
    """The member directories of a saved reward model: itself (K = 1) or member_0..K-1."""
    path = Path(path)
    members = sorted(path.glob(f"{layout.RM_MEMBER_PREFIX}*"),
                     key=lambda d: int(d.name.removeprefix(layout.RM_MEMBER_PREFIX)))
    return [_member_dir(d) for d in members] if members else [_member_dir(path)]


def read_backbone(path: Path) -> BackboneRef | None:
    """The backbone record of a head-only reward model; None for a model saved whole. A
    malformed one is a ModelError naming the file and the field."""
    record = lm.read_base_record(path, layers=True)
    return None if record is None else \
        BackboneRef(record.base_path, record.base_md5, int(record.num_layers or 0))


def workspace_of(rm_dir: Path) -> Path:
    """The workspace a reward model directory of ours lies in (`<root>/models/iter_k/rm`)."""
    depth = len(Path(layout.reward_model(0)).parts)
    parents = Path(rm_dir).absolute().parents
    if len(parents) < depth:
        raise ModelError(f"{rm_dir}: not inside a workspace ({layout.reward_model(0)}); "
                         "pass its workspace root")
    return parents[depth - 1]


def backbone_dir(path: Path, root: Path | None = None, verify: bool = True) -> Path:
    """Where the backbone of a head-only reward model lies, checked against its record: the
    directory holds a model, and (`verify`: reading its weights, ~1 s for 538 MB) their md5
    is the recorded one. `root`: the workspace (default: the one `path` lies in). A model
    saved whole is its own backbone."""
    ref = read_backbone(path)
    if ref is None:
        return Path(path)
    where = Path(path) / BACKBONE_FILE
    found = (workspace_of(path) if root is None else Path(root)) / ref.base_path
    if not (found / "config.json").is_file():
        raise ModelError(f"{where}: base_path: {found} holds no saved model")
    if verify and (md5 := lm.weights_md5(found)) != ref.base_md5:
        raise ModelError(f"{where}: base_md5: {ref.base_md5} recorded, but the weights in "
                         f"{found} have md5 {md5} (the head was fitted on another backbone)")
    return found


def load_reward_model(path: Path, device: Device = "cpu",
                      root: Path | None = None) -> RewardEnsemble:
    """Load a saved reward model, single or ensemble, on `device`, in eval mode. A head-only
    one is rebuilt on its backbone, found in the workspace `root` (default: the one `path`
    lies in, `<root>/models/iter_k/rm`) and refused when its weights are not the recorded
    ones."""
    stats_file = Path(path) / STATS_FILE
    stats = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
    ref = read_backbone(path)
    if ref is None:
        members = [transformers.AutoModelForSequenceClassification.from_pretrained(
            d, dtype=torch.float32) for d in member_dirs(path)]
    else:
        dirs = member_dirs(path)
        with torch.random.fork_rng(devices=[]):      # the head drawn here is replaced below
            base = init_reward_model(backbone_dir(path, root), num_layers=ref.num_layers)
        members = [copy.deepcopy(base) for _ in dirs[1:]] + [base]   # the blocks: one load
        for m, d in zip(members, dirs):
            m.score.load_state_dict(load_file(str(d / HEAD_FILE)))
    return RewardEnsemble([m.eval() for m in members], stats.get("precision", "fp32"),
                          stats.get("pooling", "last")).to(device).eval()


def save_reward_model(members: Sequence[transformers.PreTrainedModel], path: Path,
                      backbone: BackboneRef | None = None) -> None:
    """K = 1: the model in `path`; K > 1: member i in `path/member_<i>`. With `backbone` (the
    members' blocks are its first `num_layers`, unchanged) only each member's head is saved,
    with the backbone's record beside them."""
    dirs = [Path(path)] if len(members) == 1 else [
        Path(path) / f"{layout.RM_MEMBER_PREFIX}{i}" for i in range(len(members))]
    for m, d in zip(members, dirs):
        if backbone is None:
            m.save_pretrained(d)
            continue
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in m.score.state_dict().items()},
                  str(d / HEAD_FILE), metadata={"format": "pt"})
    if backbone is not None:
        lm.write_base_record(path, lm.BaseRecord(**asdict(backbone)))


def _single_rewards(model: transformers.PreTrainedModel, prompts: Sequence[Sequence[int]],
                    responses: Sequence[Sequence[int]], pad_id: int,
                    pooling: str = "last") -> Tensor:
    """r(x, y) per response (B,): the head on `features`."""
    r = model.score(features(model, prompts, responses, pad_id, pooling)).squeeze(-1)   # (B,)
    return r.float() if r.dtype == torch.bfloat16 else r         # autocast: back to fp32


def member_pair_rewards(model: RewardModel, batch: Sequence[EncodedPair],
                        pad_id: int, pooling: str = "last") -> tuple[Tensor, Tensor]:
    """Every member k's r_k(x, y_c) and r_k(x, y_r), each (K, B), both sides in one forward.
    Each distinct (prompt, response) is scored once: the K samples of a prompt appear in up to
    K - 1 of its pairs (judge.pool_pairs: all), and its prompt once per packed row."""
    index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for e in batch:
        for side in (e.chosen_ids, e.rejected_ids):
            index.setdefault((e.prompt_ids, side), len(index))
    r = member_rewards(model, [k[0] for k in index], [k[1] for k in index], pad_id,
                       pooling)                                                      # (K, U)
    chosen = torch.tensor([index[(e.prompt_ids, e.chosen_ids)] for e in batch], dtype=torch.long,
                          device=r.device)
    rejected = torch.tensor([index[(e.prompt_ids, e.rejected_ids)] for e in batch],
                            dtype=torch.long, device=r.device)
    return r[:, chosen], r[:, rejected]


def prompt_batches(data: Sequence[EncodedPair], batch_size: int,
                   rng: torch.Generator) -> list[list[EncodedPair]]:
    """An epoch's batches: the prompts in a random order, each prompt's pairs whole in one
    batch, a batch taking the next prompt while that leaves it nearer `batch_size` pairs than
    it is (a prompt with more pairs than that is a batch of its own). Each response is scored
    once an epoch and each prompt once per step: with every pair of K samples (`judge.pool_pairs:
    all`, ~20 pairs over 8 responses) a cut through a prompt's pairs scored its responses in
    two steps, 1.35 times per epoch on a 96-prompt pool."""
    groups: dict[tuple[int, ...], list[EncodedPair]] = {}
    for e in data:
        groups.setdefault(e.prompt_ids, []).append(e)
    ordered = list(groups.values())
    batches: list[list[EncodedPair]] = []
    for g in torch.randperm(len(ordered), generator=rng).tolist():  # cpu: its generator
        group, last = ordered[g], batches[-1] if batches else []
        if last and len(last) + len(group) - batch_size < batch_size - len(last):
            last.extend(group)                  # over by less than it is short: take it
        else:
            batches.append(list(group))
    return batches


def member_rewards(model: RewardModel, prompts: Sequence[Sequence[int]],
                   responses: Sequence[Sequence[int]], pad_id: int,
                   pooling: str = "last") -> Tensor:
    """r_k(x, y) of every member k, shape (K, B); an ensemble scores in its `precision` and
    `pooling` (`pooling` is for a bare model, as in training)."""
    if not isinstance(model, RewardEnsemble):
        return _single_rewards(model, prompts, responses, pad_id, pooling)[None]
    with lm.autocast(model.precision, device_of(model)):
        return torch.stack([_single_rewards(m, prompts, responses, pad_id, model.pooling)
                            for m in model.members])


def rewards(model: RewardModel, prompts: Sequence[Sequence[int]],
            responses: Sequence[Sequence[int]], pad_id: int) -> Tensor:
    """r(x, y) for each pair of ids, shape (B,): the ensemble mean. Scored at the last real
    token (mask-based, so a pad id equal to EOS cannot move the read-out position)."""
    return member_rewards(model, prompts, responses, pad_id).mean(0)


@torch.no_grad()
def reward_mean_std(model: RewardModel, prompts: Sequence[Sequence[int]],
                    responses: Sequence[Sequence[int]], pad_id: int, batch_size: int = 32
                    ) -> tuple[Tensor, Tensor]:
    """Ensemble mean and population std over members of r(x, y), each (B,); std = 0 at K = 1.
    Scored in the precision the model was trained in (`model.precision`, default fp32)."""
    r = torch.cat([member_rewards(model, prompts[s: s + batch_size],
                                  responses[s: s + batch_size], pad_id)
                   for s in range(0, len(prompts), batch_size)], dim=1)        # (K, B)
    return r.mean(0), r.std(0, unbiased=False)


def response_ids(tok: transformers.PreTrainedTokenizerBase, pair: PreferencePair, text: str,
                 room: int) -> tuple[int, ...]:
    """One side's ids, at most `room`: the tokens the policy sampled when the pair carries them
    (EOS only if it finished), else the text tokenised with EOS (an imported, ended text)."""
    sampled = pair.tokens(text)
    if sampled is not None:
        return sampled.ids[:room]
    return tuple(lm.encode_response(tok, text, room))


def encode_pairs(tok: transformers.PreTrainedTokenizerBase, pairs: Sequence[PreferencePair],
                 max_prompt_tokens: int, max_length: int) -> list[EncodedPair]:
    """Pairs as ids: the chat-rendered prompt (its last max_prompt_tokens) and both responses,
    prompt + response cut to max_length."""
    out = []
    for p in pairs:
        prompt_ids = lm.render_prompt(tok, p.prompt, max_prompt_tokens)
        room = max(max_length - len(prompt_ids), 1)
        out.append(EncodedPair(tuple(prompt_ids), response_ids(tok, p, p.chosen, room),
                               response_ids(tok, p, p.rejected, room)))
    return out


def heldout_split(pairs: Sequence[PreferencePair], fraction: float
                  ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Deterministic split by prompt (a prompt's pairs stay on one side)."""
    def bucket(prompt: Prompt) -> float:
        key = json.dumps([[m.role, m.content] for m in prompt]).encode()
        return int(hashlib.md5(key).hexdigest()[:8], 16) / 0xFFFFFFFF
    train = [p for p in pairs if bucket(p.prompt) >= fraction]
    held = [p for p in pairs if bucket(p.prompt) < fraction]
    if not held and len(train) > 1:          # tiny pools: still measure on something unseen
        held, train = train[-1:], train[:-1]
    return train, held


def member_margins(model: RewardModel, batch: Sequence[EncodedPair], pad_id: int,
             pooling: str = "last") -> Tensor:
    """r_k(x, y_c) - r_k(x, y_r) per member, shape (K, B); differentiable."""
    r_c, r_r = member_pair_rewards(model, batch, pad_id, pooling)
    return r_c - r_r


@torch.no_grad()
def pair_margins(model: RewardModel, data: Sequence[EncodedPair], pad_id: int,
                 batch_size: int = 32) -> Tensor:
    """Every member's margin on every pair, shape (K, N)."""
    model.eval()
    k = len(model) if isinstance(model, RewardEnsemble) else 1
    if not data:
        return torch.zeros(k, 0, device=device_of(model))
    return torch.cat([member_margins(model, data[s: s + batch_size], pad_id)
                      for s in range(0, len(data), batch_size)], dim=1)


def ensemble_agreement(margins: Tensor) -> dict[str, float]:
    """Accuracy and disagreement of K members' margins on N pairs, margins (K, N).

    accuracy: the ensemble mean margin prefers the chosen; disagreement: not every member
    prefers the same side (sign of margin > 0); margin_std: mean over pairs of the members'
    population std of the margin. Empty N gives nan.
    """
    if margins.shape[1] == 0:
        return {k: float("nan") for k in ("accuracy", "member_accuracy", "disagreement",
                                          "margin_std")}
    wins = margins > 0                                                    # (K, N)
    return {"accuracy": float((margins.mean(0) > 0).float().mean()),
            "member_accuracy": float(wins.float().mean()),
            "disagreement": float((wins != wins[:1]).any(0).float().mean()),
            "margin_std": float(margins.std(0, unbiased=False).mean())}


def train_reward(model: transformers.PreTrainedModel, train: Sequence[EncodedPair],
                 p: TrainRMParams, pad_id: int, rng: torch.Generator,
                 group: Group = SINGLE, curve: list[dict[str, float]] | None = None
                 ) -> dict[str, float]:
    """Fit the (margin) Bradley-Terry loss in place; `rng` orders the data. Returns loss stats
    and appends each step's loss and learning rate to `curve`.
    On several ranks (`group`) each takes its shard of every batch and the gradients are
    summed (tasks/runtime/distributed.py): the same steps as one process."""
    t0 = time.perf_counter()
    trained = freeze_lower(model, p.freeze_layers, p.freeze_embeddings)
    opt = torch.optim.AdamW(trained, lr=p.lr, weight_decay=p.weight_decay)
    losses: list[float] = []
    epochs = [prompt_batches(train, p.batch_size, rng) for _ in range(p.epochs)]  # every rank
    pg = progress.track(sum(len(e) for e in epochs), "steps", "pairs")
    device = device_of(model)
    for batches in epochs:
        model.train()
        for batch in batches:
            shard = [batch[i] for i in group.shard(
                torch.arange(len(batch))).tolist()]   # cpu: list indices, read back at once
            opt.zero_grad()
            loss = torch.zeros((), device=device)
            if shard:
                with lm.autocast(p.precision, device):
                    margins = member_margins(model, shard, pad_id, p.pooling)[0]        # (B,)
                per_pair = bradley_terry_margin_loss(margins, torch.zeros_like(margins),
                                                     p.margin)   # -log sigma(r_c - r_r - m)
                loss = group.batch_loss(per_pair, len(batch))
                loss.backward()
            group.sum_grads(model.parameters())
            opt.step()
            losses.append(group.total(loss))
            if curve is not None:
                curve.append({"loss": losses[-1], "lr": opt.param_groups[0]["lr"]})
            pg.step(1, work=len(batch))
    pg.close()
    model.eval()
    record_losses(group, losses, time.perf_counter() - t0)
    return {"loss_first": losses[0] if losses else float("nan"),
            "loss_last": losses[-1] if losses else float("nan"), "steps": float(len(losses))}


def freeze_lower(model: transformers.PreTrainedModel, n: int,
                 embeddings: bool = False) -> list[torch.nn.Parameter]:
    """Keep the embeddings and the backbone's first `n` blocks as they are (requires_grad off:
    autograd records nothing below block n, so the backward pass stops there); returns the
    parameters left to train. n = 0: every parameter trains, but the embeddings are kept with
    `embeddings` (their gradient is not accumulated, AdamW neither holds state for them nor
    steps them: two fifths of a 12-block SmolLM2-135M reward model's weights)."""
    backbone = getattr(model, model.base_model_prefix)
    frozen = ([backbone.get_input_embeddings()] if n > 0 or embeddings else []) + list(
        backbone.layers[:n])
    for module in frozen:
        for q in module.parameters():
            q.requires_grad_(False)
    return [q for q in model.parameters() if q.requires_grad]


@torch.no_grad()
def pair_rewards(model: RewardModel, data: Sequence[EncodedPair], pad_id: int,
                 batch_size: int = 32) -> tuple[Tensor, Tensor]:
    """Every member's reward of every pair's chosen and rejected response, each (K, N)."""
    model.eval()
    k = len(model) if isinstance(model, RewardEnsemble) else 1
    if not data:
        empty = torch.zeros(k, 0, device=device_of(model))
        return empty, empty.clone()
    both = [member_pair_rewards(model, data[s: s + batch_size], pad_id)
            for s in range(0, len(data), batch_size)]
    return torch.cat([c for c, _ in both], dim=1), torch.cat([r for _, r in both], dim=1)


def heads(model: RewardModel) -> list[torch.nn.Module]:
    """Each member's `score` layer (the head on the features)."""
    members = model.members if isinstance(model, RewardEnsemble) else [model]
    return [m.score for m in members]


def spaced(items: Sequence[EncodedPair], n: int) -> list[EncodedPair]:
    """At most `n` of `items`, evenly spaced over their order (n = 0 or n >= len: all). In the
    pool's order (off-policy, then each iteration's) every source keeps its share."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def ensemble_metrics(model: RewardModel, train: Sequence[EncodedPair],
                     heldout: Sequence[EncodedPair], pad_id: int,
                     cache: FrozenFeatures | None = None, stats_pairs: int = 0
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """`rm/` metrics of a trained (ensemble) reward model on its held-out pairs and on
    `stats_pairs` training pairs (`spaced`; 0: all), and the normalisation stats (mean, std of
    the ensemble-mean reward over those training responses): one scoring pass over each set
    serves both (none with a `cache` of the frozen backbone's features: the heads on them). A
    scoring pass costs a forward per response, and the stats' scale is estimated well by a few
    hundred pairs."""
    score = ((lambda d: cache.pair_rewards(heads(model), d)) if cache is not None
             else (lambda d: pair_rewards(model, d, pad_id)))
    held = ensemble_agreement(torch.sub(*score(heldout)))
    scored = spaced(train, stats_pairs)
    r_c, r_r = score(scored)                                              # (K, N) each
    flat = torch.cat([r_c.mean(0), r_r.mean(0)]) if scored else torch.zeros(1, device=r_c.device)
    stats = {"mean": float(flat.mean()), "std": float(flat.std()) if flat.numel() > 1 else 1.0}
    metrics = {"rm/accuracy": held["accuracy"], "rm/member_accuracy": held["member_accuracy"],
               "rm/ensemble_disagreement": held["disagreement"],
               "rm/ensemble_margin_std": held["margin_std"],
               "rm/train_accuracy": ensemble_agreement(r_c - r_r)["accuracy"],
               "rm/n_train": float(len(train)), "rm/n_heldout": float(len(heldout)),
               "rm/n_train_scored": float(len(scored)),
               "rm/ensemble": float(len(model) if isinstance(model, RewardEnsemble) else 1)}
    return metrics, stats


def save_stats(path: Path, stats: dict[str, float | str]) -> None:
    (path / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")


def load_stats(path: Path) -> dict[str, float | str]:
    return json.loads((path / STATS_FILE).read_text())
