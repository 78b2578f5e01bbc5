"""Shared-prompt packing (`lm.pack`): responses to one prompt (K rollouts, a pair's two sides)
share one row with the prompt computed once, and each response gets exactly what its own
[prompt | response] forward gives: log-probs and their gradients, values, reward scores."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from tasks.config.params import TinyModelParams
from tasks.models import lm
from tasks.models.tiny_model import build_tiny_model
from tasks.policy.value_head import ValueHead, logprobs_and_values
from tasks.reward.features import EncodedPair
from tasks.reward.reward_model import RewardEnsemble, member_pair_rewards, member_rewards
from tiny_sampling import Wrapped

VOCAB = 300


def _ids(g: torch.Generator, n: int) -> list[int]:
    return [int(x) for x in torch.randint(3, VOCAB, (n,), generator=g)]


@pytest.fixture()
def batch() -> tuple[list[list[int]], list[list[int]]]:
    """Three distinct prompts of different lengths; the first has three responses (one of
    length 1), the second two, the third one; input order interleaves them."""
    g = torch.Generator().manual_seed(1)
    x = [_ids(g, 5), _ids(g, 9), _ids(g, 3)]
    plan = [(0, 4), (1, 1), (0, 6), (2, 2), (0, 1), (1, 3)]          # (prompt, response length)
    return [x[i] for i, _ in plan], [_ids(g, n) for _, n in plan]


SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _policy() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return build_tiny_model(TinyModelParams(), VOCAB, SPECIAL, 0)


def _one_by_one(model: torch.nn.Module, prompts: list[list[int]],
                responses: list[list[int]]) -> torch.Tensor:
    """Each response in its own forward pass (nothing to share), padded to (B, R)."""
    width = max(len(r) for r in responses)
    rows = [lm.response_logprobs(model, [p], [r], pad_id=0)[0][0] for p, r in
            zip(prompts, responses)]
    return torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])


def test_pack_layout(batch) -> None:
    prompts, responses = batch
    pk = lm.pack(prompts, responses, pad_id=0)
    assert pk.ids.shape[0] == 3                          # one row per distinct prompt
    assert pk.rows.tolist() == [0, 1, 0, 2, 0, 1]
    # row 0 = [x0 | y0 | y2 | y4]: |x| + sum |y| tokens, not 3 |x| + sum |y|
    x0, y0, y2, y4 = prompts[0], responses[0], responses[2], responses[4]
    assert pk.ids[0, : 5 + 4 + 6 + 1].tolist() == x0 + y0 + y2 + y4
    assert pk.positions[0, : 16].tolist() == (list(range(9)) + list(range(5, 11)) + [5])
    assert pk.starts[2] == 9 and pk.prompt_ends[2] == 4
    att = pk.attention[0, 0]
    assert att[9, :5].all() and att[9, 9]                # y2's first token: the prompt, itself
    assert not att[9, 5:9].any()                         # never y0
    assert not att[15, 5:15].any()                       # y4: neither y0 nor y2
    assert not att[4, 5:].any()                          # causal
    assert pk.last_positions().tolist()[:3] == [8, 9, 14]


def test_packed_logprobs_equal_one_by_one(batch) -> None:
    prompts, responses = batch
    model = _policy()
    logp, mask = lm.response_logprobs(model, prompts, responses, pad_id=0)
    assert mask.sum(-1).tolist() == [float(len(r)) for r in responses]
    assert torch.allclose(logp, _one_by_one(model, prompts, responses), atol=1e-6)
    assert float(logp.detach().abs().sum()) > 0


def test_packed_logprob_gradients_equal_one_by_one(batch) -> None:
    prompts, responses = batch
    model = _policy()
    weights = torch.linspace(-1.0, 2.0, len(responses))[:, None]           # mixes the rows

    def grads(logp: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        (weights * logp).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    packed = grads(lm.response_logprobs(model, prompts, responses, pad_id=0)[0])
    separate = grads(_one_by_one(model, prompts, responses))
    assert len(packed) == len(separate) > 0
    for a, b in zip(packed, separate):
        assert torch.allclose(a, b, atol=1e-5)


def test_packed_values_read_at_the_predicting_positions(batch) -> None:
    prompts, responses = batch
    model, head = _policy(), ValueHead(TinyModelParams().hidden_size)
    torch.nn.init.normal_(head.linear.weight, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lp, v, m = logprobs_and_values(model, head, prompts, responses, pad_id=0)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            out = model(input_ids=torch.tensor([p + r]), output_hidden_states=True)
            h = out.hidden_states[-1][0, len(p) - 1: len(p) - 1 + len(r)]    # predicts r
            assert torch.allclose(v[i, : len(r)], head(h[None])[0], atol=1e-5)
            assert float(v[i, len(r):].abs().sum()) == 0.0


def test_packed_reward_scores_equal_one_by_one(batch) -> None:
    prompts, responses = batch
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    ens = RewardEnsemble([transformers.LlamaForSequenceClassification(config).eval()
                          for _ in range(2)])
    pairs = [EncodedPair(tuple(prompts[i]), tuple(responses[i]), tuple(responses[j]))
             for i, j in ((0, 2), (1, 5))]
    with torch.no_grad():
        r_all = member_rewards(ens, prompts, responses, pad_id=0)                # (K, B)
        alone = torch.cat([member_rewards(ens, [p], [r], pad_id=0)
                           for p, r in zip(prompts, responses)], dim=1)
        r_c, r_r = member_pair_rewards(ens, pairs, pad_id=0)                     # (K, 2)
    assert r_all.shape == (2, 6)
    assert torch.allclose(r_all, alone, atol=1e-5)
    assert torch.allclose(r_c, alone[:, [0, 1]], atol=1e-5)
    assert torch.allclose(r_r, alone[:, [2, 5]], atol=1e-5)
    assert not torch.allclose(r_c, r_r)


# --- property: any prompt and response lengths -------------------------------------------------

def _random_plan(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Chat-sized prompts (25-90 tokens: SmolLM2's template with its system prompt is ~30 plus
    the request) with 1-4 responses each, in a shuffled order: several prompt groups, unequal
    response lengths, a one-token response in every plan. Even seeds keep every response
    shorter than every prompt (the shape that crashed), odd seeds draw 1-60 tokens freely."""
    g = torch.Generator().manual_seed(seed)
    groups = [_ids(g, int(torch.randint(25, 91, (1,), generator=g)))
              for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
    cap = min(len(x) for x in groups) - 1 if seed % 2 == 0 else 60
    prompts, responses = [], []
    for j, x in enumerate(groups):
        lengths = torch.randint(1, cap + 1, (int(torch.randint(1, 5, (1,), generator=g)),),
                                generator=g).tolist()
        if j == 0:
            lengths[0] = 1
        for n in lengths:
            prompts.append(x)
            responses.append(_ids(g, n))
    order = torch.randperm(len(prompts), generator=g).tolist()
    return [prompts[i] for i in order], [responses[i] for i in order]


def _unpacked(model: torch.nn.Module, prompt: list[int], response: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) (|y|,) and the last hidden states predicting them (|y|, H), from a
    plain forward over [x | y] with no packing, mask or position ids."""
    out = model(input_ids=torch.tensor([prompt + response]), output_hidden_states=True)
    logp = out.logits[0].float().log_softmax(-1)                             # (T, V)
    pred = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pred, torch.tensor(response)], out.hidden_states[-1][0, pred]


def test_reported_lengths_no_longer_crash() -> None:
    """The user's case: a 43-token prompt with responses of 12 and 5 tokens (IndexError before:
    padded slots were read at position 0 of logits that start at the prompt's end)."""
    g = torch.Generator().manual_seed(3)
    x, y1, y2 = _ids(g, 43), _ids(g, 12), _ids(g, 5)
    model = _policy()
    with torch.no_grad():
        logp, mask = lm.response_logprobs(model, [x, x], [y1, y2], pad_id=0)
        for i, y in enumerate((y1, y2)):
            assert torch.allclose(logp[i, : len(y)], _unpacked(model, x, y)[0], atol=1e-5)
    assert mask.sum(-1).tolist() == [12.0, 5.0]
    assert float(logp[1, 5:].abs().sum()) == 0.0


@pytest.mark.parametrize("seed", range(12))
def test_packing_equals_unpacked_forward_for_any_lengths(seed: int) -> None:
    """Packed log-probs, values and their gradients equal the unpacked forward of each
    [prompt | response] to 1e-5 (fp32), whatever the lengths."""
    prompts, responses = _random_plan(seed)
    if seed % 2 == 0:
        assert max(len(r) for r in responses) < min(len(x) for x in prompts)
    model, head = _policy(), ValueHead(TinyModelParams().hidden_size)
    torch.nn.init.normal_(head.linear.weight, generator=torch.Generator().manual_seed(seed))
    weights = torch.randn(len(responses), 90, generator=torch.Generator().manual_seed(seed))

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    logp, values, mask = logprobs_and_values(model, head, prompts, responses, pad_id=0)
    assert mask.sum(-1).tolist() == [float(len(r)) for r in responses]
    packed = grads((weights[:, : logp.shape[1]] * logp).sum())
    alone_loss = torch.zeros(())
    for i, (x, y) in enumerate(zip(prompts, responses)):
        ref, hidden = _unpacked(model, x, y)
        assert torch.allclose(logp[i, : len(y)], ref, atol=1e-5)
        assert torch.allclose(values[i, : len(y)], head(hidden.detach()[None])[0], atol=1e-5)
        assert float(logp[i, len(y):].abs().sum() + values[i, len(y):].abs().sum()) == 0.0
        alone_loss = alone_loss + (weights[i, : len(y)] * ref).sum()
    for a, b in zip(packed, grads(alone_loss)):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_packed_reward_scores_equal_unpacked_for_any_lengths(seed: int) -> None:
    """The reward model reads each response's last token: equal to the unpacked forward's
    last hidden state through the score head."""
    prompts, responses = _random_plan(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      num_labels=1, pad_token_id=0)
    torch.manual_seed(seed)
    rm = transformers.LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        r = member_rewards(rm, prompts, responses, pad_id=0)[0]                   # (B,)
        for i, (x, y) in enumerate(zip(prompts, responses)):
            h = rm.model(input_ids=torch.tensor([x + y])).last_hidden_state[0, -1]
            assert torch.allclose(r[i], rm.score(h)[0], atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packing_is_exact_under_the_models_attention_implementation(impl, tmp_path) -> None:
    """A user's model whose config.json asks for eager attention (as some models ship):
    transformers hands our 4D mask to the attention function unchanged, and eager adds it to
    the scores, so booleans masked nothing (packed log-probs off by 0.05 on the tiny model:
    every token saw the future and the row's other responses). Loaded by the stages' own
    loaders (`lm.load_causal_lm`, `init_reward_model` on it as backbone), packed log-probs,
    values and RM scores equal a plain unpacked forward."""
    from tasks.reward.reward_model import init_reward_model
    prompts, responses = _random_plan(3)
    _policy().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attn_implementation": impl}))
    model = lm.load_causal_lm(tmp_path)
    assert model.config._attn_implementation == impl
    head = ValueHead(TinyModelParams().hidden_size)
    wrapped = Wrapped(model)                  # a module around the model: its config is read
    with torch.no_grad():
        logp, values, _ = logprobs_and_values(model, head, prompts, responses, pad_id=0)
        logp_wrapped, _ = lm.response_logprobs(wrapped, prompts, responses, pad_id=0)
        for i, (x, y) in enumerate(zip(prompts, responses)):
            ref, hidden = _unpacked(model, x, y)
            assert torch.allclose(logp[i, : len(y)], ref, atol=1e-5)
            assert torch.allclose(logp_wrapped[i, : len(y)], ref, atol=1e-5)
            assert torch.allclose(values[i, : len(y)], head(hidden[None])[0], atol=1e-5)
    rm = init_reward_model(tmp_path, torch.Generator().manual_seed(0)).eval()
    assert rm.config._attn_implementation == impl
    with torch.no_grad():
        r = member_rewards(rm, prompts, responses, pad_id=0)[0]
        for i, (x, y) in enumerate(zip(prompts, responses)):
            h = rm.model(input_ids=torch.tensor([x + y])).last_hidden_state[0, -1]
            assert torch.allclose(r[i], rm.score(h)[0], atol=1e-5)


def test_an_attention_implementation_without_4d_masks_is_one_clear_error() -> None:
    model = _policy()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(lm.ModelError, match="flash_attention_2.*sdpa"):
        lm.response_logprobs(model, [[5, 6]], [[7]], pad_id=0)
