"""The search for the largest size that fits: galloping from a start (doubling steps up while sizes fit, down while
they do not), then bisection between the largest size that fitted and the smallest that did not. Pure: the
predicate is any monotone function, a trial in the capacity table."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple


@dataclass
class Search:
    """What `largest_fitting` found: the largest size that fitted (0: not even 1), the smallest that did not
    (None: the limit fitted), and every probe in order."""

    largest: int
    smallest_failing: Optional[int]
    probes: List[Tuple[int, bool]] = field(default_factory=list)


def largest_fitting(fits: Callable[[int], bool], start: int = 1, limit: Optional[int] = None) -> Search:
    """The largest n >= 1 with fits(n), for a monotone `fits` (true up to a boundary, false after it).

    From `start` the search gallops: while sizes fit it probes start + 1, start + 3, start + 7, ... (steps doubling;
    from start 1 that is 1, 2, 4, 8, ...), while they do not start - 1, start - 3, ... down to 1; then it bisects
    between the largest size that fitted and the smallest that did not. Each size is probed once; a start d away
    from the boundary costs at most 2 ceil(log2(d + 1)) + 2 probes, so a good estimate (the estimator's) makes the
    search a handful of trials, and from start 1 it is at most 2 floor(log2(boundary)) + 2. `limit` caps the sizes:
    a limit that fits ends the search with smallest_failing None."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    probes: List[Tuple[int, bool]] = []

    def probe(n: int) -> bool:
        ok = bool(fits(n))
        probes.append((n, ok))
        return ok

    n = max(1, int(start))
    if limit is not None:
        n = min(n, limit)
    lo, hi, step = 0, n, 1  # lo: largest size known to fit (0: none); hi: smallest known not to
    if probe(n):
        lo = n
        while True:
            if limit is not None and lo >= limit:
                return Search(lo, None, probes)
            n = lo + step if limit is None else min(lo + step, limit)
            if not probe(n):
                hi = n
                break
            lo, step = n, step * 2
    else:
        while hi > 1:
            n = max(1, hi - step)
            if probe(n):
                lo = n
                break
            hi, step = n, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return Search(lo, hi, probes)
