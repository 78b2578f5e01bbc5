"""The `llm` judge's backend: a local HF causal LM in this process, deterministic.

`greedy` generates up to `max_new_tokens` and parses the reply strictly; `logprob` reads the
next-token log-probs after the chat-rendered judge prompt and takes the largest of the verdict
words' first tokens ("A", "B", "tie"): always a verdict, no parsing.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tasks.judging.judges import Verdict
from tasks.judging.pairwise import JudgeStats, Reply, parse_verdict
from tasks.models import lm
from tasks.runtime.device import Device

WORDS: tuple[Verdict, ...] = ("A", "B", "tie")


class LocalLMBackend:
    def __init__(self, model_dir: Path, decoding: str, max_new_tokens: int,
                 batch_size: int = 8, device: Device = "cpu"):
        self.model, self.tok = lm.load_causal_lm(model_dir, device), lm.load_tokenizer(model_dir)
        self.device = lm.device_of(self.model)
        self.tok.padding_side = "left"
        self.decoding, self.max_new_tokens, self.batch_size = decoding, max_new_tokens, batch_size
        ids = [self.tok.encode(w, add_special_tokens=False)[0] for w in WORDS]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{model_dir}: the verdict words share a first token")
        self.word_ids = ids

    def _render(self, text: str) -> str:
        if self.tok.chat_template:
            return str(self.tok.apply_chat_template([{"role": "user", "content": text}],
                                                    tokenize=False, add_generation_prompt=True))
        return text + "\n"

    @torch.no_grad()
    def ask_many(self, texts: Sequence[str], stats: JudgeStats) -> list[Reply]:
        out: list[Reply] = []
        for s in range(0, len(texts), self.batch_size):
            chunk = [self._render(t) for t in texts[s: s + self.batch_size]]
            enc = self.tok(chunk, return_tensors="pt", padding=True,
                           add_special_tokens=False).to(self.device)
            n_prompt = int(enc["attention_mask"].sum())
            stats.add(requests=len(chunk), prompt_tokens=n_prompt)
            out += self._logprob(enc, stats) if self.decoding == "logprob" else \
                self._greedy(enc, stats)
        return out

    def _logprob(self, enc: dict, stats: JudgeStats) -> list[Reply]:
        logits = self.model(**enc).logits[:, -1, :]                    # (B, V), left-padded
        pick = logits[:, self.word_ids].argmax(-1).tolist()           # (B,)
        stats.add(completion_tokens=len(pick))
        return [Reply(WORDS[i], WORDS[i], True, 0, 1) for i in pick]

    def _greedy(self, enc: dict, stats: JudgeStats) -> list[Reply]:
        width = enc["input_ids"].shape[1]
        gen = self.model.generate(**enc, do_sample=False, max_new_tokens=self.max_new_tokens,
                                  pad_token_id=self.tok.pad_token_id)
        texts = self.tok.batch_decode(gen[:, width:], skip_special_tokens=True)
        stats.add(completion_tokens=int((gen[:, width:] != self.tok.pad_token_id).sum()))
        return [Reply(parse_verdict(t), t) for t in texts]
