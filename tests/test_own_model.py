"""A user's own model: a small random Llama saved with save_pretrained next to SmolLM2's
tokenizer and chat template (`model.source: hf_dir`), through the whole loop by the CLI, and the
resulting policy loaded back with plain transformers and chatted with.

Its samples end at EOS after unequal numbers of tokens while its chat-rendered prompts are
longer than any response: the shape that crashed `update@1` with an IndexError in packing."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from conftest import TINY, run_cli, set_params
from tasks.core import layout
from tasks.models import lm
from tasks.models.tiny_model import CACHE_ENV
from tasks.models.tiny_model import tokenizer as smollm2_tokenizer

MAX_NEW = 12                              # rollout.generation.max_new_tokens in tiny.yaml


def save_own_model(out: Path, tok: transformers.PreTrainedTokenizerBase) -> None:
    """A random Llama (tied embeddings) whose EOS logit is raised on every step, so that its
    samples finish after different numbers of tokens (as a trained chat model's do): every
    embedding row shares coordinate 0, EOS's has more, and no layer writes that coordinate."""
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.1
        model.model.embed_tokens.weight[tok.eos_token_id, 0] += 2.5
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
    model.save_pretrained(out)
    tok.save_pretrained(out)


@pytest.mark.slow      # a whole extra loop through the CLI: minutes
def test_own_hf_dir_model_runs_the_loop_and_chats(tmp_path: Path,
                                                  tmp_path_factory) -> None:
    tok = smollm2_tokenizer(Path(os.environ.get(CACHE_ENV)
                                 or tmp_path_factory.getbasetemp() / "tokenizer-cache"))
    src = tmp_path / "my-llama"
    save_own_model(src, tok)
    params = tmp_path / "own.yaml"
    params.write_text(TINY.read_text())
    set_params(params, model__source="hf_dir", model__path=str(src),
               iterations={"1": {"prev": 0}}, offpolicy__n_prompts=6, rollout__n_prompts=6,
               evaluate__n_prompts=4)                  # one iteration, fewer prompts: cheap
    ws = tmp_path / "ws"
    run_cli("run", "--params", str(params), "--workspace", str(ws))

    # the run sampled what crashed packing: prompts longer than unequal-length responses
    rollouts = [json.loads(x) for x in (ws / layout.rollouts(1)).read_text().splitlines()]
    lengths = [len(r["response_ids"]) for r in rollouts]
    assert min(len(r["prompt_ids"]) for r in rollouts) > MAX_NEW >= max(lengths)
    assert any(r["finished"] for r in rollouts) and len(set(lengths)) > 3
    pairs = [json.loads(x) for x in (ws / layout.pairs(1)).read_text().splitlines()]
    assert any(len(p["chosen_ids"]) != len(p["rejected_ids"]) for p in pairs)
    update = json.loads((ws / layout.metrics(1, "update")).read_text())
    assert update["update/steps"] > 0

    # the new policy is a plain transformers model with the user's tokenizer and template
    policy_dir = ws / layout.policy(1)
    policy = transformers.AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    policy_tok = transformers.AutoTokenizer.from_pretrained(policy_dir)
    assert policy_tok.chat_template == tok.chat_template
    assert policy_tok.get_vocab() == tok.get_vocab()
    assert lm.weights_md5(policy_dir) != lm.weights_md5(src)                  # it was trained
    messages = [{"role": "user", "content": "Write a short review of Jaws (1975)."}]
    ids = policy_tok.apply_chat_template(messages, add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    out = policy.generate(**ids, max_new_tokens=8, do_sample=False,
                          pad_token_id=policy_tok.pad_token_id)
    new = out[0, ids["input_ids"].shape[1]:]
    assert 0 < len(new) <= 8
    assert isinstance(policy_tok.decode(new, skip_special_tokens=True), str)


def save_own_qwen2(out: Path, tok: transformers.PreTrainedTokenizerBase) -> None:
    """A random Qwen2-architecture model (grouped-query attention, q/k/v biases) beside the
    same real tokenizer."""
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(7)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)


@pytest.mark.slow      # two loops through the CLI: minutes
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_own_model_with_lora_runs_registers_and_loads(tmp_path: Path, tmp_path_factory,
                                                      arch: str) -> None:
    """A user's own model (a small random Llama or Qwen2 with a real tokenizer) through the CLI
    with a LoRA adapter: both iterations run and register; each policy directory is an adapter
    on the user's model, and the registered champion loads from the workspace root with PEFT."""
    import subprocess
    import sys

    from conftest import ROOT
    tok = smollm2_tokenizer(Path(os.environ.get(CACHE_ENV)
                                 or tmp_path_factory.getbasetemp() / "tokenizer-cache"))
    src = tmp_path / f"my-{arch}"
    (save_own_model if arch == "llama" else save_own_qwen2)(src, tok)
    params = tmp_path / "own.yaml"
    params.write_text((ROOT / "params" / "tiny-lora.yaml").read_text().replace(
        "base: tiny.yaml", f"base: {TINY}") + f"model:\n  source: hf_dir\n  path: {src}\n"
        "offpolicy:\n  n_prompts: 6\nrollout:\n  n_prompts: 6\nevaluate:\n  n_prompts: 4\n")
    ws = tmp_path / "ws"
    out = run_cli("run", "--params", str(params), "--workspace", str(ws))
    assert "iteration 2: policy v2" in out.stdout, out.stdout[-2000:]
    for it in (1, 2):
        policy_dir = ws / layout.policy(it)
        assert (policy_dir / "adapter_config.json").is_file()
        assert not (policy_dir / "model.safetensors").exists()
    loaded = subprocess.run(
        [sys.executable, "-c", "import peft; m = peft.AutoPeftModelForCausalLM.from_pretrained("
         f"'{layout.policy(2)}'); print(type(m.get_base_model()).__name__)"],
        cwd=ws, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip().splitlines()[-1] == \
        ("LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM")
