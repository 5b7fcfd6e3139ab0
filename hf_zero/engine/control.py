"""The control plane: every value the engine reads from other ranks that is not training data, in one place.

The data plane (all-gathers, reduce-scatters, all-reduces of parameters and gradients) goes through a Comm's
strategy (engine/collectives/) and the ledger. The control plane is the rest, which decides rather than computes:

- `agree`: every rank's error or None, so that a failure one rank found is raised on all of them;
- `broadcast`: rank `src`'s tensor on every rank (the initial values, once at start);
- `share` / `exchange`: rank 0's Python object on every rank, every rank's object in rank order (checkpoint tokens
  and manifests, hosts, export status);
- `hosts`: every rank's hostname and LOCAL_WORLD_SIZE (the topology's host discovery);
- `read`: a flag's value this rank decides on (the fp16 overflow flag after its all-reduce);
- `check`: the `debug_collectives` fingerprint of every data collective, compared through the store.

A one-rank world (no torch.distributed, or a group of one) answers them all without a collective: `Control` is
made by `control_for`, the one place that looks at whether there are other ranks to ask. So is a dry run (torch's
`fake` backend, tools/estimate/dry_run.py): there the other ranks do not exist, so `SimulatedControl` answers for
them from the topology the dry run was given (`simulated_hosts`): every rank agrees, shares what this rank has, and
runs on host r // K. The data plane runs unchanged on fake tensors.
"""
from __future__ import annotations

import contextlib
import os
import socket
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["CollectiveMismatchError", "Control", "LocalControl", "SimulatedControl", "control_for", "simulated_hosts"]


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (the call that would otherwise hang)."""


class LocalControl:
    """One rank: every answer is this rank's own."""

    def __init__(self) -> None:
        self.calls = 0

    def agree(self, error: Optional[str], tag: str = "") -> Optional[str]:
        return None if error is None else f"rank 0: {error}"

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "") -> None:
        return None

    def share(self, obj: Any) -> Any:
        return obj

    def exchange(self, obj: Any) -> List[Any]:
        return [obj]

    def hosts(self) -> Tuple[List[str], List[Optional[int]]]:
        host, lws = _mine()
        return [host], [lws]

    def check(self, kind: str, tag: str, numel: int) -> None:
        self.calls += 1

    def release_groups(self) -> None:
        """At exit (engine/exit.py, through its Comm): drop the process group, if any."""

    def read(self, flag: torch.Tensor) -> float:
        """The value of a one-element tensor this rank decides on (the fp16 overflow flag, already all-reduced)."""
        return flag.item()

    def read_flags(self, flags: torch.Tensor, local: List[bool]) -> List[bool]:
        """The values of a 0/1 tensor this rank decides on (already all-reduced with MAX; `local`: this rank's
        own flags before the reduction)."""
        return [v > 0 for v in flags.tolist()]


class Control(LocalControl):
    """Over a process group of several ranks (`global_ranks`: its members, in group-rank order). `debug`: compare
    every data collective's fingerprint through the default store under `prefix` before it is issued."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, global_ranks: List[int], debug: bool = False,
                 debug_timeout_s: float = 120, prefix: str = "") -> None:
        super().__init__()
        self.group, self.rank, self.global_ranks = group, rank, global_ranks
        self.world_size = len(global_ranks)
        self.debug, self.debug_timeout, self.prefix = debug, timedelta(seconds=debug_timeout_s), prefix

    def release_groups(self) -> None:
        # its Comm's group: held here too, it kept e.g. hpZ's host group, and its gloo threads, into finalization
        self.group = None

    def agree(self, error: Optional[str], tag: str = "") -> Optional[str]:
        self.check("all_gather_object", tag, 1)
        errors = self.exchange(error)
        return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "") -> None:
        self.check("broadcast", tag, tensor.numel())
        dist.broadcast(tensor, self.global_ranks[src], group=self.group)

    def share(self, obj: Any) -> Any:
        box = [obj]  # a broadcast: an all-gather would pad every rank's part to rank 0's size
        dist.broadcast_object_list(box, src=self.global_ranks[0], group=self.group)
        return box[0]

    def exchange(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def hosts(self) -> Tuple[List[str], List[Optional[int]]]:
        everyone = self.exchange(_mine())
        return [h for h, _ in everyone], [k for _, k in everyone]

    def check(self, kind: str, tag: str, numel: int) -> None:
        """Compare this call's fingerprint with every other rank's through the store; raise on a difference."""
        self.calls += 1
        if not self.debug:
            return
        store = dist.distributed_c10d._get_default_store()
        desc = f"#{self.calls} {kind} of {numel} elements for {tag}"
        store.set(f"{self.prefix}/{self.calls}/{self.rank}", desc)
        others = [f"{self.prefix}/{self.calls}/{r}" for r in range(self.world_size) if r != self.rank]
        try:
            store.wait(others, self.debug_timeout)
        except Exception as exc:  # a rank never reached this call: it ran fewer collectives
            raise CollectiveMismatchError(
                f"rank {self.rank} issued collective {desc}, but another rank did not issue collective #{self.calls} "
                f"within {self.debug_timeout.total_seconds():.0f}s: ranks ran a different number of forwards/backwards "
                f"(stage 3: wrap uneven work such as generate() in engine.gathered_parameters())"
            ) from exc
        for key in others:
            theirs = store.get(key).decode()
            if theirs.split(" ", 1)[1] != desc.split(" ", 1)[1]:
                other = key.rsplit('/', 1)[1]
                units = [_unit_of(d) for d in (desc, theirs)]
                hint = (f" Rank {self.rank} was gathering unit {units[0]} and rank {other} unit {units[1]}: one of "
                        f"them skipped or repeated a unit (a module that runs on some ranks only)."
                        if all(units) else "")
                raise CollectiveMismatchError(
                    f"collective mismatch: rank {self.rank} issued {desc} but rank {other} issued {theirs}.{hint} "
                    f"Ranks must run the same modules in the same order (stage 3: use engine.gathered_parameters() "
                    f"around uneven work)"
                )


class SimulatedControl(LocalControl):
    """A dry run's world of `world_size` ranks of which only `rank` runs: every other rank is taken to do what this
    one does (the same errors, the same objects), and the world runs in hosts of `ranks_per_host` consecutive
    ranks. Nothing is read from another rank, so nothing waits on a value a fake tensor does not have."""

    def __init__(self, rank: int, world_size: int, ranks_per_host: int) -> None:
        super().__init__()
        self.rank, self.world_size, self.ranks_per_host = rank, world_size, ranks_per_host

    def agree(self, error: Optional[str], tag: str = "") -> Optional[str]:
        self.check("all_gather_object", tag, 1)
        return None if error is None else f"rank {self.rank}: {error}"

    def exchange(self, obj: Any) -> List[Any]:
        return [obj] * self.world_size

    def read(self, flag: torch.Tensor) -> float:
        return 0.0  # a fake tensor has no value: the dry run takes the path of a step without overflow

    def read_flags(self, flags: torch.Tensor, local: List[bool]) -> List[bool]:
        return list(local)  # every rank does what this one does: the MAX over ranks is this rank's own

    def hosts(self) -> Tuple[List[str], List[Optional[int]]]:
        k = self.ranks_per_host
        return [f"host{r // k}" for r in range(self.world_size)], [k] * self.world_size


_RANKS_PER_HOST: ContextVar[Optional[int]] = ContextVar("hf_zero_simulated_ranks_per_host", default=None)


@contextlib.contextmanager
def simulated_hosts(ranks_per_host: int) -> Iterator[None]:
    """Inside the block, engines built over torch's `fake` backend take the world to run in hosts of
    `ranks_per_host` consecutive ranks (default outside it: one host)."""
    token = _RANKS_PER_HOST.set(ranks_per_host)
    try:
        yield
    finally:
        _RANKS_PER_HOST.reset(token)


def control_for(group: Optional[dist.ProcessGroup], debug: bool = False, debug_timeout_s: float = 120,
                prefix: str = "") -> LocalControl:
    """The control plane over `group` (default: the world): `Control` when there are other ranks, a
    `SimulatedControl` when they are simulated (torch's `fake` backend), else local."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return LocalControl()
    n = dist.get_world_size(group)
    if dist.get_backend(group) == "fake":
        world = dist.get_world_size()
        return SimulatedControl(dist.get_rank(group), n, min(_RANKS_PER_HOST.get() or world, n))
    ranks = [dist.get_global_rank(group, r) for r in range(n)] if group is not None else list(range(n))
    return Control(group, dist.get_rank(group), ranks, debug, debug_timeout_s, prefix)


def _mine() -> Tuple[str, Optional[int]]:
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    return socket.gethostname(), int(lws) if lws and lws.isdigit() else None


def _unit_of(description: str) -> Optional[str]:
    """The stage-3 unit a collective's description names ("... for params of unit NAME"), if any."""
    marker = "for params of unit "
    return description.split(marker, 1)[1] if marker in description else None
