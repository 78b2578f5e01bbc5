"""The report's plots as PNG bytes (tasks/evaluation/report.py lays them out on the page): win
rates, reward vs KL, RM accuracy, on-topic rate, length and fluency per iteration, with 95%
intervals where the stages measured them. matplotlib's object API only (no pyplot: no global figure
state in the flow), imported when a plot is drawn.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from tasks.evaluation.report_data import GOLD, JUDGE, Row, value

Series = tuple[str, str]          # (metric key, legend label)
# Honest axes: rates on [0, 1]; lengths and NLLs from 0, so run-to-run noise (fluency
# 5.965-5.985 nats) is drawn as the flat line it is, not zoomed into a trend.
RATE, FROM_ZERO = (0.0, 1.0), (0.0, None)
LIMITS = {"win_rates": RATE, "rm_accuracy": RATE, "on_topic": RATE, "reviews": RATE,
          "length": FROM_ZERO,
          "fluency": FROM_ZERO}
KL_LABEL = "KL(policy || reference), nats/response (k1: mean log-ratio of policy samples)"
PLOTS: tuple[tuple[str, str, str, tuple[Series, ...]], ...] = (
    ("win_rates", "Win rate vs the reference", "win rate (ties half)",
     ((JUDGE, "judge"), (GOLD, "gold"))),
    ("rm_accuracy", "Reward model accuracy", "accuracy",
     (("rm/accuracy", "held-out"), ("rm/train_accuracy", "train"))),
    ("on_topic", "On-topic rate", "rate",
     (("eval/on_topic_rate", "policy"), ("eval/ref_on_topic_rate", "reference"))),
    ("reviews", "Review rate (gold's register check: not a letter, reply or request)", "rate",
     (("eval/review_rate", "policy"), ("eval/ref_review_rate", "reference"))),
    ("length", "Response length", "tokens",
     (("eval/length", "policy"), ("eval/ref_length", "reference"))),
    ("fluency", "Fluency (reference model's NLL; lower is more fluent)", "nats/token",
     (("eval/fluency_nll", "policy"), ("eval/ref_fluency_nll", "reference"))),
)


def _axes(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global figure state in the flow
    fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _draw(ax: Any, xs: list[float], ys: list[float], lows: list[float | None],
          highs: list[float | None], **style: Any) -> None:
    """A line with 95% interval error bars when every point has both ends."""
    if all(v is not None for v in lows + highs):
        err = [[y - lo for y, lo in zip(ys, lows)], [hi - y for y, hi in zip(ys, highs)]]
        ax.errorbar(xs, ys, yerr=err, capsize=3, **style)
    else:
        ax.plot(xs, ys, **style)


def _at(row: Row, key: str) -> float | None:
    return float(row["iteration"]) if key == "iteration" else value(row, key)


def _points(rows: Sequence[Row], x: str, y: str) -> list[tuple[Any, Any, Any, Any, int]]:
    """(x, y, y's CI low, CI high, iteration) of the rows that have both x and y."""
    return [(_at(r, x), value(r, y), value(r, f"{y}_ci_low"), value(r, f"{y}_ci_high"),
             r["iteration"]) for r in rows if _at(r, x) is not None and value(r, y) is not None]


def series_plot(rows: Sequence[Row], title: str, ylabel: str, series: Sequence[Series],
                 suspects: Sequence[int], limits: tuple[float, float | None]) -> Any | None:
    fig, ax = _axes(title, "iteration", ylabel)
    drawn = False
    for key, label in series:
        pts = _points(rows, "iteration", key)
        if pts:
            xs, ys, lo, hi, _ = (list(c) for c in zip(*pts))
            _draw(ax, xs, ys, lo, hi, marker="o", label=label)
            drawn = True
    if not drawn:
        return None
    if any(k.endswith("win_rate") for k, _ in series):
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    for n, it in enumerate(suspects):
        ax.axvspan(it - 0.3, it + 0.3, color="red", alpha=0.15,
                   label="suspect: judge up, gold not" if n == 0 else None)
    ax.set_xticks([r["iteration"] for r in rows])
    top = limits[1] if limits[1] is not None else 1.1 * max(ax.get_ylim()[1], 1e-9)
    ax.set_ylim(limits[0], top)
    ax.legend(fontsize="small")
    return fig


def reward_vs_kl(rows: Sequence[Row]) -> Any | None:
    fig, ax = _axes("Reward vs KL to the reference", KL_LABEL, "win rate vs the reference")
    drawn = False
    for key, label in (("eval/rm_win_rate", "RM win rate"), (GOLD, "gold win rate")):
        pts = _points(rows, "eval/kl", key)
        if pts:
            xs, ys, lo, hi, its = (list(c) for c in zip(*pts))
            _draw(ax, xs, ys, lo, hi, marker="o", label=label)
            for x, y, it in zip(xs, ys, its):
                note = f"it {it}" + (" (KL < 0: estimate noise)" if x < 0 else "")
                ax.annotate(note, (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize="small")
            drawn = True
    for key, label in (("eval/bon_win_rate", "best-of-n, judge"),
                       ("eval/bon_gold_win_rate", "best-of-n, gold")):
        pts = _points(rows, "eval/bon_kl", key)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="*", ms=12, ls="none",
                    label=label)
    if not drawn:
        return None
    targets = [t for r in rows if (t := r.get("update/kl_target")) is not None and t == t]
    if targets:                       # the update's KL budget (tasks/policy/kl_budget.py)
        ax.axvline(max(targets), color="tab:red", lw=0.8, ls="--", label="KL budget (update)")
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.axvline(0.0, color="grey", lw=0.8, ls=":")     # a true KL is never below this
    ax.set_ylim(*RATE)
    ax.legend(fontsize="small")
    return fig


def render_plots(rows: Sequence[Row], suspects: Sequence[int]) -> dict[str, bytes]:
    """name -> PNG bytes, for each plot that has data."""
    figs = {name: series_plot(rows, title, ylabel, series,
                               suspects if name == "win_rates" else (), LIMITS[name])
            for name, title, ylabel, series in PLOTS}
    figs["reward_vs_kl"] = reward_vs_kl(rows)
    out = {}
    for name, fig in figs.items():
        if fig is not None:
            buf = io.BytesIO()
            fig.savefig(buf, format="png", metadata={"Software": None})
            out[name] = buf.getvalue()
    return out
