"""One cell of the capacity table (a system, a mode, a world size): the search for its largest layer count, seeded
at the estimator's prediction, each probe a trial under the budget (`search_cell`), and the estimator's counts beside
it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from hf_zero.tools.bench.runner import log
from hf_zero.tools.bench.spawn import error_summary

from .estimate import Estimator
from .search import Search, largest_fitting
from .trials import RunOptions, Trial, run_trial
from .units import gib
from .weights import RandomCheckpoint


@dataclass
class Cell:
    """One row of the table: a system, a mode and a world size; its search, the estimator's prediction."""

    system: str
    mode: str
    world: int
    status: str  # "ok", "capped" (the largest size tried fitted), "none" (not even one layer), "error",
    # "skipped" (the system cannot run here), "fixed" (--layers: the one size trained)
    largest: int = 0
    params: int = 0
    first_failing: Optional[int] = None
    failing_how: Optional[str] = None
    estimated: Optional[int] = None  # model states <= budget
    estimated_minus_runtime: Optional[int] = None  # model states <= budget - the runtime footprint measured
    start: Optional[int] = None  # where the search started (the estimator's guess)
    at_largest: Optional[Trial] = None
    trials: List[Trial] = field(default_factory=list)
    reason: str = ""


class _StopSearch(Exception):
    """A trial that ends the search: the system failed for a reason of its own ("error") or cannot run here at
    any size ("unsupported")."""

    def __init__(self, trial: Trial) -> None:
        super().__init__(trial.error)
        self.trial = trial


def runtime_footprint(trials: Iterable[Trial]) -> Optional[int]:
    """The largest runtime footprint (interpreter, torch, libraries, process group: no model yet) of `trials`, as
    the budget counts it: the cgroup's charge where measured, else the RSS; None when none was measured."""
    runtimes = [t.runtime_charged or t.runtime_rss for t in trials if t.runtime_charged or t.runtime_rss]
    return max(runtimes) if runtimes else None


# Before any trial of a run has measured one: what a rank holds besides its model states (the interpreter, torch,
# the libraries and a gloo process group came to ~0.45 GiB per rank here, activations and buffers of a small model
# included); a guess only, it places the first probe.
OVERHEAD_GUESS = 512 * 2**20


def measured_overhead(trials: Iterable[Trial]) -> Optional[int]:
    """What the sizes that fitted held per rank besides their model states (peak RSS - model states, the largest:
    runtime, activations, buffers, the allocator's slack), None when none fitted. It grows slowly with the layer
    count (a gathered unit, a layer's activations), so it seeds the next cell's search well."""
    gaps = [t.peak_rss - t.state_bytes for t in trials if t.fits and t.peak_rss and t.state_bytes is not None]
    return max(gaps) if gaps else None


def seed_layers(estimator: Estimator, name: str, mode: str, world: int, budget: int, overhead: Optional[int],
                max_layers: int) -> int:
    """Where the search starts: the estimator's largest layer count whose model states fit the budget less
    `overhead` (what a rank held besides its model states in an earlier cell, `measured_overhead`; None: the whole
    budget), within 1..max_layers. The search gallops from there, so a seed d sizes off costs about 2 log2(d) + 2
    trials."""
    guess = estimator.largest(name, mode, world, budget - (overhead or 0), limit=max_layers)
    return max(1, min(max_layers, guess))


def search_cell(name: str, mode: str, world: int, opts: RunOptions, checkpoint: Optional[RandomCheckpoint],
                estimator: Estimator, max_layers: int, fixed_layers: Optional[int] = None,
                start: int = 1) -> Cell:
    """The largest layer count `name` trains in `mode` on `world` ranks under the budget, searched from `start`
    (`seed_layers`), or one trial at `fixed_layers`."""
    cell = Cell(name, mode, world, "ok", start=None if fixed_layers is not None else start)
    trials: Dict[int, Trial] = {}

    def fits(layers: int) -> bool:
        trial = run_trial(name, mode, world, layers, opts, checkpoint)
        trials[layers] = trial
        cell.trials.append(trial)
        extra = ""
        if trial.fits:
            extra = (f"peak RSS {gib(trial.peak_rss)}/rank, model states {gib(trial.state_bytes)}/rank, "
                     f"step {trial.step_s:.2f}s")
        elif trial.error:
            extra = error_summary(trial.error)
        log(f"{name} {mode} N={world} L={layers}: {trial.status} ({trial.wall_s:.0f}s) {extra}")
        if trial.status in ("error", "unsupported"):
            raise _StopSearch(trial)
        return trial.fits

    search: Optional[Search] = None
    try:
        if fixed_layers is not None:
            ok = fits(fixed_layers)
            search = Search(fixed_layers if ok else 0, None if ok else fixed_layers, [(fixed_layers, ok)])
        else:
            search = largest_fitting(fits, start, max_layers)
    except _StopSearch as stop:
        cell.status = "skipped" if stop.trial.status == "unsupported" else "error"
        cell.reason = error_summary(stop.trial.error or "")
    if search is not None:
        cell.largest, cell.first_failing = search.largest, search.smallest_failing
        if fixed_layers is not None:
            cell.status = "fixed" if search.largest else "none"
        elif search.smallest_failing is None:
            cell.status = "capped"
        elif search.largest == 0:
            cell.status = "none"
        if search.smallest_failing is not None:
            failing = trials[search.smallest_failing]
            cell.failing_how = failing.status
            if failing.status in ("refused", "timeout"):
                cell.reason = error_summary(failing.error or "")
            elif failing.status == "oom":  # how far the killed ranks got: "building the model" is "cannot start"
                cell.reason = ", ".join(f"rank {r} {failing.reached[r]}" for r in failing.oom_ranks
                                        if r < len(failing.reached))
        cell.at_largest = trials.get(search.largest)
        cell.params = estimator.params(mode, cell.largest) if cell.largest else 0
    runtime = runtime_footprint(cell.trials)
    cell.estimated = estimator.largest(name, mode, world, opts.budget)
    if runtime is not None:
        cell.estimated_minus_runtime = estimator.largest(name, mode, world, opts.budget - runtime)
    return cell
