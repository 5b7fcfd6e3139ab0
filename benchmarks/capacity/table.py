"""The capacity table for people (`format_table`), as a plot next to the estimator's prediction (`plot_cells`) and
as JSON (`cell_json`)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List, Optional

from .cells import Cell
from .systems import MODES
from .trials import Trial
from .units import mib

def _fmt_params(n: Optional[float]) -> str:
    if not n:
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _rest(t: Optional[Trial]) -> Optional[int]:
    """Peak RSS less model states less the runtime footprint: what the estimator does not count (activations,
    communication buffers, gathered units, temporaries, the allocator's retained heap)."""
    if t is None or t.peak_rss is None or t.state_bytes is None or t.runtime_rss is None:
        return None
    return t.peak_rss - t.state_bytes - t.runtime_rss


def format_table(cells: List[Cell], fixed: bool = False) -> str:
    """One line per cell: the largest layer count that trained (with --layers, `fixed`: the one size), its
    parameters, the estimator's counts, the trials the search took (and the size it started from), the peak RSS,
    model states and the rest per rank at that size, its step time, and what happened at the next size."""
    header = ["system", "mode", "ranks", "layers" if fixed else "largest layers", "params", "est. layers",
              "est. (budget - runtime)", "trials" if fixed else "trials (from)", "peak RSS MiB/rank",
              "model states MiB/rank", "rest MiB/rank", "step s", "next size" if not fixed else "status"]
    body = []
    for c in cells:
        t = c.at_largest
        if c.status in ("error", "skipped"):
            nxt = f"{c.status}: {c.reason}"
        elif fixed:
            nxt = "trained" if c.largest else f"{c.failing_how}: {c.reason}" if c.reason else (c.failing_how or "")
        elif c.first_failing is None:
            nxt = "capped (the largest size tried fitted)"
        else:
            nxt = f"{c.first_failing}: {c.failing_how}" + (f" ({c.reason})" if c.reason else "")
        body.append([c.system, c.mode, str(c.world), str(c.largest) + ("+" if c.status == "capped" else ""),
                     _fmt_params(c.params), "-" if c.estimated is None else str(c.estimated),
                     "-" if c.estimated_minus_runtime is None else str(c.estimated_minus_runtime),
                     str(len(c.trials)) + ("" if c.start is None else f" ({c.start})"),
                     mib(t.peak_rss if t else None), mib(t.state_bytes if t else None), mib(_rest(t)),
                     f"{t.step_s:.2f}" if t and t.step_s is not None else "-", nxt])
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    left = {0, 1, len(header) - 1}

    def line(cells_: List[str]) -> str:
        return "  ".join(v.ljust(w) if i in left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(cells_, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


def plot_cells(cells: List[Cell], path: str, title: str) -> None:
    """Per (mode, ranks) panel: the largest layer count measured per system next to the estimator's (model states
    within the budget, and within the budget less the runtime footprint)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    panels = sorted({(c.mode, c.world) for c in cells}, key=lambda k: (MODES.index(k[0]), k[1]))
    fig = Figure(figsize=(6.5 * max(1, len(panels)), 5.5), dpi=100)
    FigureCanvasAgg(fig)
    for i, (mode, world) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        rows = [c for c in cells if c.mode == mode and c.world == world]
        xs = list(range(len(rows)))
        width = 0.27
        series = [("measured (enforced)" if not rows or not rows[0].trials or rows[0].trials[0].enforcement != "none"
                   else "measured (peak RSS vs budget)", [c.largest for c in rows], "#1f77b4", -width),
                  ("estimator: model states <= budget", [c.estimated or 0 for c in rows], "#bbbbbb", 0.0),
                  ("estimator: <= budget - runtime", [c.estimated_minus_runtime or 0 for c in rows], "#777777",
                   width)]
        for label, values, color, dx in series:
            bars = ax.bar([x + dx for x in xs], [max(v, 0.8) for v in values], width, label=label, color=color)
            for bar, v in zip(bars, values):
                ax.annotate(str(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=7)
        for x, c in zip(xs, rows):
            if c.status in ("error", "skipped"):
                ax.text(x, 1, c.status, rotation=90, ha="center", va="bottom", color="#d62728", fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(xs)
        ax.set_xticklabels([c.system for c in rows], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("largest layer count")
        ax.set_title(f"{mode}, {world} ranks", fontsize=10)
        ax.set_ylim(top=ax.get_ylim()[1] * 3)  # room for the legend above the bars
        if i == 0:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def cell_json(c: Cell) -> Dict[str, Any]:
    """The cell as JSON-ready values, every trial with it (per-rank details only for the sizes that fitted)."""
    out = asdict(c)
    for t in out["trials"]:
        if t.get("status") != "fits":
            t.pop("ranks", None)
    return out

