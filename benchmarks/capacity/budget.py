"""The budget enforced: a group of rank processes run each in its own memory cgroup (or one shared, or none) and
waited for, with how they ended (`run_ranks`, `RanksOutcome`)."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from hf_zero.tools.bench.spawn import wait_bounded

from .cgroups import CgroupSupport, MemoryCgroup
from .units import gib

CGROUP_MODES = ("per-rank", "shared", "off")


@dataclass
class RanksOutcome:
    """How a group of rank processes ended under the budget."""

    status: str  # "ok" (every rank exited 0), "oom" (the kernel killed a rank for going over), "timeout", "failed"
    exit_codes: List[Optional[int]]
    oom_ranks: List[int]
    cgroup_peaks: List[Optional[int]]
    wall_s: float
    enforcement: str  # "per-rank cgroup v1 (limit B each)", "shared cgroup ...", "none"


def run_ranks(argvs: Sequence[Sequence[str]], budget_bytes: int, timeout_s: float, *, cgroups: str = "per-rank",
              support: Optional[CgroupSupport] = None, env: Optional[Dict[str, str]] = None,
              log_dir: Optional[str] = None, grace_s: float = 10.0) -> RanksOutcome:
    """Run one process per rank (argvs[r]) under the memory budget and wait for them: `cgroups` "per-rank" (each in
    its own cgroup limited to `budget_bytes`), "shared" (one cgroup of len(argvs) x budget) or "off" (no limit).
    Each process joins its cgroup before it execs (a shell writes its own pid into cgroup.procs, then execs the
    command), so its whole footprint is charged. A failure gives the others `grace_s` to fail on their own (a
    rank blocked in a collective with a killed peer), `timeout_s` bounds the whole; whatever is left is killed."""
    world = len(argvs)
    groups: List[MemoryCgroup] = []
    tag = f"hfz_capacity_{os.getpid()}_{time.monotonic_ns()}"
    if cgroups != "off":
        if support is None:
            raise ValueError("run_ranks needs `support` (memory_cgroup_support()) unless cgroups='off'")
        if cgroups == "per-rank":
            groups = [MemoryCgroup(support, f"{tag}_rank{r}", budget_bytes) for r in range(world)]
        elif cgroups == "shared":
            groups = [MemoryCgroup(support, f"{tag}_ranks", budget_bytes * world)]
        else:
            raise ValueError(f"cgroups must be one of {CGROUP_MODES}, got {cgroups!r}")
    procs: List[subprocess.Popen] = []
    logs = []
    t0 = time.monotonic()
    try:
        for r, argv in enumerate(argvs):
            cmd = list(argv)
            if groups:
                cg = groups[r] if cgroups == "per-rank" else groups[0]
                cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cg.procs] + cmd
            out = open(os.path.join(log_dir, f"rank{r}.log"), "wb") if log_dir else subprocess.DEVNULL
            logs.append(out)
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, **(env or {})}))
        timed_out = wait_bounded(lambda: [p.poll() for p in procs], lambda: time.sleep(0.1), grace_s, timeout_s)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        wall = time.monotonic() - t0
        codes = [p.returncode for p in procs]
        if cgroups == "per-rank":
            oom = [r for r, cg in enumerate(groups) if cg.oom_kills() > 0]
            peaks = [cg.peak() for cg in groups]
        elif cgroups == "shared":
            killed = groups[0].oom_kills() > 0
            oom = [r for r, c in enumerate(codes) if killed and c == -9] or ([0] if killed else [])
            peaks = [groups[0].peak()] * world
        else:
            oom, peaks = [], [None] * world
        if oom:
            status = "oom"
        elif timed_out:
            status = "timeout"
        elif all(c == 0 for c in codes):
            status = "ok"
        else:
            status = "failed"
        if cgroups == "off":
            enforcement = "none"
        else:
            each = "each" if cgroups == "per-rank" else f"for {world} ranks"
            limit = budget_bytes if cgroups == "per-rank" else budget_bytes * world
            enforcement = f"{cgroups} cgroup v{support.version} ({gib(limit)} {each})"  # type: ignore[union-attr]
        return RanksOutcome(status, codes, oom, peaks, wall, enforcement)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out in logs:
            if out is not subprocess.DEVNULL:
                out.close()
        for cg in groups:
            cg.remove()

