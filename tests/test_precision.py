"""`precision: auto | fp32 | bf16`: auto runs bf16 only where the CPU has bf16 matmuls in
hardware (x86: AVX512-BF16 or AMX). Without them torch's reference bf16 kernels are tens of times
slower than fp32 (an AVX2 EPYC: 1.2 vs 92 GFLOP/s), which made the default profile's RM and DPO
stages ~10x slower there before auto existed."""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config.params import ParamsError, load_params
from tasks.models import lm

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, native: bool,
                              expected: str) -> None:
    monkeypatch.setattr(lm, "native_bf16", lambda *a: native)
    assert lm.effective_precision("auto") == expected
    assert lm.effective_precision("fp32") == "fp32"
    assert lm.effective_precision("bf16") == "bf16"       # asked for: kept


def test_this_cpus_answer_is_its_flags() -> None:
    """native_bf16 on this machine agrees with the kernel's CPU flags (not with oneDNN's own
    bf16 check, which also says yes on AVX512 CPUs that have no bf16 instructions)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or lm.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the flags read here are x86 Linux's")
    flags = set(cpuinfo.read_text().split())
    lm.native_bf16.cache_clear()
    assert lm.native_bf16("cpu") == bool({"avx512_bf16", "amx_bf16"} & flags)


@pytest.mark.parametrize("bf16, amx, expected", [(False, False, False), (True, False, True),
                                                  (False, True, True)])
def test_avx512_without_bf16_instructions_is_not_native(monkeypatch: pytest.MonkeyPatch,
                                                        bf16: bool, amx: bool,
                                                        expected: bool) -> None:
    """An x86 CPU whose oneDNN accepts bf16 (any AVX512 core) counts only with AVX512-BF16 or
    AMX: a Skylake or Cascade Lake emulates bf16 and runs it slower than fp32."""
    import torch
    monkeypatch.setattr(lm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    lm.native_bf16.cache_clear()
    try:
        assert lm.native_bf16("cpu") is expected
    finally:
        lm.native_bf16.cache_clear()


def test_bf16_without_native_kernels_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(lm, "native_bf16", lambda *a: False)
    monkeypatch.setattr(lm, "_warned_bf16", False)
    for _ in range(3):
        assert lm.effective_precision("bf16") == "bf16"
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("warning: precision bf16")
    assert "auto" in lines[0]


def test_default_profiles_pick_auto(tmp_path: Path) -> None:
    for name in ("default", "default-ppo", "default-http-judge"):
        p = load_params(REPO / "params" / f"{name}.yaml")
        assert (p.train_rm.precision, p.update.dpo.precision) == ("auto", "auto"), name
    bad = tmp_path / "p.yaml"
    text = (REPO / "params" / "tiny.yaml").read_text()
    bad.write_text(text.replace("    precision: fp32\n", "    precision: fp16\n", 1))
    with pytest.raises(ParamsError, match=r"p\.yaml:\d+.*precision"):
        load_params(bad)
