"""Hosts and disks: which ranks see each other's files, who writes what on each disk, and the resume check that a
file one host has is on every host.

On a cluster the hosts often do not share a disk: a path such as /scratch/run/ckpt names one folder per host.
A save cannot know that from the path, so it asks the file system: every rank drops a marker file into the
save's temporary folder, the ranks wait for each other, and each rank then looks up every rank's marker. The ranks
whose markers a rank sees share its disk (all of them on a shared file system, the ranks of its host on node-local
disks). Every rank reports what it saw, so every rank knows every disk and the choice of writers is the same
everywhere.
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

import torch.distributed as dist

MARKERS = ".ranks"  # inside a save's temporary folder: one empty file per rank, removed before the rename


def host_name() -> str:
    """This machine's name, as error messages and the manifest give it."""
    return socket.gethostname()


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Collective over `group` (default: the world): every rank's `obj` in rank order; [obj] without a process
    group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    n = dist.get_world_size(group)
    if n == 1:
        return [obj]
    out: List[Any] = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def _marker(folder: Path, rank: int) -> Path:
    return folder / MARKERS / f"{rank:05d}"


def mark(folder: Path, rank: int) -> None:
    """Drop this rank's marker into `folder` (created if needed)."""
    (folder / MARKERS).mkdir(parents=True, exist_ok=True)
    _marker(folder, rank).touch()


def ranks_seen(folder: Path, world: int) -> List[int]:
    """The ranks whose markers are in `folder`. Each marker is looked up by name (a lookup goes to the file
    server the first time; a directory listing may come from a cache that does not show another host's new
    file yet)."""
    return [r for r in range(world) if _marker(folder, r).is_file()]


def disk_groups(seen: Sequence[Sequence[int]]) -> Optional[List[List[int]]]:
    """The disks, each as the sorted ranks on it, from what every rank saw; None if the views disagree (a rank
    that does not see itself, or two ranks on one disk that see different sets)."""
    disks: Dict[tuple, List[int]] = {}
    for rank, view in enumerate(seen):
        key = tuple(sorted(view))
        if rank not in key or any(tuple(sorted(seen[other])) != key for other in key):
            return None
        disks[key] = list(key)
    return sorted(disks.values())


def partition_writers(disks: Sequence[Sequence[int]], partition_of: Sequence[int]) -> Set[int]:
    """The ranks that write a partition file: on each disk, the lowest rank holding each partition. On a shared
    disk that is one replica per partition; on node-local disks every host writes the partitions its ranks
    hold. The lowest rank of a disk (its leader) is always one of them."""
    writers = set()
    for disk in disks:
        first: Dict[int, int] = {}
        for rank in sorted(disk):
            first.setdefault(partition_of[rank], rank)
        writers.update(first.values())
    return writers


def describe_ranks(ranks: Sequence[int], hosts: Sequence[str]) -> str:
    """"host a (ranks 0, 1), host b (rank 2)" for global `ranks` and their `hosts`."""
    by_host: Dict[str, List[int]] = {}
    for r, h in zip(ranks, hosts):
        by_host.setdefault(h, []).append(r)
    parts = []
    for h, rs in by_host.items():
        shown = ", ".join(map(str, rs[:8])) + (", ..." if len(rs) > 8 else "")
        parts.append(f"host {h} ({'ranks' if len(rs) > 1 else 'rank'} {shown})")
    return ", ".join(parts)


def require_on_every_host(folder: str, names: Sequence[str], hints: Dict[str, str], error: type,
                          group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective. Raise `error` on every rank if a file of `names` (paths under `folder`; "" is the folder
    itself) exists for some ranks but not for others: the resume of a checkpoint written on node-local disks
    where only one host got that file. `hints[name]` (or hints[""]) says which setting writes it on every host.
    A file missing for every rank is left to the caller (it fails the same way on every rank)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mine = [bool(Path(folder, n).exists()) for n in names]
    views = all_gather_objects((host_name(), rank, mine), group)
    for i, name in enumerate(names):
        have = [(h, r) for h, r, seen in views if seen[i]]
        lack = [(h, r) for h, r, seen in views if not seen[i]]
        if have and lack:
            what = f"{folder}/{name}" if name else folder
            raise error(
                f"cannot resume from {folder}: {what} is missing on "
                f"{describe_ranks([r for _, r in lack], [h for h, _ in lack])} but present on "
                f"{describe_ranks([r for _, r in have], [h for h, _ in have])}. {hints.get(name, hints.get('', ''))}"
                .rstrip())


def raise_if_any_failed(error: Optional[BaseException], what: str, error_type: type,
                        group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective. If `error` is set on any rank, raise `error_type` on every rank, naming the hosts and ranks that
    failed and why (the others would otherwise wait in their next collective). Without a process group the
    error itself is raised."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = f"{type(error).__name__}: {error}" if error is not None else None
    views = all_gather_objects((host_name(), dist.get_rank(), mine), group)
    failed = [(h, r, e) for h, r, e in views if e is not None]
    if failed:
        shown = "; ".join(f"host {h}, rank {r}: {e}" for h, r, e in failed[:4])
        more = f"; and {len(failed) - 4} more" if len(failed) > 4 else ""
        raise error_type(f"{what} failed on {len(failed)} of {len(views)} ranks ({shown}{more})") from error
