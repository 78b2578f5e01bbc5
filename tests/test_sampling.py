"""The KV-cached, left-padded sampler agrees with a plain full forward pass."""
from __future__ import annotations

import pytest
import torch
import transformers

from tasks import lm
from tasks.params import TinyModelParams
from tasks.records import Message
from tasks.sampling import Sample, sample
from tasks.tiny_model import build_tiny_model, build_tokenizer

MAX_NEW = 10


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok: transformers.PreTrainedTokenizerFast) -> transformers.LlamaForCausalLM:
    ids = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    return build_tiny_model(TinyModelParams(), len(tok), ids, seed=0)


@pytest.fixture(scope="module")
def prompts(tok: transformers.PreTrainedTokenizerFast) -> list[list[int]]:
    """Chat-rendered prompts of different lengths, so every batch is left-padded."""
    texts = ["hi", "write a short review of the film", "what did you think of the movie ?",
             "a film", "give two sentences about the acting and the music and the ending"]
    out = [lm.render_prompt(tok, (Message("user", t),), 48) for t in texts]
    assert len({len(p) for p in out}) >= 4
    return out


class EosBias(torch.nn.Module):
    """The wrapped model with a fixed bonus on the EOS logit, so that some samples finish."""

    def __init__(self, inner: torch.nn.Module, eos_id: int, bias: float):
        super().__init__()
        self.inner, self.eos_id, self.bias = inner, eos_id, bias

    def forward(self, **kwargs: object) -> object:
        out = self.inner(**kwargs)
        out.logits[..., self.eos_id] += self.bias
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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stored_logprobs_match_full_forward(model: torch.nn.Module,
                                            tok: transformers.PreTrainedTokenizerBase,
                                            prompts: list[list[int]], temperature: float) -> None:
    many = prompts * 2                                   # 10 prompts, batches of 3: 4 batches
    samples = draw(model, tok, many, seed=1, temperature=temperature)
    assert len(samples) == len(many)
    expected = full_forward_logprobs(model, tok, many, samples, temperature)
    for s, ref in zip(samples, expected):
        assert len(s.logprobs) == len(s.response_ids) == len(ref) > 0
        assert all(lp < 0 for lp in s.logprobs)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-4
    # the check can fail: at another temperature the stored values no longer match
    other = full_forward_logprobs(model, tok, many, samples, 2.0 * temperature)
    assert max(abs(a - b) for s, ref in zip(samples, other)
               for a, b in zip(s.logprobs, ref)) > 1e-2


def test_logprobs_match_with_finished_samples_in_the_batch(
        model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase,
        prompts: list[list[int]]) -> None:
    biased = EosBias(model, tok.eos_token_id, 4.0)
    samples = draw(biased, tok, prompts * 3, seed=2, batch_size=5)
    expected = full_forward_logprobs(biased, tok, prompts * 3, samples, 1.0)
    assert {s.finished for s in samples} == {True, False}
    for s, ref in zip(samples, expected):
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-4


def test_same_seed_same_samples(model: torch.nn.Module,
                                tok: transformers.PreTrainedTokenizerBase,
                                prompts: list[list[int]]) -> None:
    a = draw(model, tok, prompts, seed=3)
    b = draw(model, tok, prompts, seed=3)
    c = draw(model, tok, prompts, seed=4)
    assert a == b
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_finished_exactly_when_last_token_is_eos(model: torch.nn.Module,
                                                 tok: transformers.PreTrainedTokenizerBase,
                                                 prompts: list[list[int]]) -> None:
    eos = tok.eos_token_id
    samples = draw(EosBias(model, eos, 4.0), tok, prompts * 4, seed=5, batch_size=7)
    finished = [s for s in samples if s.finished]
    truncated = [s for s in samples if not s.finished]
    assert finished and truncated                       # both cases are exercised
    for s in samples:
        assert s.finished == (s.response_ids[-1] == eos)
        assert eos not in s.response_ids[:-1]           # nothing is sampled after EOS
        assert tok.pad_token_id not in s.response_ids
    assert all(len(s.response_ids) == MAX_NEW for s in truncated)
    assert all(len(s.response_ids) <= MAX_NEW for s in finished)
    assert any(len(s.response_ids) < MAX_NEW for s in finished)


def tempered_probs(model: torch.nn.Module, prompt: list[int], s: Sample,
                   temperature: float) -> torch.Tensor:
    """(R, V) tempered next-token distributions at each response position."""
    ids = torch.tensor([prompt + list(s.response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    start = len(prompt) - 1
    return torch.softmax(logits[start: start + len(s.response_ids)] / temperature, -1)


def test_tiny_top_p_samples_the_argmax(model: torch.nn.Module,
                                       tok: transformers.PreTrainedTokenizerBase,
                                       prompts: list[list[int]]) -> None:
    temperature, top_p = 0.7, 1e-3
    samples = draw(model, tok, prompts * 2, seed=6, temperature=temperature, top_p=top_p)
    for prompt, s in zip(prompts * 2, samples):
        probs = tempered_probs(model, prompt, s, temperature)
        # the nucleus is a single token only when the top token alone holds mass >= top_p
        assert bool((probs.max(-1).values > top_p).all())
        assert list(s.response_ids) == probs.argmax(-1).tolist()
        assert all(abs(lp) < 1e-6 for lp in s.logprobs)    # renormalised nucleus: p = 1


def test_top_p_samples_stay_in_the_nucleus(model: torch.nn.Module,
                                           tok: transformers.PreTrainedTokenizerBase,
                                           prompts: list[list[int]]) -> None:
    # a random tiny model is nearly uniform: a 5% nucleus holds several tokens, not the argmax
    temperature, top_p = 0.7, 0.05
    samples = draw(model, tok, prompts * 2, seed=7, temperature=temperature, top_p=top_p)
    sizes = []
    for prompt, s in zip(prompts * 2, samples):
        probs = tempered_probs(model, prompt, s, temperature)
        for t, token in enumerate(s.response_ids):
            p_sorted, order = probs[t].sort(descending=True)
            before = p_sorted.cumsum(0) - p_sorted          # mass ranked above each token
            nucleus = order[before <= top_p].tolist()        # smallest set with mass >= top_p
            sizes.append(len(nucleus))
            assert token in nucleus
            # the stored log-prob is that of the renormalised nucleus distribution
            expected = float(probs[t, token] / probs[t, nucleus].sum())
            assert s.logprobs[t] == pytest.approx(torch.tensor(expected).log().item(), abs=1e-4)
    assert max(sizes) > 1
