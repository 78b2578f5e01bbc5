"""What an iteration's policy update costs with a LoRA adapter against a full fine-tune, side by
side in one run on the same inputs: bytes written, the update's peak RSS and seconds.

    python -m benchmarks.lora_cost --workspace W [--it 1] [--repeats 1] [--json OUT]

W is a default-profile workspace that has run iteration `it`'s judge (its pairs, the previous
pool, iteration 0's model). Each side is the real stage, `python -m tasks.stages.update --it
IT`, in a fresh process, in a scratch root of its own holding links to W's inputs and the
profile's params.yaml: default.yaml (every weight trains) or default-lora.yaml (a rank-16
adapter). The sides alternate (full, lora, full, ...). Measured per side: seconds, the child's
peak RSS (`wait4`), the policy directory's bytes, the bytes of its weight files against the
base's, and the update's steps and KL figures from its metrics. Every row names the commit,
the CPU model, the precision the update ran in and the seed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import log
from benchmarks.isolation import REPO

SIDES = {"full": "default.yaml", "lora": "default-lora.yaml"}


def cpu_model() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("Model name")), "unknown")


def scratch(ws: Path, profile: str, it: int, into: Path) -> Path:
    """A root for one update@it: W's data and iteration 0's model linked, the profile's merged
    params.yaml and the dvc.yaml rendered for it (the stage checks its conditional inputs)."""
    from tasks.config import conditions
    from tasks.config.params import load_params
    from tasks.config.profiles import read_profile
    from tasks.core import layout
    (into / "models" / "iter_0").mkdir(parents=True)
    (into / "data").symlink_to(ws / "data")
    (into / "audit").symlink_to(ws / "audit")
    (into / layout.policy(0)).symlink_to(ws / layout.policy(0))
    if it > 1:
        (into / layout.policy(it - 1)).parent.mkdir(parents=True)
        (into / layout.policy(it - 1)).symlink_to(ws / layout.policy(it - 1))
    data = read_profile(REPO / "params" / profile).data
    data.pop("base", None)
    (into / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (into / "dvc.yaml").write_text(conditions.render((REPO / "dvc.yaml").read_text(),
                                                     load_params(into / "params.yaml")))
    return into


def _bytes(d: Path, pattern: str = "**/*") -> int:
    return sum(f.stat().st_size for f in d.glob(pattern) if f.is_file())


def run_side(ws: Path, side: str, it: int) -> dict[str, Any]:
    """update@it for one side in a fresh process; its seconds, peak RSS and what it wrote."""
    from tasks.core import layout
    with tempfile.TemporaryDirectory(prefix=f"lora-cost-{side}-") as tmp:
        root = scratch(ws, SIDES[side], it, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tasks.stages.update", "--it", str(it),
                                 "--root", str(root)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"update@{it} ({side}) exited {proc.returncode}:\n{out[-3000:]}")
        policy, base = root / layout.policy(it), ws / layout.policy(0)
        metrics = json.loads((root / layout.metrics(it, "update")).read_text())
        weights = _bytes(policy, "*.safetensors")
        return {"seconds": round(seconds, 1), "peak_rss_mb": usage.ru_maxrss // 1024,
                "policy_dir_bytes": _bytes(policy), "weights_bytes": weights,
                "weights_to_base": round(weights / _bytes(base, "*.safetensors"), 4),
                "steps": metrics.get("update/steps"), "bf16": metrics.get("update/bf16"),
                "kl_last": metrics.get("update/kl_last"),
                "kl_stopped": metrics.get("update/kl_stopped")}


def measure(ws: Path, it: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for i in range(repeats):
        for side in SIDES:
            runs[side].append(run_side(ws, side, it))
            log(f"lora_cost pass {i + 1}/{repeats} {side}: {runs[side][-1]}")
    best = {s: min(r, key=lambda x: x["seconds"]) | {"peak_rss_mb": max(x["peak_rss_mb"]
                                                                        for x in r)}
            for s, r in runs.items()}
    full, lora = best["full"], best["lora"]
    seed = yaml.safe_load((ws / "params.yaml").read_text()).get("seed")
    return {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip(),
            "cpu": cpu_model(), "precision": "bf16" if full["bf16"] else "fp32",
            "seed": seed, "iteration": it, "workspace": str(ws), "runs": runs,
            "full": full, "lora": lora,
            "rss_ratio": round(lora["peak_rss_mb"] / full["peak_rss_mb"], 3),
            "seconds_ratio": round(lora["seconds"] / full["seconds"], 3),
            "bytes_ratio": round(lora["policy_dir_bytes"] / full["policy_dir_bytes"], 4)}


def table(r: dict[str, Any]) -> str:
    rows = [f"{r['commit']} · {r['cpu']} · {r['precision']} · seed {r['seed']} · "
            f"update@{r['iteration']}",
            "| side | seconds | peak RSS MB | policy dir bytes | weights / base | steps |",
            "|---|---|---|---|---|---|"]
    for side in SIDES:
        s = r[side]
        rows.append(f"| {side} | {s['seconds']} | {s['peak_rss_mb']} | {s['policy_dir_bytes']:,}"
                    f" | {s['weights_to_base']:.4f} | {s['steps']} |")
    rows.append(f"lora / full: peak RSS {r['rss_ratio']}, seconds {r['seconds_ratio']}, "
                f"bytes {r['bytes_ratio']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--workspace", required=True, help="a default workspace past judge@IT")
    ap.add_argument("--it", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs per side")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args(argv)
    ws = Path(a.workspace).resolve()
    if not (ws / "data" / f"iter_{a.it}" / "pairs.jsonl").is_file():
        print(f"error: {ws}: no data/iter_{a.it}/pairs.jsonl (run the default profile's "
              f"judge@{a.it} there first)", file=sys.stderr)
        return 2
    result = measure(ws, a.it, a.repeats)
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
