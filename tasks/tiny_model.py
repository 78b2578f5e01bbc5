"""A tiny randomly initialised causal LM and word-level tokenizer, built from a config.

For tests and the `tiny` profile: no download, seconds to build. Its vocabulary holds common
review words plus positive and negative words of the VADER lexicon, so that even a random
model's samples carry sentiment and the lexicon judge has something to prefer.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from tasks.params import TinyModelParams

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
FILLER = """the a an and or but of to in on at for with is was it this that film movie story
plot acting actors cast director scenes scene ending music score characters character review
write short brief sentences two three what did you think give i we they very really quite so
too not no more most some all its their his her one time way feels feel felt made makes watch
watched see saw about like from as by be been has have had just also than then there here
. , ! ?""".split()


def _lexicon_words(per_side: int) -> list[str]:
    import vaderSentiment.vaderSentiment as vs

    pos, neg = [], []
    for word, valence in vs.SentimentIntensityAnalyzer().lexicon.items():
        if word.isalpha() and word.islower() and abs(valence) >= 1.0:
            (pos if valence > 0 else neg).append((-abs(valence), word))
    return [w for _, w in sorted(pos)[:per_side]] + [w for _, w in sorted(neg)[:per_side]]


def build_tokenizer(per_side: int = 150) -> transformers.PreTrainedTokenizerFast:
    words = list(dict.fromkeys(FILLER + _lexicon_words(per_side)))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", additional_special_tokens=SPECIAL[4:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(p: TinyModelParams, vocab_size: int, special_ids: dict[str, int],
                     seed: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads, num_key_value_heads=p.num_heads,
        intermediate_size=p.intermediate_size, max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=True, **special_ids)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def save_tiny(p: TinyModelParams, seed: int, out_dir: Path) -> dict[str, object]:
    """Build tokenizer and model and save both to out_dir (which must be empty/new)."""
    tok = build_tokenizer()
    ids = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    model = build_tiny_model(p, len(tok), ids, seed)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"n_params": sum(t.numel() for t in model.parameters()), "vocab_size": len(tok)}
