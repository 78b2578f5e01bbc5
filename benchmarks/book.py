"""The mistake book: re-aligning the initial model from another workspace's accumulated pairs
against the online loop from scratch, side by side on one machine in one run.

    python -m benchmarks.book [--seed S] [--workdir DIR] [--precision LABEL]

(a) `default` from scratch (its two online iterations); (b) `default-book` on (a)'s book, its
offline iteration 1 alone (`alignloop import --from-workspace A`, DPO on the book, no rollouts);
(c) the same workspace after its online iteration 2 on top. Each row: gold and judge win rates
against the reference on the 200 held-out prompts (gold with its 95% interval), KL, and the
loop minutes: the seconds of every iteration stage (rollout, judge, train_rm, update, evaluate,
gate) as `alignloop run` prints them, plus (b)'s and (c)'s import; the set-up both share (the
model, prompts, reference samples) is left out. Then, per source iteration of the book, the
pairs the offline update reused, their ESS / n, truncated share and mean weight.

Targets: (b) gold >= 0.80 with CI low > 0.70 in <= 40% of (a)'s loop minutes; (c) gold at least
(a)'s in fewer minutes than (a). Rows carry commit, CPU model, precision and seed, and are
appended to benchmarks/results/book.jsonl. Run it alone on the machine: minutes are compared.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cache_dir
from benchmarks.ticks import REPO, cli, cpu, fmt, load, stage_seconds

RESULTS = REPO / "benchmarks" / "results" / "book.jsonl"
LOOP = ("rollout", "judge", "train_rm", "update", "evaluate", "gate")
BOOK_METRIC = re.compile(r"^update/offpolicy/(book_iter_\d+)/(n|ess_frac|truncated_frac|"
                         r"weight_mean)$")


def loop_seconds(seconds: dict[str, float], its: tuple[int, ...]) -> float:
    return sum(v for name, v in seconds.items()
               if "@" in name and name.split("@")[0] in LOOP and int(name.split("@")[1]) in its)


def row(name: str, ws: Path, it: int, minutes: float) -> dict[str, Any]:
    e = load(ws, f"metrics/iter_{it}/evaluate.json")
    return {"case": name, "iteration": it, "gold": e.get("eval/gold_win_rate"),
            "gold_lo": e.get("eval/gold_win_rate_ci_low"),
            "gold_hi": e.get("eval/gold_win_rate_ci_high"), "judge": e.get("eval/win_rate"),
            "kl": e.get("eval/kl"), "minutes": minutes}


def book_weights(ws: Path, it: int) -> dict[str, dict[str, float]]:
    """update@it's reuse metrics per source iteration of the book."""
    out: dict[str, dict[str, float]] = {}
    for key, v in load(ws, f"metrics/iter_{it}/update.json").items():
        m = BOOK_METRIC.match(key)
        if m:
            out.setdefault(m[1], {})[m[2]] = v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1])))


def targets(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> list[tuple[str, bool]]:
    return [
        (f"(b) gold {fmt(b['gold'])} >= 0.80", (b["gold"] or 0) >= 0.80),
        (f"(b) gold CI low {fmt(b['gold_lo'], 2)} > 0.70", (b["gold_lo"] or 0) > 0.70),
        (f"(b) {b['minutes']:.2f} min <= 40% of (a)'s {a['minutes']:.2f} "
         f"({0.4 * a['minutes']:.2f})", b["minutes"] <= 0.4 * a["minutes"]),
        (f"(c) gold {fmt(c['gold'])} >= (a)'s {fmt(a['gold'])}", (c["gold"] or 0) >= (a["gold"]
                                                                                     or 1)),
        (f"(c) {c['minutes']:.2f} min < (a)'s {a['minutes']:.2f}", c["minutes"] < a["minutes"]),
    ]


def overlay(path: Path, profile: str, seed: int, extra: str) -> Path:
    path.write_text(f"base: {REPO / 'params' / profile}.yaml\nseed: {seed}\n{extra}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where the two workspaces go (default: "
                                      "benchmarks/.cache/book, ignored by git)")
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32"),
                    help="fp32: train_rm and the update in fp32 (a CPU without bf16)")
    args = ap.parse_args()
    work = Path(args.workdir).resolve() if args.workdir else cache_dir() / "book"
    work.mkdir(parents=True, exist_ok=True)
    extra = ("train_rm:\n  precision: fp32\nupdate:\n  dpo:\n    precision: fp32\n"
             if args.precision == "fp32" else "")
    wa, wb = work / f"a-s{args.seed}-{args.precision}", work / f"book-s{args.seed}-{args.precision}"
    for ws in (wa, wb):
        if ws.exists():
            raise SystemExit(f"{ws}: exists; remove it or pass another --workdir")
    print(f"(a) the default from scratch in {wa}", flush=True)
    out, _ = cli("run", "--params", str(overlay(work / f"a-s{args.seed}.yaml", "default",
                                                   args.seed, extra)), "--workspace", str(wa))
    sa = stage_seconds(out)
    print(f"(b, c) default-book on (a)'s book in {wb}", flush=True)
    cli("init", str(wb), "--params", str(overlay(work / f"book-s{args.seed}.yaml",
                                                   "default-book", args.seed, extra)))
    t0 = time.monotonic()                       # its model named first: the tokens are kept
    cli("import", "--from-workspace", str(wa), "--workspace", str(wb))
    imported = time.monotonic() - t0
    out, _ = cli("run", "--workspace", str(wb))
    sb = stage_seconds(out)
    a = row("(a) online, from scratch", wa, 2, loop_seconds(sa, (1, 2)) / 60)
    b = row("(b) the book alone", wb, 1, (imported + loop_seconds(sb, (1,))) / 60)
    c = row("(c) the book + one online iteration", wb, 2,
            (imported + loop_seconds(sb, (1, 2))) / 60)
    head = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip(),
            "cpu": cpu(), "precision": args.precision, "seed": args.seed}
    print(f"{head['commit']} · {head['cpu']} · {head['precision']} · seed {head['seed']}")
    print("| case | gold [95% CI] | judge | KL | loop minutes |\n|---|---|---|---|---|")
    for r in (a, b, c):
        print(f"| {r['case']} | {fmt(r['gold'])} [{fmt(r['gold_lo'], 2)}, "
              f"{fmt(r['gold_hi'], 2)}] | {fmt(r['judge'])} | {fmt(r['kl'], 1)} | "
              f"{r['minutes']:.2f} |")
    weights = {f"update@{it}": book_weights(wb, it) for it in (1, 2)}
    print("| update | source iteration | pairs | ESS / n | truncated | mean weight |\n"
          "|---|---|---|---|---|---|")
    for upd, per in weights.items():
        for src, m in per.items():
            print(f"| {upd} | {src} | {m.get('n', 0):.0f} | {fmt(m.get('ess_frac'))} | "
                  f"{fmt(m.get('truncated_frac'))} | {fmt(m.get('weight_mean'))} |")
    for name, ok in targets(a, b, c):
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        for r in (a, b, c):
            f.write(json.dumps({**head, **r}) + "\n")
        f.write(json.dumps({**head, "case": "book weights", **weights}) + "\n")


if __name__ == "__main__":
    main()
