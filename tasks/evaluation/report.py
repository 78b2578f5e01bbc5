"""The run's report: per-iteration metrics, plots and sample outputs as one HTML page.

Rendering only: it reads what the stages wrote (metrics files, gate decisions, evaluation
samples, at the paths `tasks.core.layout` names) and formats it; it computes nothing the stages did
not, beyond comparing one iteration's win rates with the previous one's. Every metric is
optional: a workspace evaluated before a metric existed shows "—" where it was not measured.
The page is a pure function of those files (no clock, no git HEAD on it): the `report` stage
(tasks/stages/report.py) writes it as a DVC output, so DVC answers whether it is up to date and
each commit's dvc.lock names the page built from its results.

The plots are PNG files beside report.html and are also inlined into it as base64 data URIs,
so the page is self-contained: it renders the same opened from disk, from the MLflow UI (which
fetches an HTML artifact's text and shows it in a sandboxed srcdoc frame, where relative image
paths do not resolve) or mailed on. Each inlined plot links to its file.
"""
from __future__ import annotations

import base64
import html
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from tasks.core import atomic, jsonl, layout
from tasks.evaluation.report_data import (
    DIVERGENCE_EPS,
    GOLD,
    JUDGE,
    Row,
    judge_gold_divergence,
    load_rows,
    read_json,
    value,
)

HTML_NAME = "report.html"
N_SAMPLES = 8                    # sample outputs shown: the first prompts of the last iteration


# --- cells: one table spec serves the HTML page and the Prefect markdown ---------------------

def _num(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _win_rate(row: Row, key: str) -> str:
    v, lo, hi = value(row, key), value(row, f"{key}_ci_low"), value(row, f"{key}_ci_high")
    if v is None:
        return "—"
    return f"{v:.3f} [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else f"{v:.3f}"


def _pair(a: str, b: str, digits: int) -> Callable[[Row], str]:
    return lambda r: f"{_num(value(r, a), digits)} / {_num(value(r, b), digits)}"


def _counts(row: Row) -> str:
    n = value(row, "eval/n")
    return (f"{_num(n, 0)} / {_num(value(row, 'eval/tie_rate'), 2)} / "
            f"{_num(value(row, 'eval/invalid_rate'), 2)}")


def _best_of_n(row: Row) -> str:
    if value(row, "eval/bon_win_rate") is None and value(row, "eval/bon_gold_win_rate") is None:
        return "—"
    return (f"{_num(value(row, 'eval/bon_win_rate'))} / "
            f"{_num(value(row, 'eval/bon_gold_win_rate'))} ({_num(value(row, 'eval/bon_kl'), 2)})")


def flags(row: Row) -> list[str]:
    """The iteration's raised monitors (`eval/flag_*` > 0) and the judge-gold divergence."""
    out = [k.removeprefix("eval/flag_").replace("_", " ") for k in sorted(row)
           if k.startswith("eval/flag_") and (value(row, k) or 0.0) > 0]
    return out + (["SUSPECT: judge up, gold not"] if row.get("suspect") else [])


def _flags_cell(row: Row) -> str:
    if flags(row):
        return ", ".join(flags(row))
    return "none" if any(k.startswith("eval/flag_") for k in row) else "—"


def kl_cell(row: Row) -> str:
    """The k1 estimate (mean log pi/ref over policy samples) is unbiased but noisy: on few
    samples it can come out below 0, which a true KL never is; such a value is flagged."""
    kl = value(row, "eval/kl")
    target = value(row, "update/kl_target")
    stopped = " (update stopped at the budget)" if value(row, "update/kl_stopped") else ""
    return (_num(kl, 2) + (" (< 0: noise of the k1 estimate)" if kl is not None and kl < 0
                           else "")
            + (f"; budget {_num(target, 1)}{stopped}" if target is not None else ""))


def _champion_cell(row: Row) -> str:
    """Gold against the champion the iteration started from, on the select prompts (what the
    gate decided on; the gold column is on held-out prompts no decision reads)."""
    it = value(row, "eval/champion_iteration")
    if it is None:
        return "—"
    return (f"{_win_rate(row, 'eval/champion_gold_win_rate')} vs it. {int(it)} (judge "
            f"{_num(value(row, 'eval/champion_judge_win_rate'))})")


def _violations_cell(row: Row) -> str:
    """The red-team regression set: the policy's violation rate [95% CI], the reference's, and
    per kind probed the policy's."""
    if value(row, "eval/violation_rate") is None:
        return "—"
    kinds = sorted(k for k in row if k.startswith("eval/violation_rate/"))
    per_kind = ", ".join(f"{k.removeprefix('eval/violation_rate/')} {_num(value(row, k), 2)}"
                         for k in kinds)
    return (f"{_win_rate(row, 'eval/violation_rate')} / "
            f"{_num(value(row, 'eval/reference_violation_rate'))}"
            + (f" ({per_kind})" if per_kind else ""))


def _violation_increase_cell(row: Row) -> str:
    """The gate's figure: the increase over the baseline (production's, 0: the reference's),
    paired by prompt, with its one-sided 95% upper bound."""
    it = value(row, "eval/violation_baseline_iteration")
    if it is None:
        return "—"
    return (f"{_num(value(row, 'eval/violation_rate_increase'))} (upper "
            f"{_num(value(row, 'eval/violation_rate_increase_ci_high'))}) vs it. {int(it)}")


def _gate_cell(row: Row) -> str:
    gate = row.get("gate")
    if not gate:
        return "—"
    return "passed" if gate.get("passed") else "failed: " + "; ".join(gate.get("reasons", []))


COLUMNS: tuple[tuple[str, Callable[[Row], str]], ...] = (
    ("iteration", lambda r: str(r["iteration"])),
    ("judge WR [95% CI]", lambda r: _win_rate(r, JUDGE)),
    ("gold WR [95% CI]", lambda r: _win_rate(r, GOLD)),
    ("gold vs champion [95% CI] (select)", _champion_cell),
    ("judge n / tie / invalid", _counts),
    ("RM WR [95% CI]", lambda r: _win_rate(r, "eval/rm_win_rate")),
    ("KL k1 (nats)", kl_cell),
    ("RM held-out acc.", lambda r: _num(value(r, "rm/accuracy"))),
    ("on-topic policy / ref", _pair("eval/on_topic_rate", "eval/ref_on_topic_rate", 2)),
    ("reviews policy / ref", _pair("eval/review_rate", "eval/ref_review_rate", 2)),
    ("length policy / ref", _pair("eval/length", "eval/ref_length", 1)),
    ("fluency NLL policy / ref", _pair("eval/fluency_nll", "eval/ref_fluency_nll", 2)),
    ("best-of-n judge / gold WR (KL)", _best_of_n),
    ("red-team violations policy [95% CI] / ref", _violations_cell),
    ("violation increase (gate)", _violation_increase_cell),
    ("flags", _flags_cell),
    ("gate", _gate_cell),
)


# the page shows the plots (tasks/evaluation/report_plots.py) in this order
PLOT_ORDER = ("win_rates", "reward_vs_kl", "rm_accuracy", "on_topic", "reviews", "length",
              "fluency")


# --- samples -----------------------------------------------------------------------------------

def load_samples(root: Path, rows: Sequence[Row], n: int = N_SAMPLES
                 ) -> tuple[int | None, list[dict[str, Any]]]:
    """The first `n` evaluation samples of the last iteration that has them."""
    for row in sorted(rows, key=lambda r: -r["iteration"]):
        path = root / layout.eval_samples(row["iteration"])
        if path.is_file():
            return row["iteration"], [rec for _, rec in islice(jsonl.read(path), n)]
    return None, []


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):     # chat messages: what the user asked
        return "\n".join(str(m.get("content", "")) for m in prompt
                         if isinstance(m, dict) and m.get("role") != "system")
    return str(prompt)


def _verdict(v: Any) -> str:
    """Verdicts are recorded for the pair shown as (A = policy, B = reference)."""
    return {"A": "policy", "B": "reference"}.get(v, "—" if v is None else str(v))


def _on_topic(rec: Mapping[str, Any], key: str) -> str:
    v = rec.get(key)
    return "—" if v is None else ("yes" if v else "no")


SAMPLE_COLUMNS: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("prompt", lambda s: _prompt_text(s.get("prompt", ""))),
    ("reference", lambda s: str(s.get("reference", ""))),
    ("policy", lambda s: str(s.get("policy", ""))),
    ("judge", lambda s: _verdict(s.get("judge_verdict"))),
    ("gold", lambda s: _verdict(s.get("gold_verdict"))),
    ("RM policy / ref", lambda s: f"{_num(value(s, 'rm_policy'), 2)} / "
                                  f"{_num(value(s, 'rm_reference'), 2)}"),
    ("on-topic policy / ref", lambda s: f"{_on_topic(s, 'on_topic_policy')} / "
                                        f"{_on_topic(s, 'on_topic_reference')}"),
)


# --- pages -------------------------------------------------------------------------------------

CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
vertical-align:top}th{background:#f4f4f4}tr.suspect td{background:#fde2e2}
td.text{white-space:pre-wrap;max-width:28em}figure{display:inline-block;margin:0 1em 1em 0}
.note{color:#555}"""


def _table(headers: Sequence[str], body: Sequence[Sequence[str]],
           classes: Sequence[str] = (), text_cols: frozenset[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    lines = []
    for i, cells in enumerate(body):
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        tds = "".join(f'<td{" class=text" if j in text_cols else ""}>{html.escape(c)}</td>'
                      for j, c in enumerate(cells))
        lines.append(f"<tr{cls}>{tds}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _rows_with_suspects(root: Path) -> tuple[list[Row], list[int]]:
    rows = load_rows(root)
    suspects = judge_gold_divergence(rows)
    for r in rows:
        r["suspect"] = r["iteration"] in suspects
    return rows, suspects


def what_was_aligned(p: Any) -> list[tuple[str, str]]:
    """The page's header rows from the params (a `tasks.config.params.Params`): model, judge,
    update algorithm, seed."""
    m = p.model
    model = (f"{m.gguf_package} (GGUF{': ' + m.gguf_file if m.gguf_file else ''})"
             if m.source == "gguf" else m.path or m.source)
    judge = f"{p.judge.kind}: {p.judge.model or p.judge.version}"
    return [("model", model), ("judge", judge), ("update", p.update.algo), ("seed", str(p.seed))]


def targets_table(root: Path) -> str:
    """metrics/targets.json (the last iteration against the profile's targets) as a table."""
    path = root / layout.TARGETS
    if not path.is_file():
        return "<p class=note>No targets checked yet.</p>"
    t = read_json(path)
    rows = [["met" if c["met"] else "MISSED", c["name"], f"{c['value']:.3f}", c["bar"]]
            for c in t.get("checks", [])]
    return (f"<h2>Targets (iteration {t.get('iteration')}): {t.get('met')} of {t.get('of')} "
            f"met</h2>" + _table(["", "check", "value", "bar"], rows,
                                 ["" if r[0] == "met" else "suspect" for r in rows]))


def render_html(root: Path, rows: Sequence[Row], suspects: Sequence[int],
                plots: Mapping[str, bytes], p: Any = None) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>alignloop report</title>"
             f"<style>{CSS}</style></head><body><h1>alignloop report</h1>",
             "<p class=note>Built by the <code>report</code> stage from the metrics and "
             "evaluation samples its dvc.lock entry names: the commit that holds that entry "
             "holds these results (the registered versions: <code>registry/versions.json</code> "
             "at that commit).</p>"]
    if p is not None:
        parts.append(_table(["", ""], [[k, v] for k, v in what_was_aligned(p)],
                            text_cols=frozenset({1})))
    parts.append(targets_table(root))
    if not rows:
        parts.append("<p>No evaluated iteration yet.</p></body></html>")
        return "\n".join(parts)
    parts.append("<h2>Per iteration</h2>")
    parts.append(_table([h for h, _ in COLUMNS], [[f(r) for _, f in COLUMNS] for r in rows],
                        ["suspect" if r["suspect"] else "" for r in rows]))
    rule = (f"judge win rate up by more than {DIVERGENCE_EPS} over the previous iteration while "
            f"gold's rose by less than that or fell")
    parts.append(f"<p><b>Suspect (reward hacking): iteration{'s' if len(suspects) > 1 else ''} "
                 f"{', '.join(map(str, suspects))}</b> ({html.escape(rule)}).</p>" if suspects
                 else f"<p class=note>No iteration is suspect ({html.escape(rule)}).</p>")
    parts.append("<p class=note>Win rates are against the reference on held-out prompts, ties "
                 "count half. The judge is what the loop optimises; gold is an independent "
                 "evaluator the loop never trains on. Read the judge beside gold, KL and "
                 "length, never alone. — = not measured in this workspace.</p><h2>Plots</h2>")
    for name in PLOT_ORDER:
        if name in plots:
            data = base64.b64encode(plots[name]).decode("ascii")
            parts.append(f"<figure><a href='{name}.png'><img alt='{name}' width=640 "
                         f"src='data:image/png;base64,{data}'></a></figure>")
    missing = [n for n in PLOT_ORDER if n not in plots]
    if missing:
        parts.append(f"<p class=note>No data for: {', '.join(missing)}.</p>")
    it, samples = load_samples(root, rows)
    if samples:
        parts.append(f"<h2>Sample outputs (iteration {it}, first {len(samples)} held-out "
                     f"prompts; verdicts name the winner)</h2>")
        parts.append(_table([h for h, _ in SAMPLE_COLUMNS],
                            [[f(s) for _, f in SAMPLE_COLUMNS] for s in samples],
                            text_cols=frozenset({0, 1, 2})))
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(workspace: Path, out_dir: Path, p: Any = None) -> Path:
    """Write report.html and its PNG plots into `out_dir` (replaced as a whole, atomically);
    returns the HTML's path. `p`: the workspace's params, for the page's header."""
    from tasks.evaluation.report_plots import render_plots  # matplotlib: only when a page is built
    root = Path(workspace)
    rows, suspects = _rows_with_suspects(root)
    plots = render_plots(rows, suspects) if rows else {}
    with atomic.directory(out_dir) as tmp:
        for name in PLOT_ORDER:
            if name in plots:
                (tmp / f"{name}.png").write_bytes(plots[name])
        (tmp / HTML_NAME).write_text(render_html(root, rows, suspects, plots, p))
    return out_dir / HTML_NAME


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(workspace: Path, html_path: Path, mlflow_run_id: str | None = None) -> str:
    """The per-iteration table as markdown (a Prefect artifact), pointing at the full page."""
    rows, suspects = _rows_with_suspects(Path(workspace))
    lines = [f"# alignloop report: {Path(workspace).name}", ""]
    if rows:
        lines += ["| " + " | ".join(h for h, _ in COLUMNS) + " |",
                  "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(_md_cell(f(r)) for _, f in COLUMNS) + " |" for r in rows]
    else:
        lines.append("No evaluated iteration yet.")
    if suspects:
        lines += ["", f"**Suspect (judge up, gold not): iteration "
                      f"{', '.join(map(str, suspects))}**"]
    targets = Path(workspace) / layout.TARGETS
    if targets.is_file():
        t = read_json(targets)
        lines += ["", f"**Targets (iteration {t.get('iteration')}): {t.get('met')} of "
                      f"{t.get('of')} met**", ""]
        lines += [f"- [{'met' if c['met'] else 'MISSED'}] {_md_cell(c['name'])} = "
                  f"{c['value']:.3f} ({c['bar']})" for c in t.get("checks", [])]
    lines += ["", f"Full report with plots and sample outputs: `{html_path}`"]
    if mlflow_run_id:
        lines.append(f"(also MLflow run `{mlflow_run_id}`, artifacts `report/`)")
    return "\n".join(lines) + "\n"
