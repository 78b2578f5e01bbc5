"""The `reward_model` judge: a trained Bradley-Terry reward model scores each response.

`judge.model` is a reward-model directory, relative to the workspace or absolute: one of ours
(`models/iter_k/rm` of a finished run, single or ensemble, scored with the pooling and precision
it was trained with) or a user's HF sequence-classification model with one label and its
tokenizer (a decoder with a `score` head: Llama, Qwen2, Mistral, ..., e.g. an exported RM from
another framework). It is pointwise, like the lexicons: the judge stage ranks the K samples by
reward and keeps best vs worst (and margin pairs) when the rewards differ by `tie_margin`.

Responses are re-tokenised from their text with EOS appended (`lm.encode_response`), as a
reward model from elsewhere reads a finished text; the prompt through the RM's own chat
template, at most `max_length` tokens each. A model from elsewhere (no reward_stats.json of
ours) is read where its own HF forward reads: at the last token that is not its config's pad
token, so with pad = EOS (common) at the token before the EOS; ours where they were trained.
Its identity (`version`) is the directory name and the md5 of its weights (a head-only one of
ours: its heads' and its backbone's recorded md5 and depth): recorded in every pair's
`meta.judge`. The tokenizer is the model directory's, or a head-only model's backbone's. MLflow
loads a head-only reward model of ours through `_load_pyfunc` here.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tasks.data.records import Message, Prompt
from tasks.judging.judges import Verdict, verdict_from_scores
from tasks.models import lm
from tasks.models.lm import ModelError
from tasks.reward.reward_model import (
    STATS_FILE,
    backbone_dir,
    load_reward_model,
    member_dirs,
    read_backbone,
    reward_mean_std,
)
from tasks.runtime.device import Device
from tasks.schemas.judge import JudgeParams


def rm_md5(path: Path) -> str:
    """md5 over the weights of every member of a saved reward model; a head-only one's heads,
    then its backbone's recorded weights md5 and depth (load_reward_model checks the md5)."""
    h = hashlib.md5()
    for d in member_dirs(path):
        h.update(lm.weights_md5(d).encode())
    if (ref := read_backbone(path)) is not None:
        h.update(f"{ref.base_md5}:{ref.num_layers}".encode())
    return h.hexdigest()


class RewardModelJudge:
    kind = "reward_model"

    def __init__(self, model_dir: Path, tie_margin: float, min_words: int, max_length: int,
                 batch_size: int = 32, device: Device = "cpu"):
        self.rm = load_reward_model(model_dir, device)
        for m in self.rm.members:
            if getattr(m.config, "num_labels", None) != 1 or not hasattr(m, "score"):
                raise ModelError(f"{model_dir}: not a reward model (a sequence-classification "
                                 "model with one label and a `score` head)")
        self.tok = lm.load_tokenizer(backbone_dir(model_dir, verify=False))   # checked above
        ours = (model_dir / STATS_FILE).is_file()
        self.pad_read = None if ours else self.rm.members[0].config.pad_token_id
        self.tie_margin, self.min_words = tie_margin, min_words
        self.max_length, self.batch_size = max_length, batch_size
        self.version = f"{model_dir.name}@{rm_md5(model_dir)}"

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float | None]:
        keep = [i for i, r in enumerate(responses) if len(r.split()) >= self.min_words]
        if not keep:
            return [None] * len(responses)
        ids = [lm.render_prompt(self.tok, prompts[i], self.max_length) for i in keep]
        resp = [self._read(lm.encode_response(self.tok, responses[i], self.max_length))
                for i in keep]
        with torch.inference_mode():
            mean, _ = reward_mean_std(self.rm, ids, resp, int(self.tok.pad_token_id),
                                      self.batch_size)
        out: list[float | None] = [None] * len(responses)
        for i, r in zip(keep, mean.tolist()):
            out[i] = float(r)
        return out

    def _read(self, ids: list[int]) -> list[int]:
        """The ids up to where the model reads (a foreign model: trailing pad ids dropped)."""
        while self.pad_read is not None and ids and ids[-1] == self.pad_read:
            ids = ids[:-1]
        return ids

    def compare(self, prompt: Prompt, first: str, second: str) -> Verdict:
        a, b = self.score([prompt, prompt], [first, second])
        return verdict_from_scores(a, b, self.tie_margin)


class RewardScorer:
    """An MLflow python_function model: the reward of each row's `response` to its `prompt` (a
    user message), as the reward_model judge scores texts (`max_length` tokens of each)."""

    def __init__(self, judge: RewardModelJudge):
        self.judge = judge

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> list[float]:
        """`model_input`: a pandas DataFrame with string columns prompt and response."""
        prompts = [(Message("user", str(x)),) for x in model_input["prompt"]]
        scores = self.judge.score(prompts, [str(y) for y in model_input["response"]])
        return [float("nan") if r is None else r for r in scores]


def _load_pyfunc(path: str) -> RewardScorer:
    """MLflow's loader (`python_function` flavor, `loader_module`) of the reward model at
    `path`, in its workspace; every response is scored (min_words 0)."""
    default = JudgeParams()
    return RewardScorer(RewardModelJudge(Path(path), default.tie_margin, 0, default.max_length))
