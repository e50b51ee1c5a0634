"""The report's three figures, drawn with matplotlib (Agg, no display needed).

Each PNG records the names of its series in a ``Series`` text chunk (JSON list), so a reader
or a test can tell what was drawn without looking at pixels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from geodiloco.app.runlog import RunLog

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SIZE_IN = (9.0, 5.0)
DPI = 100
SPAN_COLOURS = {"compute": "tab:green", "transfer": "tab:blue", "waiting": "tab:orange"}


@dataclass(frozen=True, slots=True)
class Plot:
    path: Path
    title: str
    series: list[str]


def _save(fig: Figure, path: Path, title: str, series: list[str]) -> Plot:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Title": title, "Series": json.dumps(series)})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return Plot(path, title, series)


def _figure() -> Figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.figure(figsize=SIZE_IN)


def eval_loss_plot(run: RunLog, path: Path) -> Plot:
    """Eval loss against tokens trained: each site on its own slice, and the whole eval set."""
    fig = _figure()
    ax = fig.add_subplot()
    series = []
    for site in run.sites.values():
        if site.tokens:
            ax.plot(site.tokens, site.eval_loss, marker=".", linewidth=1, label=f"{site.name} (its tokens)")
            series.append(site.name)
    if run.global_tokens:
        ax.plot(
            run.global_tokens, run.global_eval_loss, color="black", linewidth=2, label="global (all tokens)"
        )
        series.append("global")
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("eval loss")
    ax.set_title("Eval loss against tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path, "eval loss", series)


def bytes_plot(run: RunLog, path: Path) -> Plot:
    """Bytes of pseudo-gradient streams (up) and update streams (down) in each round."""
    fig = _figure()
    ax = fig.add_subplot()
    rounds = list(range(len(run.rounds)))
    width = 0.4
    up = [run.bytes_up.get(r, 0) / 1e6 for r in rounds]
    down = [run.bytes_down.get(r, 0) / 1e6 for r in rounds]
    ax.bar([r - width / 2 for r in rounds], up, width, label="up (sites to coordinator)")
    ax.bar([r + width / 2 for r in rounds], down, width, label="down (coordinator to sites)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max([*up, *down, 1e-6]) * 1.25)  # room for the legend above the bars
    ax.set_xlabel("round")
    ax.set_ylabel("MB")
    ax.set_title("WAN bytes per round, by direction")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _save(fig, path, "bytes per round", ["up", "down"])


def timeline_plot(run: RunLog, path: Path) -> Plot:
    """One row per site: when it computed, transferred, and waited for the round to commit."""
    fig = _figure()
    ax = fig.add_subplot()
    names = list(run.sites)
    kinds = [k for k in SPAN_COLOURS if any(s.kind == k for site in run.sites.values() for s in site.spans)]
    for row, name in enumerate(names):
        for kind in kinds:
            spans = [(s.start, s.seconds) for s in run.sites[name].spans if s.kind == kind]
            ax.broken_barh(spans, (row - 0.35, 0.7), color=SPAN_COLOURS[kind])
    for kind in kinds:  # one legend entry per kind
        ax.bar(0, 0, color=SPAN_COLOURS[kind], label=kind)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds since the first site started computing (coordinator clock)")
    ax.set_title("Round timeline per site")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(loc="upper right")
    return _save(fig, path, "round timeline", kinds)
