"""Every params profile loads; bad ones fail naming the file, the line and the dotted key."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.config.params import Params, ParamsError, load_params, parse_params, to_dict

PARAMS_DIR = Path(__file__).resolve().parents[1] / "params"
PROFILES = sorted(PARAMS_DIR.glob("*.yaml"))

# A minimal valid profile; line numbers in the tests below count from its first line.
BASE = """\
seed: 0
iterations:
  "1": {prev: 0}
  "2": {prev: 1}
train_rm:
  lr: 1.0e-3
  epochs: 2
update:
  dpo:
    beta: 0.1
"""


def write(tmp_path: Path, text: str | bytes, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ParamsError) as e:
        load_params(path)
    return str(e.value)


def test_profiles_present() -> None:
    assert PARAMS_DIR / "tiny.yaml" in PROFILES


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_every_profile_loads(path: Path) -> None:
    p = load_params(path)
    assert isinstance(p, Params)
    assert list(p.iterations) == [str(i) for i in range(1, len(p.iterations) + 1)]
    assert to_dict(p)["seed"] == p.seed


def test_tiny_profile_values() -> None:
    p = load_params(PARAMS_DIR / "tiny.yaml")
    assert p.model.source == "tiny"
    assert p.iterations["2"].prev == 1
    assert p.train_rm.lr == 1e-3 and isinstance(p.train_rm.lr, float)
    assert p.update.algo == "dpo"


def test_base_profile_is_valid(tmp_path: Path) -> None:
    p = load_params(write(tmp_path, BASE))
    assert p.train_rm.epochs == 2 and p.update.dpo.beta == 0.1


def test_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("  epochs: 2\n", "  epochs: 2\n  epocs: 3\n"))
    msg = load_error(path)
    assert msg.startswith(f"{path}:8: train_rm.epocs: unknown key"), msg
    assert "epochs" in msg          # the allowed keys are listed


def test_unknown_nested_key(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("    beta: 0.1\n", "    beta: 0.1\n    betta: 0.2\n"))
    assert load_error(path).startswith(f"{path}:11: update.dpo.betta: unknown key")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "trian_rm: {lr: 0.1}\n")
    assert load_error(path).startswith(f"{path}:11: trian_rm: unknown key")


def test_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("  epochs: 2\n", "  epochs: two\n"))
    msg = load_error(path)
    assert msg.startswith(f"{path}:7: train_rm.epochs: expected an integer"), msg
    assert "'two'" in msg


def test_float_for_int_is_a_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("  epochs: 2\n", "  epochs: 2.5\n"))
    assert load_error(path).startswith(f"{path}:7: train_rm.epochs: expected an integer")


def test_bad_literal(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "judge:\n  kind: gpt\n")
    msg = load_error(path)
    assert msg.startswith(f"{path}:12: judge.kind: expected one of ['lexicon', 'lexicon_topic', 'lexicon_review', 'llm', 'http', 'reward_model'], got 'gpt'"), msg


def test_missing_iteration_item_key(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace('  "2": {prev: 1}\n', '  "2": {}\n'))
    msg = load_error(path)
    assert msg.startswith(f"{path}:4: iterations.2.prev: missing required key"), msg


def test_prev_names_an_earlier_iteration(tmp_path: Path) -> None:
    ok = write(tmp_path, BASE.replace('  "2": {prev: 1}\n', '  "2": {prev: 0}\n'))
    assert load_params(ok).iterations["2"].prev == 0      # a branch from the initial model
    path = write(tmp_path, BASE.replace('  "2": {prev: 1}\n', '  "2": {prev: 2}\n'))
    msg = load_error(path)
    assert msg.startswith(f"{path}:4: iterations.2.prev: prev must be an earlier iteration "
                          "(0 to 1), got 2"), msg


def test_missing_iterations(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 0\ntrain_rm:\n  lr: 1.0e-3\n")
    assert load_error(path).startswith(f"{path}:1: iterations: missing required key")


def test_out_of_range(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("  lr: 1.0e-3\n", "  lr: -1.0\n"))
    assert load_error(path).startswith(f"{path}:6: train_rm.lr: must be > 0")


def test_more_disjoint_pairs_than_samples_allow(tmp_path: Path) -> None:
    text = BASE + "rollout:\n  samples_per_prompt: 4\njudge:\n  pairs_per_prompt: 3\n"
    path = write(tmp_path, text)
    assert load_error(path).startswith(f"{path}:14: judge.pairs_per_prompt: 3 disjoint pairs "
                                       "need 6 samples, rollout has 4")


def test_non_utf8_bytes(tmp_path: Path) -> None:
    data = BASE.replace("  epochs: 2\n", "  epochs: 2   # caf\xe9\n").encode("latin-1")
    path = write(tmp_path, data)
    msg = load_error(path)
    assert msg.startswith(f"{path}:7: "), msg
    assert "UTF-8" in msg


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("  epochs: 2\n", "  epochs: 2: 3\n"))
    msg = load_error(path)
    assert msg.startswith(f"{path}:7: invalid YAML"), msg


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert load_error(path).startswith(f"{path}: params file not found")


def test_exponent_without_dot_parses_as_float(tmp_path: Path) -> None:
    # YAML 1.1 (PyYAML) reads 1e-5 as a string; the loader must still give a float
    path = write(tmp_path, BASE.replace("  lr: 1.0e-3\n", "  lr: 1e-5\n")
                 .replace("    beta: 0.1\n", "    beta: 2E-1\n    lr: 5e-4\n"))
    p = load_params(path)
    assert p.train_rm.lr == 1e-5 and isinstance(p.train_rm.lr, float)
    assert p.update.dpo.beta == 0.2 and p.update.dpo.lr == 5e-4


def test_int_for_float_is_accepted(tmp_path: Path) -> None:
    p = load_params(write(tmp_path, BASE.replace("    beta: 0.1\n", "    beta: 1\n")))
    assert p.update.dpo.beta == 1.0 and isinstance(p.update.dpo.beta, float)


def test_non_number_string_for_float_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("  lr: 1.0e-3\n", "  lr: fast\n"))
    assert load_error(path).startswith(f"{path}:6: train_rm.lr: expected a finite number")


def test_params_are_frozen() -> None:
    p = parse_params(BASE)
    with pytest.raises(AttributeError):
        p.seed = 1  # type: ignore[misc]


def test_duplicate_key_is_an_error_naming_its_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text('iterations:\n  "1": {prev: 0}\nseed: 1\nseed: 2\n')
    assert load_error(path).startswith(f"{path}:4: seed: duplicate key")


def test_non_finite_float_is_rejected(tmp_path):
    path = tmp_path / "nan.yaml"
    path.write_text('iterations:\n  "1": {prev: 0}\ntrain_rm:\n  lr: .nan\n')
    assert load_error(path).startswith(f"{path}:4: train_rm.lr: expected a finite number")


def test_ppo_profile_differs_from_default_only_in_update_its_bar_and_a_third_iteration(
        ) -> None:
    """default-ppo: the same loop with the PPO update, one iteration longer (the same first
    two); its gold bar is its own (0.70, not the DPO default's 0.80), never a copy that
    drifted."""
    base = to_dict(load_params(PARAMS_DIR / "default.yaml"))
    ppo = to_dict(load_params(PARAMS_DIR / "default-ppo.yaml"))
    assert ppo["update"]["algo"] == "ppo" and base["update"]["algo"] == "dpo"
    assert ppo["iterations"] == {**base["iterations"], "3": {"prev": 2}}
    same = ("update", "targets", "iterations")
    assert {k: v for k, v in ppo.items() if k not in same} == \
        {k: v for k, v in base.items() if k not in same}
    assert {k for k in ppo["targets"] if ppo["targets"][k] != base["targets"][k]} == \
        {"min_gold_win_rate", "min_gold_win_rate_ci_low"}


def test_http_judge_profile_differs_from_default_only_in_the_judge() -> None:
    """default-http-judge: the default loop labelled over HTTP, never a copy that drifted."""
    base = to_dict(load_params(PARAMS_DIR / "default.yaml"))
    http = to_dict(load_params(PARAMS_DIR / "default-http-judge.yaml"))
    assert http["judge"]["kind"] == "http" and base["judge"]["kind"] == "lexicon_review"
    assert {k: v for k, v in http.items() if k != "judge"} == \
        {k: v for k, v in base.items() if k != "judge"}
    own = yaml.safe_load((PARAMS_DIR / "default-http-judge.yaml").read_text())
    assert set(own) == {"base", "judge"} and own["base"] == "default.yaml"   # no copy to drift


def test_safety_profile_differs_from_default_only_in_its_imported_pairs() -> None:
    """default-safety: the default loop on the imported red-team pairs (and the off-policy mix
    that `auto` gives imports), read from where `alignloop import` writes them."""
    base = leaves(to_dict(load_params(PARAMS_DIR / "default.yaml")))
    safety = leaves(to_dict(load_params(PARAMS_DIR / "default-safety.yaml")))
    assert base.keys() == safety.keys()
    assert {k for k in base if base[k] != safety[k]} == \
        {("offpolicy", "source"), ("update", "dpo", "offpolicy_mix")}
    assert safety[("offpolicy", "source")] == "import"
    assert safety[("offpolicy", "import_path")] == "data/import/pairs.jsonl"
    assert safety[("update", "dpo", "offpolicy_mix")] == 0.5
    own = yaml.safe_load((PARAMS_DIR / "default-safety.yaml").read_text())
    assert own == {"base": "default.yaml", "offpolicy": {
        "source": "import", "import_path": "data/import/pairs.jsonl"}}


def test_book_profile_differs_from_default_only_in_how_it_reuses_the_book() -> None:
    """default-book: the default loop on an imported book, its first iteration offline."""
    base = to_dict(load_params(PARAMS_DIR / "default.yaml"))
    book = to_dict(load_params(PARAMS_DIR / "default-book.yaml"))
    assert book["rollout"]["offline"] == [1] and book["offpolicy"]["source"] == "import"
    dpo = {k for k in base["update"]["dpo"] if base["update"]["dpo"][k] != book["update"]["dpo"][k]}
    assert dpo == {"offline_pairs", "offpolicy_weighting", "offpolicy_mix"}
    assert book["update"]["dpo"]["offpolicy_mix"] == 0.5              # auto, with an import
    own = yaml.safe_load((PARAMS_DIR / "default-book.yaml").read_text())
    assert set(own) == {"base", "offpolicy", "rollout", "update"} and own["base"] == "default.yaml"
    assert own["rollout"] == {"offline": [1]} and set(own["update"]) == {"dpo"}


WORKERS = {("rollout", "workers"), ("judge", "workers"), ("evaluate", "workers"),
           ("update", "processes"), ("train_rm", "processes")}


def leaves(d: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """Every scalar of a nested params dict under its key path."""
    out: dict[tuple[str, ...], object] = {}
    for k, v in d.items():
        out.update(leaves(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


def test_distributed_profile_differs_from_tiny_only_in_the_workers() -> None:
    """tiny-distributed: the tiny loop on 2 Ray workers per sampling and judging stage and 2
    torchrun processes per update, never a copy that drifted; tiny itself runs without Ray."""
    tiny = leaves(to_dict(load_params(PARAMS_DIR / "tiny.yaml")))
    dist = leaves(to_dict(load_params(PARAMS_DIR / "tiny-distributed.yaml")))
    assert tiny.keys() == dist.keys() and WORKERS <= tiny.keys()
    assert {k for k in tiny if tiny[k] != dist[k]} == WORKERS
    assert {dist[k] for k in WORKERS} == {2} and {tiny[k] for k in WORKERS} == {1}


@pytest.mark.parametrize("section", ["rollout", "judge", "evaluate"])
def test_workers_must_be_positive(tmp_path: Path, section: str) -> None:
    path = write(tmp_path, BASE + f"{section}:\n  workers: 0\n")
    assert load_error(path) == f"{path}:12: {section}.workers: must be > 0, got 0"


def test_judge_workers_are_for_pointwise_judges(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "judge:\n  kind: http\n  workers: 2\n")
    assert load_error(path).startswith(f"{path}:13: judge.workers: judge.kind http compares")
    assert load_params(write(tmp_path, BASE + "judge:\n  kind: lexicon\n  workers: 2\n",
                             "ok.yaml")).judge.workers == 2


# --- sizes, the import path, the off-policy mix ----------------------------------------------

@pytest.mark.parametrize("old, new, expected", [
    ("  epochs: 2\n", "  epochs: 2\n  batch_size: -16\n",
     "8: train_rm.batch_size: must be > 0, got -16"),
    ("  epochs: 2\n", "  epochs: 0\n", "7: train_rm.epochs: must be > 0 (or 0 with head_init: probe, the probe alone), got 0"),
    ("    beta: 0.1\n", "    beta: 0.1\n    batch_size: 0\n",
     "11: update.dpo.batch_size: must be > 0, got 0"),
    ("    beta: 0.1\n", "    beta: 0.1\n    lr: -1.0e-3\n",
     "11: update.dpo.lr: must be > 0, got -0.001"),
    ("    beta: 0.1\n", "    beta: 0.1\n  kl_budget:\n    check_every: 0\n",
     "12: update.kl_budget.check_every: must be > 0, got 0"),
    ("    beta: 0.1\n", "    beta: 0.1\n  kl_budget:\n    n_prompts: 0\n",
     "12: update.kl_budget.n_prompts: must be > 0, got 0"),
    ("    beta: 0.1\n", "    beta: 0.1\n  kl_budget:\n    total: 20\n    backtrack: -1\n",
     "13: update.kl_budget.backtrack: must be >= 0 (0 = off), got -1"),
    ("    beta: 0.1\n", "    beta: 0.1\n  kl_budget:\n    total: -5\n",
     "12: update.kl_budget.total: must be >= 0 (0 = off), got -5.0"),
], ids=["rm-batch-negative", "rm-epochs-zero", "dpo-batch-zero", "dpo-lr-negative",
        "kl-check-every-zero", "kl-prompts-zero", "kl-backtrack-negative", "kl-total-negative"])
def test_sizes_and_counts_must_be_positive(tmp_path: Path, old: str, new: str,
                                           expected: str) -> None:
    path = write(tmp_path, BASE.replace(old, new))
    assert load_error(path) == f"{path}:{expected}"


@pytest.mark.parametrize("value", ["../outside/pairs.jsonl", "../../../etc/passwd",
                                   "/etc/passwd", "data/import/../../x", "data/import",
                                   "data/imports/a.jsonl"])
def test_import_path_must_stay_inside_data_import(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, BASE + f"offpolicy:\n  source: import\n  import_path: {value}\n")
    assert load_error(path) == (
        f"{path}:13: offpolicy.import_path: {value!r} is not inside the workspace's "
        "data/import/; bring the file in with `alignloop import FILE --workspace WORKSPACE` "
        "(it writes data/import/pairs.jsonl)")


def test_import_path_inside_data_import_loads() -> None:
    p = parse_params(BASE + "offpolicy:\n  import_path: data/import/hh/train.parquet\n")
    assert p.offpolicy.import_path == "data/import/hh/train.parquet"


@pytest.mark.parametrize("offpolicy, mix, expected", [
    ("source: import", "offpolicy_mix: auto", 0.5),
    ("source: cold_start", "offpolicy_mix: auto", 0.0),
    ("source: import", "", 0.5),                        # the key left out is auto
    ("source: import", "offpolicy_mix: 0.2", 0.2),      # a number is kept
    ("source: import", "offpolicy_mix: 0.0", 0.0),
])
def test_offpolicy_mix_auto_mixes_imported_pairs_in(offpolicy: str, mix: str,
                                                    expected: float) -> None:
    text = BASE + (f"    {mix}\n" if mix else "") + f"offpolicy:\n  {offpolicy}\n"
    assert parse_params(text).update.dpo.offpolicy_mix == expected


def test_offpolicy_mix_profiles_say_auto() -> None:
    from tasks.config.profiles import read_profile
    for path in PROFILES:                                    # as written, in it or its base
        assert read_profile(path).data["update"]["dpo"]["offpolicy_mix"] == "auto", path.name


# --- update.lora: off unless r > 0, and refused until the stages load adapters -----------------

def test_lora_left_out_is_off() -> None:
    lora = parse_params(BASE).update.lora
    assert lora.r == 0 and lora.alpha > 0 and "q_proj" in lora.target_modules


@pytest.mark.parametrize("lines, expected", [
    ("    r: -1\n", "10: update.lora.r: must be >= 0 (0 = off: a full fine-tune), got -1"),
    ("    alpha: 0\n", "10: update.lora.alpha: must be > 0, got 0.0"),
    ("    dropout: 1.0\n", "10: update.lora.dropout: must be in [0, 1), got 1.0"),
    ("    target_modules: []\n", "10: update.lora.target_modules: expected a non-empty list"),
    ("    target_modules: [q_proj, q_proj]\n", "10: update.lora.target_modules: must be "
     "distinct, non-empty module names, got ['q_proj', 'q_proj']"),
], ids=["r-negative", "alpha-zero", "dropout-one", "no-modules", "module-twice"])
def test_lora_out_of_range(tmp_path: Path, lines: str, expected: str) -> None:
    path = write(tmp_path, BASE.replace("update:\n", "update:\n  lora:\n" + lines))
    assert load_error(path) == f"{path}:{expected}"


def test_lora_on_several_processes_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("update:\n", "update:\n  processes: 2\n  lora:\n    r: 8\n"))
    assert load_error(path).endswith("update.lora.r: LoRA trains on one process: set "
                                     "update.processes: 1 (an adapter's update is small; its "
                                     "ranks would each hold the whole base)")


def test_lora_section_with_r_0_loads(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("update:\n", "update:\n  lora:\n    r: 0\n    alpha: 8\n"))
    assert load_params(path).update.lora.alpha == 8.0


@pytest.mark.parametrize("name, base, also", [
    ("default-lora.yaml", "default.yaml", {("update", "dpo", "lr")}),
    ("tiny-lora.yaml", "tiny.yaml", set())])
def test_lora_profiles_differ_from_their_base_only_in_the_adapter(name: str, base: str,
                                                                  also: set) -> None:
    """default-lora and tiny-lora: their base's loop with a LoRA adapter (and default-lora's
    larger step), never a copy that drifted."""
    full = leaves(to_dict(load_params(PARAMS_DIR / base)))
    lora = leaves(to_dict(load_params(PARAMS_DIR / name)))
    assert full.keys() == lora.keys()
    changed = {k for k in full if full[k] != lora[k]}
    assert changed - also == {("update", "lora", "r"), ("update", "lora", "alpha")} and \
        also <= changed
    assert full[("update", "lora", "r")] == 0 and lora[("update", "lora", "r")] > 0
    own = yaml.safe_load((PARAMS_DIR / name).read_text())
    assert set(own) == {"base", "update"} and own["base"] == base


# --- train_rm.freeze_layers: below the blocks the reward model keeps ----------------------------

@pytest.mark.parametrize("lines, expected", [
    ("  num_layers: 4\n  freeze_layers: 4\n", "9: train_rm.freeze_layers: must be below the "
     "blocks the reward model keeps (4: the last one trains), got 4"),
    ("  num_layers_grid: [3, 6]\n  freeze_layers: 3\n", "9: train_rm.freeze_layers: must be "
     "below the blocks the reward model keeps (3: the last one trains), got 3"),
    ("  freeze_layers: -1\n", "8: train_rm.freeze_layers: must be >= 0"),
], ids=["at-depth", "at-grid-min", "negative"])
def test_freeze_layers_out_of_range(tmp_path: Path, lines: str, expected: str) -> None:
    path = write(tmp_path, BASE.replace("  epochs: 2\n", "  epochs: 2\n" + lines))
    assert load_error(path) == f"{path}:{expected}"


def test_freeze_layers_below_the_depth_loads() -> None:
    text = BASE.replace("  epochs: 2\n", "  epochs: 2\n  num_layers: 4\n  freeze_layers: 3\n")
    assert parse_params(text).train_rm.freeze_layers == 3
