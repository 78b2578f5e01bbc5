"""A small word-level tokenizer with a chat template, chat prompts of different lengths, tiny
Llama variants (a plain module around one, one with a raised EOS logit) and the draw and
full-forward helpers the sampler tests share (tests/test_sampling_basics.py,
tests/test_sampling.py)."""
from __future__ import annotations

import copy

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from tasks.data.records import Message
from tasks.models import lm
from tasks.models.sampling import Sample, sample

MAX_NEW = 10


WORDS = """the a an and or but of to in on at for with is was it this that film movie story
plot acting actors cast director scenes scene ending music score characters character review
write short brief sentences two three what did you think give i we they very really quite so
too not no more most some all its their his her one time way feels feel felt made makes watch
watched see saw about like from as by be been has have had just also than then there here
. , ! ?""".split() + [f"w{i}" for i in range(300)]   # 403 tokens, the size EOS biases assume


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A small word-level tokenizer with a chat template (a 403-token vocabulary keeps the
    sampler's distribution tests cheap: thousands of draws over the whole vocabulary); the
    sampler on SmolLM2's real tokenizer is tested in tests/test_sampling_basics.py
    (test_real_tokenizer_...)."""
    special = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>",
               "<|end|>"]
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(special + WORDS)},
                                      unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", additional_special_tokens=special[4:])
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return tok


def chat_prompts(tok: transformers.PreTrainedTokenizerFast) -> list[list[int]]:
    """Chat-rendered prompts of different lengths, so every batch is left-padded."""
    texts = ["hi", "write a short review of the film", "what did you think of the movie ?",
             "a film", "give two sentences about the acting and the music and the ending"]
    out = [lm.render_prompt(tok, (Message("user", t),), 48) for t in texts]
    assert len({len(p) for p in out}) >= 4
    return out


def draw(model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase,
         prompts: list[list[int]], seed: int, *, temperature: float = 1.0, top_p: float = 1.0,
         batch_size: int = 3, max_new_tokens: int = MAX_NEW) -> list[Sample]:
    return sample(model, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                  eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=temperature,
                  top_p=top_p, generator=torch.Generator().manual_seed(seed))


def full_forward_logprobs(model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase,
                          prompts: list[list[int]], samples: list[Sample],
                          temperature: float) -> list[list[float]]:
    with torch.no_grad():
        logp, mask = lm.response_logprobs(model, prompts, [s.response_ids for s in samples],
                                          tok.pad_token_id, temperature)
    return [row[: int(m.sum())].tolist() for row, m in zip(logp, mask)]


class Wrapped(torch.nn.Module):
    """The same model behind a plain module: sampled through the generic transformers path."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: object) -> object:
        return self.inner(**kwargs)


def eos_heavy(model: transformers.LlamaForCausalLM, eos_id: int,
              bonus: float) -> transformers.LlamaForCausalLM:
    """A copy of the Llama whose EOS logit is raised on every step, still a plain Llama.

    Every token embedding gets the same first coordinate c and no layer writes that
    coordinate, so after the final norm it is a positive share of every hidden state. With tied
    embeddings that shifts all logits alike, except EOS's, whose row carries c + bonus there
    (EOS is never fed back as an input while sampling)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        emb = out.model.embed_tokens.weight
        emb[:, 0] = 0.1
        emb[eos_id, 0] += bonus
        for layer in out.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
    assert out.lm_head.weight is out.model.embed_tokens.weight
    return out
