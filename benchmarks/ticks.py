"""Recurring iterations as a weekly schedule runs them: a fresh workspace (`alignloop run`, the
profile's iterations), then N `alignloop tick`s, each what a cron fire runs; one table row per
iteration and the targets for recurring iterations checked.

    python -m benchmarks.ticks --workspace DIR [--profile default] [--seed S] [--ticks 6]
                               [--params FILE]   # an overlay (e.g. fp32) instead of --profile

An existing workspace is continued (ticks are appended until it holds the profile's iterations
plus N). Rows: iteration, prev (what it started from), judge and gold win rates against the
reference (gold on the held-out prompts, with its 95% interval), gold and judge against the
champion on the select prompts, KL (and the update's KL target and kept KL), review rate (the
reference's), RM held-out accuracy (n), train_rm seconds, the iteration's minutes, the gate, the
champion after it. Every row carries commit, CPU model, precision and seed; the rows are also
appended as JSON to benchmarks/results/ticks.jsonl.

Targets (recurring iterations; the champion is the latest iteration whose gate passed):
- the champion's gold never decreases beyond its interval (each new champion's gold >= the
  previous champion's CI low);
- the final champion's gold >= 0.88 with CI low > 0.83, its judge >= 0.90, its review rate >=
  the reference's - 0.05; every promoted iteration's KL <= gate.max_kl; the over-optimisation
  monitor silent on every promoted iteration;
- train_rm seconds at the last iteration <= 1.5x iteration 2's; the last iteration's minutes
  <= 1.3x iteration 3's.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "ticks.jsonl"


def cpu() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    m = re.search(r"Model name:\s*(.+)", text)
    isa = ("AMX-BF16" if "amx_bf16" in text else "AVX512-BF16" if "avx512_bf16" in text
           else "AVX2")
    return f"{m[1].strip() if m else platform.processor()} ({isa})"


def cli(*args: str) -> tuple[str, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"alignloop {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout, time.monotonic() - t0


def stage_seconds(stdout: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^\[ran\] (\S+) \(([\d.]+) s\)", stdout,
                                                   re.M)}


def load(ws: Path, rel: str) -> dict[str, Any]:
    path = ws / rel
    return json.loads(path.read_text()) if path.is_file() else {}


def rows(ws: Path, seconds: dict[str, float]) -> list[dict[str, Any]]:
    import yaml
    params = yaml.safe_load((ws / "params.yaml").read_text())
    its = sorted(int(k) for k in params["iterations"])
    out, champion = [], None
    for k in its:
        e = load(ws, f"metrics/iter_{k}/evaluate.json")
        r = load(ws, f"metrics/iter_{k}/train_rm.json")
        u = load(ws, f"metrics/iter_{k}/update.json")
        g = load(ws, f"metrics/iter_{k}/gate_decision.json")
        minutes = sum(v for n, v in seconds.items() if n.endswith(f"@{k}")) / 60
        if g.get("passed"):
            champion = k
        out.append({"iteration": k, "prev": params["iterations"][str(k)]["prev"],
                    "judge": e.get("eval/win_rate"), "gold": e.get("eval/gold_win_rate"),
                    "gold_lo": e.get("eval/gold_win_rate_ci_low"),
                    "gold_hi": e.get("eval/gold_win_rate_ci_high"),
                    "vs_champion_gold": e.get("eval/champion_gold_win_rate"),
                    "vs_champion_judge": e.get("eval/champion_judge_win_rate"),
                    "kl": e.get("eval/kl"), "kl_target": u.get("update/kl_target"),
                    "kl_kept": u.get("update/kl_kept"),
                    "review": e.get("eval/review_rate"),
                    "ref_review": e.get("eval/ref_review_rate"),
                    "rm_acc": r.get("rm/accuracy"), "rm_n": r.get("rm/n_heldout"),
                    "rm_pool": r.get("rm/n_pool"),
                    "train_rm_s": seconds.get(f"train_rm@{k}"), "minutes": minutes or None,
                    "over_optimisation": e.get("eval/flag_over_optimisation"),
                    "gate": "passed" if g.get("passed") else "; ".join(g.get("reasons", [])),
                    "champion": champion})
    return out


def fmt(v: Any, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(rs: list[dict[str, Any]], head: dict[str, str]) -> str:
    cols = ("iteration", "prev", "judge", "gold [95% CI]", "vs champion gold / judge",
            "KL (target, kept)", "review (ref)", "RM held-out (n, pool)", "train_rm s", "minutes",
            "gate", "champion")
    lines = [f"{head['commit']} · {head['cpu']} · {head['precision']} · seed {head['seed']}",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rs:
        lines.append("| " + " | ".join([
            str(r["iteration"]), str(r["prev"]), fmt(r["judge"]),
            f"{fmt(r['gold'])} [{fmt(r['gold_lo'], 2)}, {fmt(r['gold_hi'], 2)}]",
            f"{fmt(r['vs_champion_gold'])} / {fmt(r['vs_champion_judge'])}",
            f"{fmt(r['kl'], 1)} ({fmt(r['kl_target'], 1)}, {fmt(r['kl_kept'], 1)})",
            f"{fmt(r['review'], 2)} ({fmt(r['ref_review'], 2)})",
            f"{fmt(r['rm_acc'])} ({fmt(r['rm_n'], 0)}, {fmt(r['rm_pool'], 0)})",
            fmt(r["train_rm_s"], 0), fmt(r["minutes"], 2), r["gate"][:60],
            fmt(r["champion"])]) + " |")
    return "\n".join(lines)


def targets(rs: list[dict[str, Any]], max_kl: float) -> list[tuple[str, bool]]:
    promoted = [r for r in rs if r["gate"] == "passed"]
    out: list[tuple[str, bool]] = []
    monotone = all(b["gold"] >= a["gold_lo"] for a, b in zip(promoted, promoted[1:]))
    out.append(("champion's gold never decreases beyond its interval", monotone))
    final = promoted[-1] if promoted else None
    out.append(("final champion gold >= 0.88, CI low > 0.83",
                bool(final and final["gold"] >= 0.88 and final["gold_lo"] > 0.83)))
    out.append(("final champion judge >= 0.90", bool(final and final["judge"] >= 0.90)))
    out.append(("final champion review rate >= reference - 0.05",
                bool(final and final["review"] >= final["ref_review"] - 0.05)))
    out.append((f"every promoted KL <= {max_kl}", all(r["kl"] <= max_kl for r in promoted)))
    out.append(("over-optimisation monitor silent on promoted iterations",
                all(not r["over_optimisation"] for r in promoted)))
    by = {r["iteration"]: r for r in rs}
    last = rs[-1]
    if 2 in by and by[2]["train_rm_s"] and last["train_rm_s"]:
        out.append((f"train_rm s at {last['iteration']} <= 1.5x iteration 2's",
                    last["train_rm_s"] <= 1.5 * by[2]["train_rm_s"]))
    if 3 in by and by[3]["minutes"] and last["minutes"]:
        out.append((f"minutes at {last['iteration']} <= 1.3x iteration 3's",
                    last["minutes"] <= 1.3 * by[3]["minutes"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--profile", default="default")
    ap.add_argument("--params", help="a profile file instead of --profile")
    ap.add_argument("--ticks", type=int, default=6)
    ap.add_argument("--precision", default="as the profile", help="a label for the rows")
    args = ap.parse_args()
    ws = Path(args.workspace).resolve()
    log = ws.parent / f"{ws.name}.ticks-log.json"
    seconds: dict[str, float] = json.loads(log.read_text()) if log.is_file() else {}
    if not (ws / "params.yaml").is_file():
        src = ["--params", args.params] if args.params else ["--profile", args.profile]
        out, _ = cli("run", *src, "--workspace", str(ws))
        seconds.update(stage_seconds(out))
        log.write_text(json.dumps(seconds))
    import yaml
    start = len(yaml.safe_load((ws / "params.yaml").read_text())["iterations"])
    base = 2 if start >= 2 else start
    for _ in range(max(0, base + args.ticks - start)):
        out, wall = cli("tick", "--workspace", str(ws))
        seconds.update(stage_seconds(out))
        log.write_text(json.dumps(seconds))
        print(out.splitlines()[-1], f"({wall:.0f} s)", flush=True)
    p = yaml.safe_load((ws / "params.yaml").read_text())
    head = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip(),
            "cpu": cpu(), "precision": args.precision, "seed": str(p.get("seed", 0))}
    rs = rows(ws, seconds)
    print(table(rs, head))
    checks = targets(rs, float(p.get("gate", {}).get("max_kl", 1e9)))
    for name, ok in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        for r in rs:
            f.write(json.dumps({**head, **r}) + "\n")


if __name__ == "__main__":
    main()
