"""The KV-cached, left-padded sampler agrees with a plain full forward pass."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from tasks.config.params import TinyModelParams
from tasks.data.records import Message
from tasks.models import fast_llama, lm, sampling
from tasks.models.sampling import Sample, sample
from tasks.models.tiny_model import CACHE_ENV, build_tiny_model, special_ids
from tasks.models.tiny_model import tokenizer as smollm2_tokenizer

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
    sampler on SmolLM2's real tokenizer is tested below (test_real_tokenizer_...)."""
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


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return word_tokenizer()


@pytest.fixture(scope="module")
def model(tok: transformers.PreTrainedTokenizerFast) -> transformers.LlamaForCausalLM:
    return build_tiny_model(TinyModelParams(), len(tok), special_ids(tok), seed=0)


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


# --- the fast Llama path ----------------------------------------------------------------------

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


@pytest.fixture(scope="module")
def gqa_model(tok: transformers.PreTrainedTokenizerFast) -> transformers.LlamaForCausalLM:
    """Grouped-query attention: 4 query heads over 2 KV heads."""
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def system_prompts(tok: transformers.PreTrainedTokenizerFast) -> list[list[int]]:
    """K = 3 consecutive copies of chat prompts that share a system message, as rollouts lay
    them out: a long common prefix, then remainders of different lengths."""
    system = Message("system", "you are a film critic . write short reviews of the movie")
    texts = ["hi", "what did you think of the movie ?", "a film", "the acting and the music"]
    out = [lm.render_prompt(tok, (system, Message("user", t)), 64) for t in texts]
    assert len({len(p) for p in out}) == len(out)
    return [p for p in out for _ in range(3)]


def test_prompt_layout_shares_the_prefix_and_the_samples_of_a_prompt() -> None:
    lay = fast_llama.prompt_layout([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5], [1, 2, 5]])
    assert (lay.prefix, lay.remainders, lay.group, lay.width) == ((1, 2), ((3, 4), (5,)), 2, 2)
    # runs of unequal length: every row keeps its own remainder
    odd = fast_llama.prompt_layout([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5]])
    assert (odd.remainders, odd.group) == (((3, 4), (3, 4), (5,)), 1)
    same = fast_llama.prompt_layout([[7, 8, 9]] * 4)
    assert (same.prefix, same.remainders, same.group) == ((7, 8), ((9,),), 4)   # one token left
    assert fast_llama.prompt_layout([[1, 2], [3, 4]]).prefix == ()


def test_fast_path_serves_plain_llamas_only(model: torch.nn.Module,
                                            gqa_model: torch.nn.Module) -> None:
    assert fast_llama.supports(model) and fast_llama.supports(gqa_model)
    assert not fast_llama.supports(Wrapped(model))
    assert not fast_llama.supports(copy.deepcopy(model).to(torch.bfloat16))


@pytest.mark.parametrize("which, small_chunks", [("mha", False), ("gqa", False), ("gqa", True)])
def test_fast_path_logprobs_match_full_forward_with_shared_prompts_and_eos(
        model: torch.nn.Module, gqa_model: torch.nn.Module,
        tok: transformers.PreTrainedTokenizerBase, prompts: list[list[int]],
        system_prompts: list[list[int]], which: str, small_chunks: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if small_chunks:        # several packed prefill sequences and lm_head chunks, a partial last
        monkeypatch.setattr(fast_llama, "PACK_TOKENS", 12)
        monkeypatch.setattr(fast_llama, "HEAD_CHUNK", 100)
        assert len(tok) % 100
    policy = eos_heavy(model if which == "mha" else gqa_model, tok.eos_token_id, 0.8)
    assert fast_llama.supports(policy)
    rows = system_prompts + [p for p in prompts for _ in range(2)]   # two prefix structures
    for batch, temperature in ((len(system_prompts), 1.0), (5, 0.7)):
        samples = draw(policy, tok, rows, seed=9, temperature=temperature, batch_size=batch)
        expected = full_forward_logprobs(policy, tok, rows, samples, temperature)
        finished = [s.finished for s in samples]
        assert any(finished) and not all(finished)                  # EOS stops some rows
        assert any(len(s.response_ids) < MAX_NEW for s in samples if s.finished)
        for s, ref in zip(samples, expected):
            assert len(s.logprobs) == len(ref)
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-4


@pytest.mark.parametrize("top_p", [1.0, 0.3])
def test_fast_and_generic_paths_draw_the_same_samples(
        gqa_model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase,
        system_prompts: list[list[int]], top_p: float) -> None:
    # both paths feed the same uniforms to the same sampler: only rounding could part them
    # (tokens flip only for a uniform within float32 rounding, ~1e-6, of a CDF step), so the
    # tokens are compared and the log-probs to a tolerance, never their bits across paths
    policy = eos_heavy(gqa_model, tok.eos_token_id, 0.8)
    fast = draw(policy, tok, system_prompts, seed=10, top_p=top_p, batch_size=7)
    generic = draw(Wrapped(policy), tok, system_prompts, seed=10, top_p=top_p, batch_size=7)
    assert [(s.response_ids, s.finished) for s in fast] == \
        [(s.response_ids, s.finished) for s in generic]
    assert max(abs(a - b) for f, g in zip(fast, generic)
               for a, b in zip(f.logprobs, g.logprobs)) < 1e-5
    # bits: the same path, shapes and threads in the same process
    assert fast == draw(policy, tok, system_prompts, seed=10, top_p=top_p, batch_size=7)
    assert fast != draw(policy, tok, system_prompts, seed=11, top_p=top_p, batch_size=7)


def test_samples_do_not_depend_on_batch_size_or_threads(
        gqa_model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase,
        system_prompts: list[list[int]]) -> None:
    # each row draws from its own uniforms (taken in row order), whatever batch or shard it is in;
    # tokens only: the log-probs' last bits may move with the shard and threads (CPU-dependent)
    policy = eos_heavy(gqa_model, tok.eos_token_id, 0.8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = draw(policy, tok, system_prompts, seed=13, batch_size=len(system_prompts))
        torch.set_num_threads(1)
        pieces = draw(policy, tok, system_prompts, seed=13, batch_size=5)
    finally:
        torch.set_num_threads(threads)
    assert [s.response_ids for s in whole] == [s.response_ids for s in pieces]
    assert torch.get_num_threads() == threads


def test_the_plans_shards_give_samples_bits_on_their_own_threads_anywhere(
        gqa_model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase,
        system_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan` records each thread shard of `sample` (its rows, uniforms and torch threads), and
    `sample_shard` runs a shard on the plan's threads whatever the process's own count (a Ray
    worker's): the same ops on the same shapes on the same threads as `sample`, so `sample`'s
    bits, in any order, on whichever CPU both run. The same rows in another shard (here: on 2
    threads instead of 1) draw the same tokens, with log-probs equal to rounding; whether their
    last bits differ depends on the CPU's kernels (they did on AMD EPYC, not on Intel Xeon with
    AMX), so only a tolerance is asserted."""
    policy = eos_heavy(gqa_model, tok.eos_token_id, 0.8)
    make = sampling.decoders(policy, pad_id=tok.pad_token_id, temperature=1.0,
                             max_new_tokens=MAX_NEW)
    ran_on: list[int] = []
    real_rows = sampling.sample_rows

    def spy(*args: object, **kwargs: object) -> list[Sample]:
        ran_on.append(torch.get_num_threads())
        return real_rows(*args, **kwargs)  # type: ignore[arg-type]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = draw(policy, tok, system_prompts, seed=14, batch_size=9)      # 9 rows + 3 rows
        shards = sampling.plan(system_prompts, batch_size=9, max_new_tokens=MAX_NEW,
                               generator=torch.Generator().manual_seed(14), threads=2)
        assert [(len(s.prompts), s.threads) for s in shards] == [(6, 1), (3, 1), (3, 2)]
        alone = draw(policy, tok, system_prompts[:6], seed=14, batch_size=9)  # one shard, 2 threads
        torch.set_num_threads(3)                    # a worker whose own thread count differs
        monkeypatch.setattr(sampling, "sample_rows", spy)
        one_by_one = [x for s in shards[::-1] for x in sampling.sample_shard(
            make, s, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, top_p=1.0)[::-1]][::-1]
        assert torch.get_num_threads() == 3         # restored after each shard
    finally:
        torch.set_num_threads(threads)
    assert ran_on == [2, 1, 1]                      # the plan's threads, shards in reverse
    assert one_by_one == whole
    # the tokens agree unless a uniform falls within float32 rounding of a CDF step (~1e-6)
    assert [s.response_ids for s in alone] == [s.response_ids for s in whole[:6]]
    assert max(abs(a - b) for x, y in zip(alone, whole[:6])
               for a, b in zip(x.logprobs, y.logprobs)) < 1e-5


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
