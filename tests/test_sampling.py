"""The fast Llama path of the sampler (tasks/models/fast_llama.py): prompts laid out as a shared
prefix and per-sample remainders, which models it serves, log-probs that equal a full forward
pass with shared prompts and EOS, the same samples as the generic transformers path, and samples
that depend on neither the batch size nor the threads, nor on the shard a plan runs them in."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tasks.config.params import TinyModelParams
from tasks.data.records import Message
from tasks.models import fast_llama, lm, sampling
from tasks.models.sampling import Sample
from tasks.models.tiny_model import build_tiny_model, special_ids
from tiny_sampling import (
    MAX_NEW,
    Wrapped,
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
