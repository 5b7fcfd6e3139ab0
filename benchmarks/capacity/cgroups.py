"""Memory cgroups, the budget's enforcement: where this process may make them (`memory_cgroup_support`), one cgroup
with a hard limit (`MemoryCgroup`: cgroup v1 `memory.limit_in_bytes` or v2 `memory.max`, its OOM kills and peak),
and what a rank's own cgroup charges it (`own_cgroup_usage`)."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from hf_zero.tools.bench.runner import log


@dataclass(frozen=True)
class CgroupSupport:
    """Where this process may make memory cgroups: the cgroup version and its own memory cgroup's folder (new
    cgroups go below it, so they stay inside whatever limits this process already runs under)."""

    version: int
    parent: str


def own_cgroup_paths() -> Dict[str, str]:
    """{controllers: path} from /proc/self/cgroup ("" is the v2 unified hierarchy)."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                out[parts[1]] = parts[2]
    return out


def own_memory_cgroup() -> Tuple[Optional[CgroupSupport], str]:
    """(version and folder of this process's own memory cgroup, "") or (None, why not): cgroup v1 when its memory
    controller is mounted, else v2's unified hierarchy."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
        own = own_cgroup_paths()
    except OSError as exc:
        return None, f"cannot read /proc: {exc}"
    v1 = next((m[1] for m in mounts if len(m) > 3 and m[2] == "cgroup" and "memory" in m[3].split(",")), None)
    v2 = next((m[1] for m in mounts if len(m) > 2 and m[2] == "cgroup2"), None)
    if v1 is not None:
        path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
        if path is None:
            return None, "cgroup v1 memory controller mounted, but /proc/self/cgroup has no memory line"
        return CgroupSupport(1, os.path.join(v1, path.lstrip("/"))), ""
    if v2 is not None and "" in own:
        return CgroupSupport(2, os.path.join(v2, own[""].lstrip("/"))), ""
    return None, "no memory cgroup controller is mounted"


def own_cgroup_usage() -> Optional[int]:
    """This process's memory cgroup's usage in bytes (v1 memory.usage_in_bytes, v2 memory.current), None if
    unknown. In a per-rank cgroup: what the limit counts of this rank (shared library pages already cached by other
    processes are in its RSS but not charged to it)."""
    own, _ = own_memory_cgroup()
    if own is None:
        return None
    name = "memory.usage_in_bytes" if own.version == 1 else "memory.current"
    try:
        with open(os.path.join(own.parent, name)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def memory_cgroup_support() -> Tuple[Optional[CgroupSupport], str]:
    """(support, "") when this process can make memory cgroups below its own, else (None, why not). cgroup v1 when
    the memory controller is mounted there (`memory.limit_in_bytes`), else v2 (`memory.max`, the controller
    enabled in this cgroup's subtree_control)."""
    own, why = own_memory_cgroup()
    if own is None:
        return None, why
    parent, version = own.parent, own.version
    if version == 2:
        try:
            with open(os.path.join(parent, "cgroup.controllers")) as f:
                if "memory" not in f.read().split():
                    return None, f"cgroup v2: the memory controller is not available in {parent}"
        except OSError as exc:
            return None, f"cgroup v2: {exc}"
    probe = os.path.join(parent, f"hfz_capacity_probe_{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return None, (f"cannot create a cgroup in {parent} ({exc.strerror}): memory cgroups need root or a "
                      f"delegated cgroup")
    try:
        if version == 2:
            try:
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
            except OSError:
                pass
            if not os.path.exists(os.path.join(probe, "memory.max")):
                return None, (f"cgroup v2: the memory controller cannot be enabled below {parent} (a cgroup with "
                              f"processes cannot delegate it); run from a delegated cgroup, e.g. "
                              f"systemd-run --scope -p Delegate=yes")
        elif not os.path.exists(os.path.join(probe, "memory.limit_in_bytes")):
            return None, f"cgroup v1: {probe} has no memory.limit_in_bytes"
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)
    return own, ""


class MemoryCgroup:
    """One memory cgroup with a hard limit, below `support.parent`; processes join it by writing their pid into
    `procs` (before they allocate: see `run_ranks`). `oom_kills()` counts the processes the kernel killed in it
    for going over; `peak()` is its largest usage."""

    def __init__(self, support: CgroupSupport, name: str, limit_bytes: int) -> None:
        self.support, self.limit = support, int(limit_bytes)
        self.path = os.path.join(support.parent, name)
        os.mkdir(self.path)
        if support.version == 1:
            self._write("memory.limit_in_bytes", self.limit)
            with contextlib.suppress(OSError):  # no swapping past the limit either (needs swapaccount)
                self._write("memory.memsw.limit_in_bytes", self.limit)
        else:
            self._write("memory.max", self.limit)
            with contextlib.suppress(OSError):
                self._write("memory.swap.max", 0)
        self.procs = os.path.join(self.path, "cgroup.procs")

    def _write(self, name: str, value: Any) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def _read(self, name: str) -> Optional[str]:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def oom_kills(self) -> int:
        """Processes the OOM killer killed in this cgroup (v1: memory.oom_control's oom_kill, kernel >= 4.13; v2:
        memory.events)."""
        text = self._read("memory.oom_control" if self.support.version == 1 else "memory.events") or ""
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def peak(self) -> Optional[int]:
        text = self._read("memory.max_usage_in_bytes" if self.support.version == 1 else "memory.peak")
        return int(text) if text and text.strip().isdigit() else None

    def pids(self) -> List[int]:
        text = self._read("cgroup.procs") or ""
        return [int(p) for p in text.split() if p.strip().isdigit()]

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone, killing by pid any left: the cgroup is new and only the
        ranks `run_ranks` started (and their children) ever joined it."""
        for _ in range(100):
            left = self.pids()
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.05)
        log(f"could not remove cgroup {self.path} (still busy)")


