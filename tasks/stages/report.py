"""Stage `report`: the run's report page (tasks/evaluation/report.py) as a DVC output.

It reads every metrics file and the last iteration's evaluation samples, so it depends on the
`metrics` and `data` directories (DVC links it after every stage that writes there) and runs
once the loop's last stage has: DVC, not a hash of its own, says whether the page is up to date,
and each commit's dvc.lock names the page built from that commit's results.
"""
from __future__ import annotations

from tasks.runtime import stage  # first: a CLI-started stage ends quietly on Ctrl-C

# isort: split

from tasks.core import layout
from tasks.evaluation import report

CONTRACT = stage.Contract(
    "report", params=("seed", "model", "judge.kind", "judge.version", "judge.model",
                      "update.algo", "targets"),     # the page's header: what was aligned, how
    deps=lambda it, prev: (layout.METRICS_DIR, layout.DATA_DIR),
    outs=lambda it, prev: (layout.REPORT_DIR,))


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "", CONTRACT)
    page = report.build_report(args.root, args.root / layout.REPORT_DIR, args.params)
    stage.say(f"report: {page.relative_to(args.root)}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
