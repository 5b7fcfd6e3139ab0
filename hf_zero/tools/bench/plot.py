"""`hf-zero bench --plot`: one PNG with two panels, tokens/s per system and bytes per rank per system.

Bars are annotated with their ratio to DDP. A system that was skipped or failed has no bar, only its label.
matplotlib is an optional extra (`pip install 'hf_zero[bench]'`), imported here and only when a plot is asked for;
the figure is drawn on the Agg canvas directly, so pyplot's global backend is never touched.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

FIGSIZE = (12.0, 9.0)  # inches
DPI = 100  # so the PNG is 1200 x 900 pixels
MIB = 2.0 ** 20

_COLORS = {"hf_zero": "#1f77b4", "deepspeed": "#2ca02c", "torch": "#ff7f0e"}
_MISSING_COLORS = {"skipped": "#7f7f7f", "error": "#d62728"}


def check_matplotlib() -> None:
    """Raise ImportError with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib ({exc}); install it with: pip install 'hf_zero[bench]' "
                          "(or pip install matplotlib)") from exc


def _family(row: Dict[str, Any]) -> str:
    if row.get("hf_zero"):
        return "hf_zero"
    return "deepspeed" if row["system"].startswith("deepspeed") else "torch"


def _ok(row: Dict[str, Any]) -> bool:
    return row.get("status") == "ok"


def _missing_label(row: Dict[str, Any]) -> Tuple[str, str]:
    """(label, colour) for a row without numbers."""
    kind = "skipped" if row.get("status") == "skipped" else "error"
    return ("skipped" if kind == "skipped" else "failed"), _MISSING_COLORS[kind]


def _ratio(value: Optional[float], reference: Optional[float]) -> str:
    if value is None or not reference:
        return ""
    return f"x{value / reference:.2f}"


def _mark_missing(ax, rows: List[Dict[str, Any]], xs: List[float]) -> None:
    """Write "skipped" / "failed" up from the axis where a missing system's bar would be."""
    for x, row in zip(xs, rows):
        if not _ok(row):
            label, color = _missing_label(row)
            ax.text(x, 0, f" {label}", rotation=90, ha="center", va="bottom", color=color, fontsize=9,
                    fontweight="bold", transform=ax.get_xaxis_transform())


def _annotate(ax, x: float, height: float, text: str, fontsize: int = 8) -> None:
    if text:
        ax.annotate(text, (x, height), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=fontsize)


def _throughput_panel(ax, rows: List[Dict[str, Any]], ddp: Optional[Dict[str, Any]]) -> None:
    xs = list(range(len(rows)))
    reference = ddp["tokens_per_s"] if ddp else None
    for x, row in zip(xs, rows):
        if not _ok(row):
            continue
        value = row["tokens_per_s"]
        ax.bar(x, value, color=_COLORS[_family(row)], width=0.7)
        _annotate(ax, x, value, _ratio(value, reference), fontsize=9)
    _mark_missing(ax, rows, xs)
    ax.set_ylabel("tokens / s (global)")
    ax.set_title("Throughput" + (" (labels: x DDP)" if reference else " (no DDP row to compare with)"))
    ax.margins(y=0.25)
    ax.set_ylim(bottom=0)


LOG_SCALE_ABOVE = 20  # the memory panel goes logarithmic when its largest value is this many times its smallest


def _memory_panel(ax, rows: List[Dict[str, Any]], ddp: Optional[Dict[str, Any]]) -> None:
    """Model states (measured bar, paper formula as a black line) beside the peak. Linear from zero, unless the
    values span more than LOG_SCALE_ABOVE: on CPU the peak RSS of a tiny model is hundreds of times its states."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    xs = list(range(len(rows)))
    width = 0.38
    ref_state = ddp.get("state_bytes_measured") if ddp else None
    ref_peak = ddp.get("peak_bytes") if ddp else None
    peak_kinds, values = set(), []
    for x, row in zip(xs, rows):
        if not _ok(row):
            continue
        color = _COLORS[_family(row)]
        state, peak, formula = row.get("state_bytes_measured"), row.get("peak_bytes"), row.get("state_bytes_formula")
        if state:
            ax.bar(x - width / 2, state / MIB, width, color=color)
            _annotate(ax, x - width / 2, state / MIB, _ratio(state, ref_state))
        if peak:
            ax.bar(x + width / 2, peak / MIB, width, color=color, alpha=0.45, hatch="//", edgecolor="white")
            _annotate(ax, x + width / 2, peak / MIB, _ratio(peak, ref_peak))
            peak_kinds.add(row.get("peak_kind", "peak"))
        if formula:
            ax.plot([x - width, x], [formula / MIB] * 2, color="black", linewidth=1.5)
        values += [v / MIB for v in (state, peak, formula) if v]
    _mark_missing(ax, rows, xs)
    log = bool(values) and max(values) > LOG_SCALE_ABOVE * min(values)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(values) / 2, max(values) * 8)  # room for the labels and the legend
    else:
        ax.set_ylim(0, max(values, default=1.0) * 1.25)
    ax.set_ylabel("MiB per rank (max over ranks" + (", log scale)" if log else ")"))
    ax.set_title("Bytes per rank" + (" (labels: x DDP)" if ddp else ""))
    handles = [Patch(facecolor="#bbbbbb", label="model states, measured"),
               Line2D([], [], color="black", linewidth=1.5, label="model states, paper formula"),
               Patch(facecolor="#dddddd", hatch="//", edgecolor="#888888",
                     label=f"peak ({', '.join(sorted(peak_kinds)) or 'n/a'})")]
    ax.legend(handles=handles, loc="upper left", ncol=3, fontsize=8)


def plot_rows(rows: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """Draw the bench's rows to a PNG at `path` (FIGSIZE at DPI)."""
    check_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    ddp = next((r for r in rows if r["system"] == "ddp" and _ok(r)), None)
    _throughput_panel(top, rows, ddp)
    _memory_panel(bottom, rows, ddp)
    bottom.set_xticks(range(len(rows)))
    bottom.set_xticklabels([r["system"] for r in rows], rotation=30, ha="right")
    families = [f for f in _COLORS if any(_family(r) == f for r in rows)]
    top.legend(handles=[Patch(color=_COLORS[f], label=f) for f in families], loc="upper left", ncol=3, fontsize=8)
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_xlim(-0.6, len(rows) - 0.4)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
