"""The device path (`device: auto | cpu | cuda`): the params key, its resolution, and a static
guard that every torch tensor factory in tasks/ says where its tensor lives.

No GPU here: the CUDA path is checked by reading (this guard) and by the error a CUDA-less
machine gives; CPU results staying the same is checked by the tiny-run tests."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_cli
from tasks.config.params import ParamsError, load_params, parse_params
from tasks.runtime.device import DeviceError, resolve_device

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "params" / "tiny.yaml"
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "linspace",
             "eye", "rand", "randn", "randint", "randperm"}
CPU_MARK = re.compile(r"#\s*cpu:\s*\S")       # an allowed CPU-only tensor, with its reason
NO_CUDA = not torch.cuda.is_available()


def with_device(value: str) -> str:
    return re.sub(r"(?m)^device: \w+", f"device: {value}", TINY.read_text())


def test_every_profile_states_its_device_with_a_comment() -> None:
    from tasks.config.profiles import read_profile
    for profile in sorted((ROOT / "params").glob("*.yaml")):
        file, at = read_profile(profile).lines.get(("device",), (str(profile), 0))  # or its base
        line = Path(file).read_text().splitlines()[at - 1] if at else None
        assert line is not None and line.startswith("device:") and "#" in line, \
            f"{profile.name}: no commented device key"
        assert load_params(profile).device == "auto", profile.name


def test_auto_and_cpu_resolve_to_the_cpu_here() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == torch.device(want)
    assert resolve_device("cpu") == torch.device("cpu")


def test_an_invalid_device_is_refused_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(with_device("tpu"))
    line = next(i for i, x in enumerate(path.read_text().splitlines(), 1)
                if x.startswith("device:"))
    with pytest.raises(ParamsError, match=rf"^{re.escape(str(path))}:{line}: device: expected "
                                          r"one of \['auto', 'cpu', 'cuda'\], got 'tpu'$"):
        load_params(path)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_naming_file_and_key(tmp_path: Path) -> None:
    text = with_device("cuda")
    line = next(i for i, x in enumerate(text.splitlines(), 1) if x.startswith("device:"))
    with pytest.raises(ParamsError, match=rf"^x\.yaml:{line}: device: cuda requested, but "
                                          r"torch sees no CUDA device"):
        parse_params(text, "x.yaml")
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cli_refuses_cuda_without_cuda_before_touching_the_workspace(tmp_path: Path) -> None:
    profile = tmp_path / "gpu.yaml"
    profile.write_text(with_device("cuda"))
    ws = tmp_path / "ws"
    proc = run_cli("run", "--params", str(profile), "--workspace", str(ws), check=False,
                   timeout=120)
    assert proc.returncode != 0
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{profile}:" in err[0] and "device: cuda requested" in err[0], err[0]
    assert not ws.exists()


# --- the static guard -------------------------------------------------------------------------

def device_less_factories(source: str) -> list[int]:
    """Lines of torch.<factory>(...) calls with no device= keyword and no `# cpu: reason`
    comment on any of their lines."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        span = lines[node.lineno - 1: (node.end_lineno or node.lineno)]
        if not any(CPU_MARK.search(x) for x in span):
            out.append(node.lineno)
    return out


def test_guard_sees_a_device_less_factory() -> None:
    assert device_less_factories("import torch\nx = torch.zeros(3)\n") == [2]
    assert device_less_factories("import torch\nx = torch.zeros(3, device=d)\n") == []
    assert device_less_factories("import torch\nx = torch.arange(3)  # cpu: indices\n") == []
    assert device_less_factories("import torch\nx = torch.arange(3)  # cpu:\n") == [2]
    assert device_less_factories("import torch\nx = torch.tensor(\n  [1])\n") == [2]


@pytest.mark.parametrize("module", sorted(p.name for p in (ROOT / "tasks").glob("*.py")))
def test_every_tensor_factory_names_its_device(module: str) -> None:
    """torch.zeros/ones/full/empty/arange/tensor/... in tasks/ take device= (an input's device
    or the stage's); a genuinely CPU-only tensor (host-side metrics, indices drawn by the CPU
    generator, rows filled on the host before one copy) says so with `# cpu: reason`."""
    bad = device_less_factories((ROOT / "tasks" / module).read_text())
    assert not bad, f"tasks/{module}: torch tensor factories without device= at lines {bad}"


def test_torch_stages_declare_device_in_dvc_yaml() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    declaring = {n for n, s in stages.items() if "device" in s.get("do", s).get("params", [])}
    assert declaring == {"collect_offpolicy", "reference_samples", "rollout", "judge",
                         "train_rm", "update", "evaluate"}
