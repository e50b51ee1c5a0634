"""`geodiloco report RUN_DIR`: PNG plots and a Markdown summary that links them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from geodiloco.app.plots import Plot, bytes_plot, eval_loss_plot, timeline_plot
from geodiloco.app.runlog import RunLog, RunLogError, load_run
from geodiloco.app.status import human_bytes

MARKDOWN = "report.md"


class ReportError(Exception):
    """The report cannot be written; the message says why."""


@dataclass(frozen=True, slots=True)
class Report:
    markdown: Path
    plots: list[Plot]


def write_report(run_dir: Path, out: Path | None = None) -> Report:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError("geodiloco report needs matplotlib: pip install 'geodiloco[report]'") from None
    try:
        run = load_run(run_dir)
    except (OSError, RunLogError) as exc:
        raise ReportError(str(exc)) from None
    out = out or run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"--out {out}: {exc.strerror}") from None
    plots = [
        eval_loss_plot(run, out / "eval_loss.png"),
        bytes_plot(run, out / "bytes_per_round.png"),
        timeline_plot(run, out / "timeline.png"),
    ]
    markdown = out / MARKDOWN
    markdown.write_text(summary_markdown(run, plots))
    return Report(markdown, plots)


def _loss(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.4f}"


def summary_markdown(run: RunLog, plots: list[Plot]) -> str:
    rounds = run.rounds
    total_up, total_down = sum(run.bytes_up.values()), sum(run.bytes_down.values())
    durations = [r["duration_s"] for r in rounds]
    lines = [
        f"# Run report: {run.directory}",
        "",
        f"- rounds committed: **{len(rounds)}** ({rounds[0]['round']} to {rounds[-1]['round']})",
        f"- tokens in committed rounds: **{sum(r['tokens'] for r in rounds):,}**",
        f"- final global eval loss: **{_loss(run.global_eval_loss[-1] if run.global_eval_loss else None)}**",
        f"- payload streams: **{human_bytes(total_up)} up**, **{human_bytes(total_down)} down** "
        "(pushes and pulls; heartbeats and other small calls not included)",
        f"- round duration: mean {sum(durations) / len(durations):.1f}s, longest {max(durations):.1f}s",
        f"- last state hash: `{rounds[-1]['state_hash'][:16]}`",
        "",
        "## Sites",
        "",
        "| site | rounds contributed | tokens | last eval loss | up | down "
        "| compute s | transfer s | waiting s | late | rejected | lease expiries |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in run.sites.values():
        contributed = sum(1 for r in rounds if s.name in r["contributors"])
        lines.append(
            f"| {s.name} | {contributed} | {s.tokens[-1] if s.tokens else 0:,} "
            f"| {_loss(s.eval_loss[-1] if s.eval_loss else None)} "
            f"| {human_bytes(s.bytes_up)} | {human_bytes(s.bytes_down)} "
            f"| {s.seconds('compute'):.1f} | {s.seconds('transfer'):.1f} | {s.seconds('waiting'):.1f} "
            f"| {s.outcomes.get('late', 0)} | {s.outcomes.get('rejected', 0)} | {s.lease_expiries} |"
        )
    lines += ["", "## Plots", ""]
    for plot in plots:
        lines += [f"### {plot.title.capitalize()}", "", f"![{plot.title}]({plot.path.name})", ""]
        lines += [f"Series: {', '.join(plot.series) or 'none'}.", ""]
    lines += [
        "Compute is the inner-step time each site reports, placed just before its push; transfer is",
        "the push stream and the update stream as the coordinator saw them; waiting is from the",
        "site's pull request to the round's commit. Times are on the coordinator's clock.",
        "",
    ]
    return "\n".join(lines)
