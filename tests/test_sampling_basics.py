"""The KV-cached, left-padded sampler agrees with a plain full forward pass: stored log-probs,
seeds, EOS and top-p on a word-level tokenizer (tests/tiny_sampling.py), first tokens drawn from
the tempered softmax and the renormalised nucleus, and prompts in SmolLM2's real tokenizer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

from tasks.config.params import TinyModelParams
from tasks.data.records import Message
from tasks.models import lm, sampling
from tasks.models.sampling import Sample
from tasks.models.tiny_model import CACHE_ENV, build_tiny_model, special_ids
from tasks.models.tiny_model import tokenizer as smollm2_tokenizer
from tiny_sampling import (
    MAX_NEW,
    chat_prompts,
    draw,
    eos_heavy,
    full_forward_logprobs,
    word_tokenizer,
)


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return word_tokenizer()


@pytest.fixture(scope="module")
def model(tok: transformers.PreTrainedTokenizerFast) -> transformers.LlamaForCausalLM:
    return build_tiny_model(TinyModelParams(), len(tok), special_ids(tok), seed=0)


@pytest.fixture(scope="module")
def prompts(tok: transformers.PreTrainedTokenizerFast) -> list[list[int]]:
    """Chat-rendered prompts of different lengths, so every batch is left-padded."""
    return chat_prompts(tok)


class EosBias(torch.nn.Module):
    """The wrapped model with a fixed bonus on the EOS logit, so that some samples finish."""

    def __init__(self, inner: torch.nn.Module, eos_id: int, bias: float):
        super().__init__()
        self.inner, self.eos_id, self.bias = inner, eos_id, bias

    def forward(self, **kwargs: object) -> object:
        out = self.inner(**kwargs)
        out.logits[..., self.eos_id] += self.bias
        return out


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
    # bits: same process, same shapes, same thread count: torch's CPU kernels are deterministic
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


def chi_square_z(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of counts against probs, as a z-score (X - dof) / sqrt(2 dof);
    cells expecting fewer than 5 draws are pooled."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big].double(), expected[big]
    if not bool(big.all()):
        obs = torch.cat([obs, counts[~big].sum().double()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    dof = len(obs) - 1
    return (float(((obs - exp) ** 2 / exp).sum()) - dof) / (2 * dof) ** 0.5


def first_token_counts(model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase,
                       prompt: list[int], n: int, temperature: float, top_p: float) -> torch.Tensor:
    samples = draw(model, tok, [prompt] * n, seed=12, temperature=temperature, top_p=top_p,
                   batch_size=n, max_new_tokens=1)
    return torch.bincount(torch.tensor([s.response_ids[0] for s in samples]), minlength=len(tok))


def next_token_probs(model: torch.nn.Module, prompt: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
                             / temperature, -1)


def test_first_tokens_follow_the_tempered_softmax(model: torch.nn.Module,
                                                  tok: transformers.PreTrainedTokenizerBase,
                                                  prompts: list[list[int]]) -> None:
    temperature = 0.25                      # peaked enough for the test to have power
    counts = first_token_counts(model, tok, prompts[1], 8000, temperature, 1.0)
    assert chi_square_z(counts, next_token_probs(model, prompts[1], temperature)) < 5
    # the check can fail: against a slightly different temperature it does
    assert chi_square_z(counts, next_token_probs(model, prompts[1], 1.25 * temperature)) > 20


def test_first_tokens_follow_the_renormalised_nucleus(model: torch.nn.Module,
                                                      tok: transformers.PreTrainedTokenizerBase,
                                                      prompts: list[list[int]]) -> None:
    temperature, top_p = 0.25, 0.6
    probs = next_token_probs(model, prompts[1], temperature)
    p_sorted, order = probs.sort(descending=True)
    nucleus = order[p_sorted.cumsum(0) - p_sorted <= top_p]
    assert 3 <= len(nucleus) < len(tok) // 2
    counts = first_token_counts(model, tok, prompts[1], 8000, temperature, top_p)
    inside = torch.zeros_like(probs).index_fill_(0, nucleus, 1.0).bool()
    assert int(counts[~inside].sum()) == 0
    assert chi_square_z(counts[inside], probs[inside] / probs[inside].sum()) < 5


def test_draw_never_picks_a_zero_probability_token() -> None:
    # a vocabulary that is not a multiple of the block, with all mass in the partial last block
    v = 2 * sampling.BLOCK + 44
    logits = torch.full((20000, v), float("-inf"))
    logits[:, v - 40: v - 10] = torch.linspace(-3.0, 0.0, 30)
    u = torch.rand(len(logits), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok, logp = sampling.draw(logits.clone(), 1.0, u)
    assert bool(((tok >= v - 40) & (tok < v - 10)).all())
    expected = torch.log_softmax(logits[0], -1)[tok]
    assert float((logp - expected).abs().max()) < 1e-5
    # uniforms at the very top of [0, 1) still land on the last token holding mass
    cdf = torch.tensor([[0.2, 0.7, 1.0, 1.0, 1.0]], dtype=torch.float64)
    top = torch.tensor([1.0], dtype=torch.float64)
    assert int(sampling.first_above(cdf, top)) == 2


# --- SmolLM2's real tokenizer: chat-rendered prompts, pad = eos --------------------------------

def test_real_tokenizer_prompts_pad_equal_to_eos(tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """The tiny profile's tokenizer (SmolLM2's, pad = eos = <|im_end|>): left-padded
    chat-rendered prompts of real lengths; stored log-probs equal the full forward, a response
    finishes exactly when it ends with EOS, and nothing follows it."""
    real = smollm2_tokenizer(Path(os.environ.get(CACHE_ENV)
                                  or tmp_path_factory.getbasetemp() / "tokenizer-cache"))
    assert real.pad_token_id == real.eos_token_id and len(real) == 49152
    policy = eos_heavy(build_tiny_model(TinyModelParams(), len(real), special_ids(real), 0),
                       real.eos_token_id, 2.6)
    texts = ["Hi.", "Write a short review of Jaws (1975).",
             "In two sentences, what did you think of the acting and the ending of Heat?"]
    rows = [lm.render_prompt(real, (Message("user", t),), 96) for t in texts]
    assert len({len(r) for r in rows}) == 3 and min(len(r) for r in rows) > 30  # + system
    samples = draw(policy, real, rows * 4, seed=3, batch_size=12)
    assert {s.finished for s in samples} == {True, False}
    expected = full_forward_logprobs(policy, real, rows * 4, samples, 1.0)
    for s, ref in zip(samples, expected):
        assert s.finished == (s.response_ids[-1] == real.eos_token_id)
        assert real.eos_token_id not in s.response_ids[:-1]
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-4
