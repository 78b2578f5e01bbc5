"""The benchmark's result assembly and target checks, on made-up figures (no model, no timing)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Literal

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.train_bench import with_precision  # noqa: E402


def _train(mfu32: float, mfu16: float | None, within: bool = True) -> dict:
    entry = {"fp32": {"mfu": mfu32, "peak_gflops": 185.0}, "best": "fp32", "mfu": mfu32}
    if mfu16 is not None:
        entry["bf16"] = {"mfu": mfu16, "peak_gflops": 415.0}
        entry["loss_check"] = {"within": within}
        if within and mfu16 > mfu32:
            entry.update(best="bf16", mfu=mfu16)
    return entry


def _fake(**over: object) -> dict:
    train = {"dpo": _train(0.42, 0.55), "rm": _train(0.61, None), "ppo": _train(0.3, 0.7, False)}
    rows = [{"scale": 1, "n_prompts": 8, "seconds": 100.0, "peak_rss_mb": 3000.0},
            {"scale": 2, "n_prompts": 16, "seconds": 170.0, "peak_rss_mb": 3100.0},
            {"scale": 4, "n_prompts": 32, "seconds": 390.0, "peak_rss_mb": 3300.0}]
    args = {"peaks": {"fp32_gflops": 185.0, "bf16_gflops": 415.0}, "train": train,
            "rollout": {"rollout_speedup": 3.4, "rollout_speedup_worst_pass": 3.1,
                        "logprob_max_abs_err": 2e-4},
            "cached": {"cached_rerun_s": 0.9}, "scaling": rows, "meta": {"quick": True},
            "vs_trl": {"dpo": {"ratio": 2.1}, "rm": {"ratio": 1.4}, "ppo": {"ratio": 1.6},
                       "dpo_bf16": {"ratio": 2.4,
                                    "bf16_deviation": {"within_tolerance": True}},
                       "rm_bf16": {"ratio": 1.9,
                                   "bf16_deviation": {"within_tolerance": False}}}}
    args.update(over)
    return report.assemble(**args)  # type: ignore[arg-type]


def test_all_targets_on_fake_figures():
    out = _fake()
    assert out["targets_met"] == {
        "train_mfu_dpo": True, "train_mfu_rm": True, "train_mfu_ppo": False,
        "rollout_speedup": True, "rollout_speedup_every_pass": True,
        "logprob_max_abs_err": True, "cached_rerun_s": True, "vs_trl_dpo": True,
        "vs_trl_rm": False, "vs_trl_dpo_bf16": True, "vs_trl_dpo_bf16_loss": True,
        "vs_trl_rm_bf16": False, "vs_trl_rm_bf16_loss": False, "vs_trl_ppo": True,
        "scaling_linear": True}
    assert out["scaling_ratios"] == {"t2/t1": 1.7, "t4/t1": 3.9}
    assert out["train_mfu_summary"]["dpo"]["precision"] == "bf16"
    assert out["train_mfu_summary"]["ppo"]["bf16_loss_within_tolerance"] is False
    json.loads(json.dumps(out))                     # one JSON object, as the last line


def test_misses_and_skipped_sections():
    rows = [{"scale": 1, "seconds": 100.0}, {"scale": 2, "seconds": 201.0}]
    out = _fake(rollout={"rollout_speedup": 2.9, "logprob_max_abs_err": 2e-3},
                cached=None, train=None, scaling=rows, vs_trl={"skipped": "no trl"})
    met = out["targets_met"]
    assert met["rollout_speedup"] is False and met["logprob_max_abs_err"] is False
    assert met["rollout_speedup_every_pass"] is None      # no per-pass figures: unknown
    assert met["vs_trl_dpo"] is None and met["vs_trl_rm"] is None
    assert met["vs_trl_dpo_bf16"] is None and met["vs_trl_rm_bf16_loss"] is None
    assert met["vs_trl_ppo"] is None
    alone = _fake(vs_trl={"ppo": {"ours": {"rollouts_per_s": 1.4}, "trl": "none: ..."}})
    assert alone["targets_met"]["vs_trl_ppo"] is None          # ours alone: no ratio
    assert _fake(vs_trl={"ppo": {"ratio": 1.49}})["targets_met"]["vs_trl_ppo"] is False
    # the fastest pass meets the bar, one pass does not: every-pass is missed
    one_slow = _fake(rollout={"rollout_speedup": 3.2, "rollout_speedup_worst_pass": 2.8,
                              "logprob_max_abs_err": 1e-4})["targets_met"]
    assert one_slow["rollout_speedup"] is True and one_slow["rollout_speedup_every_pass"] is False
    # a cached rerun over 1 s misses #17's bar
    assert _fake(cached={"cached_rerun_s": 1.3})["targets_met"]["cached_rerun_s"] is False
    assert met["scaling_linear"] is False
    assert met["cached_rerun_s"] is None and met["train_mfu_dpo"] is None
    assert out["cached_rerun_s"] is None


@dataclass(frozen=True)
class Lit:
    lr: float = 1.0
    precision: Literal["fp32", "bf16"] = "bf16"


@dataclass(frozen=True)
class Flag:
    autocast: bool = False


@dataclass(frozen=True)
class Nothing:
    lr: float = 1.0


def test_precision_switch_found_by_type():
    assert with_precision(Lit(), "fp32").precision == "fp32"
    assert with_precision(Flag(), "bf16").autocast is True
    assert with_precision(Nothing(), "bf16") is None


def test_stage_peak_memory_is_the_childs_own() -> None:
    """VmHWM polled while it runs: the child's peak, not the parent's carried over."""
    import subprocess
    import sys
    import threading

    from benchmarks.scaling import watch_peak
    ballast = bytearray(400 * 2**20)          # the parent is large; wait4 would report this
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(150 * 2**20); "
                              "b[::4096] = b'y' * len(b[::4096]); time.sleep(0.5)"])
    done, peak = threading.Event(), [0]
    watcher = threading.Thread(target=watch_peak, args=(child.pid, done, peak))
    watcher.start()
    child.wait()
    done.set()
    watcher.join()
    assert 150 * 1024 <= peak[0] < 300 * 1024, peak[0]       # KiB
    del ballast


def test_vs_trl_losses_equal_trls_on_a_tiny_model(tmp_path) -> None:
    """benchmarks/vs_trl.py on a tiny random model, 2 steps of 1 pair per side: our DPO and RM
    losses equal TRL's DPOTrainer's and RewardTrainer's step by step (same pairs, order and
    settings).
    trl comes with `make setup` (the `bench` extra), so this is not skipped there."""
    from benchmarks.vs_trl import TRL_VERSION, measure_vs_trl, trl_version
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    assert trl_version() == TRL_VERSION, "pip install -e '.[bench]' (trl is missing or other)"
    save_tiny(TinyModelParams(), 0, tmp_path)
    out = measure_vs_trl(tmp_path, ["dpo", "rm"], n_pairs=2, repeats=1, epochs=1,
                         batch_size=1, log=lambda _: None, precisions=("fp32", "bf16"))
    for kind, tolerance in (("dpo", 1e-4), ("rm", 1e-5)):
        r = out[kind]
        assert r["steps"] == 2 and r["same_steps"], r
        assert r["loss_max_abs_diff"] < tolerance, (kind, r["ours"]["losses"], r["trl"]["losses"])
        assert r["ours"]["losses"][0] != r["ours"]["losses"][1]       # the first step trained
        assert r["ours"]["pairs_per_s"] > 0 and r["trl"]["pairs_per_s"] > 0
        # both sides in bf16 autocast (TRL's weights stay fp32: checked in trl_dpo/trl_rm):
        # the same steps, close to each other, and not the fp32 arithmetic (bf16 keeps 8
        # significant bits of each matmul input: the losses move by ~1e-3, not by rounding)
        b = out[f"{kind}_bf16"]
        assert b["settings"]["precision"] == "bf16" and b["same_steps"]
        assert b["loss_max_abs_diff"] < 1e-2, (kind, b["ours"]["losses"], b["trl"]["losses"])
        dev = b["bf16_deviation"]
        assert 0 < dev["ours_loss_vs_fp32_max_abs_diff"] < 1e-2 and dev["within_tolerance"]
        assert 0 < dev["trl_loss_vs_fp32_max_abs_diff"] < 1e-2


@pytest.mark.slow                  # TRL's PPO trainer
def test_vs_trl_ppo_runs_trls_ppo_trainer_on_our_rollouts(tmp_path) -> None:
    """benchmarks/trl_ppo.py on a tiny random model: TRL 1.12's PPOTrainer (installed apart,
    in its own process) and our update, each in a fresh process, on the same 8 rollouts of a
    policy moved off the reference: both take the same number of steps and see the same
    rollouts (the KL to the reference of the stored rollouts and the mean score agree), and
    both times are real."""
    from benchmarks.trl_ppo import measure_vs_trl_ppo
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    save_tiny(TinyModelParams(), 0, tmp_path / "model")
    r = measure_vs_trl_ppo(tmp_path / "model", n_prompts=1, k=8, repeats=1,
                           log=lambda _: None)
    assert "skipped" not in r, r              # pip reaches the registry here, as in CI
    ours, trl = r["ours"], r["trl_side"]
    assert r["trl"] == "1.12.0" and ours["steps"] == trl["steps"] == 1
    assert abs(ours["kl_per_rollout"]) > 1e-4          # the policy sits off the reference
    assert r["kl_per_rollout_abs_diff"] < 1e-4 * max(1.0, abs(ours["kl_per_rollout"]))
    assert r["score_mean_abs_diff"] < 1e-6
    assert ours["fastest_s"] > 0 and trl["fastest_s"] > 0 and r["ratio"] > 0


def test_rollout_bench_times_three_sides_on_a_tiny_model(tmp_path) -> None:
    """benchmarks/rollout_bench.py on a tiny random model, two alternating passes: the sampler,
    `generate` and `generate` with a static cache all run on the same rows, every pass is
    timed and the worst pass's ratio is reported beside the fastest's; the sampler's stored
    log-probs match a full forward pass."""
    from benchmarks.rollout_bench import measure_rollout
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    save_tiny(TinyModelParams(), 0, tmp_path)
    out = measure_rollout(tmp_path, n_prompts=3, k=2, max_new_tokens=6, batch_size=6, repeats=2)
    assert out["repeats"] == 2
    for side in ("sampler_s_all", "generate_s_all", "static_s_all"):
        assert len(out[side]) == 2 and min(out[side]) > 0
    assert out["static_s"] == min(out["static_s_all"])
    assert out["rollout_speedup_worst_pass"] == min(out["speedup_per_pass"])
    assert out["rollout_speedup_vs_static_worst_pass"] == min(out["speedup_vs_static_per_pass"])
    assert out["generate_static_tok_s"] > 0
    assert out["logprob_max_abs_err"] < 1e-3


def test_dvc_parses_its_files_with_the_c_yaml_loader() -> None:
    """DVC reads dvc.yaml, dvc.lock and params.yaml with ruamel's `typ="safe"` loader at every
    stage check; ruamel.yaml >= 0.19 ships without its C extension, and without it that loader
    is pure Python (10x slower to parse; ~0.13 s of a cached tiny rerun, growing with the DAG).
    The dependency keeps it C."""
    from ruamel.yaml import YAML
    assert YAML(typ="safe").Parser.__name__ == "CParser", "pip install ruamel.yaml.clib"


@pytest.mark.slow                  # every update's MFU with the peaks measured around each
def test_train_mfu_trains_every_update_on_a_tiny_model(tmp_path) -> None:
    """benchmarks/train_bench.py (run.py's `train` section) at --quick sizes on a tiny model:
    each update takes steps and gets an MFU, the reward model too, although the default
    profile's train_rm fine-tunes for 0 epochs (its probe alone; the bench once timed that
    nothing and reported MFU 0)."""
    from benchmarks.train_bench import SIZES, measure_train_mfu
    from tasks.config.params import TinyModelParams
    from tasks.models.tiny_model import save_tiny
    save_tiny(TinyModelParams(), 0, tmp_path)
    out = measure_train_mfu(tmp_path, quick=True, kinds=["rm", "dpo"], log=lambda _: None)
    assert out["rm"]["fp32"]["steps"] == SIZES["quick"]["rm_epochs"] * 1      # 16 pairs of 32
    assert out["dpo"]["fp32"]["steps"] >= 1
    for kind in ("rm", "dpo"):
        assert out[kind]["fp32"]["seconds"] > 0 and out[kind]["mfu"] > 0, out[kind]


def test_rm_depth_reports_every_depth_and_picks_as_train_rm_would(tiny_run) -> None:
    """benchmarks/rm_depth.py on the shared tiny run's pool: a row per depth, and its CV pick is
    the depth `train_rm`'s own choice (`choose_depth`) takes on the same training pairs."""
    import subprocess

    import torch

    from tasks.config.params import load_params
    from tasks.core import jsonl, layout
    from tasks.data.records import parse_pair
    from tasks.models import lm
    from tasks.reward.probe import choose_depth
    from tasks.reward.reward_model import encode_pairs, heldout_split, init_reward_model
    ws = tiny_run["ws"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rm_depth", "--workspace", str(ws),
                           "--depths", "1-2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["depths"]) == {"1", "2"} and out["heldout_pairs"] > 0
    assert all(0.0 <= r["heldout_accuracy"] <= 1.0 for r in out["depths"].values())
    p = load_params(ws / layout.PARAMS_FILE)
    path = ws / layout.pairs_pool(2)
    pool = [parse_pair(r, str(path), n, "x") for n, r in jsonl.read(path)]
    train, _ = heldout_split(pool, p.train_rm.heldout_fraction)
    tok = lm.load_tokenizer(ws / layout.policy(0))
    enc = encode_pairs(tok, train, p.model.max_prompt_tokens, p.train_rm.max_length)
    from dataclasses import replace
    rp = replace(p.train_rm, num_layers_grid=(1, 2))
    _, chosen = choose_depth(init_reward_model(ws / layout.policy(0), torch.Generator()),
                             enc, rp, tok.pad_token_id)
    # the bench computes the features in other batches (train and held-out pairs together) in
    # another process and picks on losses rounded to 4 decimals: the same depth, unless the
    # two depths' losses tie to within that
    ours = int(chosen["num_layers"])
    loss = {int(d): r["cv_loss"] for d, r in out["depths"].items()}
    assert abs(loss[ours] - chosen["depth_cv_loss"]) <= 1e-4, (loss, chosen)
    assert out["cv_pick"] == ours or abs(loss[out["cv_pick"]] - loss[ours]) <= 1e-4, loss


def test_rm_freeze_times_every_setting_on_the_same_batches(tiny_run) -> None:
    """benchmarks/rm_freeze.py on the shared tiny run's pool: a row per setting with its
    forward, backward and AdamW seconds and its ratio to the first, stamped with commit, CPU
    and precision (no figure is asserted: timings live in the benchmark's output)."""
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rm_freeze", "--workspace",
                           str(tiny_run["ws"]), "--freeze", "0,e,1", "--steps", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["settings"]) == {"0", "e", "1"} and out["settings"]["0"]["ratio"] == 1.0
    assert out["commit"] and out["cpu"] and out["precision"] in ("fp32", "bf16")
    assert all(r["step"] > 0 and r["backward"] > 0 for r in out["settings"].values())
    assert "freeze_layers  1:" in proc.stdout and "embeddings only :" in proc.stdout


def test_rm_finetune_rebuilds_the_stage_model_and_splits_its_accuracy_by_pair_kind(
        tiny_run) -> None:
    """benchmarks/rm_finetune.py on the shared tiny run's pool at iteration 2: without an overlay
    it trains what `train_rm@2` trained (its held-out pairs, and its accuracy to within one pair:
    the same seeds and code, another process whose kernels may round a margin near 0 the other
    way), an overlay reaches the params (epochs 0: the probe alone), and the accuracies by pair
    kind add up to the whole."""
    import subprocess
    ws = tiny_run["ws"]
    stage = json.loads((ws / "metrics" / "iter_2" / "train_rm.json").read_text())
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rm_finetune", "--workspace", str(ws),
                           "{}", '{"epochs": 0}'], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [r["overlay"] for r in rows] == [{}, {"epochs": 0}]
    n = rows[0]["heldout_pairs"]
    assert n == stage["rm/n_heldout"] and rows[0]["train_pairs"] == stage["rm/n_train"]
    assert abs(rows[0]["heldout_accuracy"] - stage["rm/accuracy"]) <= 1 / n + 1e-4
    for r in rows:
        assert r["commit"] and r["cpu"] and r["precision"] in ("fp32", "bf16")
        kinds = r["by_kind"]
        assert set(kinds) <= {"topic", "register", "topic+register", "sentiment"}
        assert sum(k["pairs"] for k in kinds.values()) == n
        right = sum(k["accuracy"] * k["pairs"] for k in kinds.values())
        assert abs(right / n - r["heldout_accuracy"]) <= 1e-3
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rm_finetune", "--workspace", str(ws),
                           "{lr: 1}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(
        "settings: not JSON")


@pytest.mark.slow                  # every stage program started, timed
def test_stage_startup_times_each_stage_program_beside_the_references() -> None:
    """benchmarks/stage_startup.py: a median per reference and per stage started as DVC starts
    it (its module-level imports and exit, up to argument parsing), fresh and through a fork
    server, their sums, and the commit and CPU (no figure is asserted: timings live in the
    benchmark's output); an unknown stage is refused in one line."""
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "benchmarks.stage_startup", "--stages",
                           "gate,judge", "--repeat", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["seconds"]) == {"interpreter", "torch + transformers models", "gate", "judge"}
    assert abs(out["per_iteration"] - out["seconds"]["gate"] - out["seconds"]["judge"]) < 2e-3
    assert set(out["forked"]) == {"gate", "judge"}
    assert abs(out["per_iteration_forked"] - sum(out["forked"].values())) < 2e-3
    assert out["commit"] and out["cpu"] and all(v > 0 for v in out["seconds"].values())
    assert "tasks.stages.judge" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.stage_startup", "--stages", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == ["--stages: unknown ['nope']"]


def test_book_benchmark_counts_loop_minutes_and_checks_its_targets(tmp_path) -> None:
    from benchmarks import book
    seconds = {"prompts": 1.0, "reference_samples": 60.0, "rollout@1": 20.0, "update@1": 70.0,
               "evaluate@1": 80.0, "rollout@2": 22.0, "gate@2": 1.0, "report": 2.0}
    assert book.loop_seconds(seconds, (1,)) == 170.0            # the set-up left out
    assert book.loop_seconds(seconds, (1, 2)) == 193.0
    (tmp_path / "metrics" / "iter_1").mkdir(parents=True)
    (tmp_path / "metrics" / "iter_1" / "update.json").write_text(json.dumps({
        "update/offpolicy/book_iter_2/n": 48.0, "update/offpolicy/book_iter_2/ess_frac": 0.9,
        "update/offpolicy/book_iter_0/n": 32.0, "update/offpolicy/iter_0/n": 5.0,
        "update/offpolicy_ess": 70.0}))
    assert book.book_weights(tmp_path, 1) == {"book_iter_0": {"n": 32.0},
                                              "book_iter_2": {"n": 48.0, "ess_frac": 0.9}}
    a = {"gold": 0.85, "gold_lo": 0.80, "minutes": 10.0}
    met = book.targets(a, {"gold": 0.81, "gold_lo": 0.75, "minutes": 4.0},
                       {"gold": 0.85, "gold_lo": 0.8, "minutes": 9.9})
    assert [ok for _, ok in met] == [True] * 5
    missed = book.targets(a, {"gold": 0.79, "gold_lo": 0.70, "minutes": 4.1},
                          {"gold": 0.84, "gold_lo": 0.8, "minutes": 10.0})
    assert [ok for _, ok in missed] == [False] * 5
