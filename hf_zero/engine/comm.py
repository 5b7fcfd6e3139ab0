"""Collectives with a ledger of elements and bytes per kind, async handles, and an optional mismatch check.

Counting follows the paper: an all-gather or reduce-scatter of a Ψ-element (full) buffer moves Ψ elements per
rank, an all-reduce 2Ψ. Scalar control traffic (grad norm, fp16 overflow flag) goes to the "control" kind so
the data ledger can be checked against 2Ψ / 3Ψ exactly.

Each kind's elements are also split into intra-host and inter-host: a collective over a group that lies inside
one host is booked intra, one over a group that spans hosts inter (the ring algorithm's view: every link of the
ring carries the full per-rank volume, so a ring that leaves the host runs at the inter-host link's speed). The
engine's several groups (world, HSDP partition and replica groups, hpZ host groups) share one Ledger.

How a collective goes on the wire (flat, per-chunk, ...) is a `Collectives` strategy (engine/collectives/), one per
device type, chosen once from `ZeroConfig.collectives`; Comm adds what every strategy shares: the fingerprint
check and the ledger. The ledger books the logical collective (paper counting) whatever the strategy, and beside
it, per strategy, the bytes the strategy put on the wire (`Ledger.by_strategy`).
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import Chain, Collectives, Handle, Quantization, choose, gloo_device_types, wait_all
from .control import CollectiveMismatchError, control_for
from .exit import hold

__all__ = ["Chain", "CollectiveMismatchError", "Comm", "DATA_KINDS", "Handle", "Ledger", "Quantization",
           "gloo_device_types",
           "wait_all"]

DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


class Ledger:
    """Calls, elements (paper counting) and bytes per collective kind, each split into intra- and inter-host.

    Beside it (`by_strategy`), the same per strategy (`Collectives.name`) and kind, whose bytes are what the
    strategy put on the wire (its `wire_bytes`: the logical bytes for flat and chunked, fewer for a quantizing
    one); "total" per strategy sums its data kinds."""

    KEYS = ("calls", "elements", "bytes", "intra_elements", "inter_elements", "intra_bytes", "inter_bytes")

    def __init__(self) -> None:
        self.reset()

    # a list: every call booked, (kind, elements, bytes, inter)
    trace: Optional[List[Tuple[str, int, int, bool]]] = None

    def reset(self) -> None:
        if self.trace is not None:
            self.trace = []
        self.stats: Dict[str, Dict[str, int]] = defaultdict(_entry)
        self.strategies: Dict[str, Dict[str, Dict[str, int]]] = defaultdict(lambda: defaultdict(_entry))

    def record(self, kind: str, elements: int, element_size: int, inter_host: bool, strategy: str = "",
               wire_bytes: Optional[int] = None) -> None:
        where = "inter" if inter_host else "intra"
        if self.trace is not None:
            self.trace.append((kind, elements, elements * element_size, inter_host))
        _add(self.stats[kind], where, elements, elements * element_size)
        if strategy:
            _add(self.strategies[strategy][kind], where, elements,
                 elements * element_size if wire_bytes is None else wire_bytes)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        return _with_total(self.stats)

    def by_strategy(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """{strategy: {kind: counters, ..., "total": counters of the data kinds}}; bytes as sent."""
        return {name: _with_total(kinds) for name, kinds in self.strategies.items()}


def _entry() -> Dict[str, int]:
    return dict.fromkeys(Ledger.KEYS, 0)


def _add(entry: Dict[str, int], where: str, elements: int, nbytes: int) -> None:
    entry["calls"] += 1
    for prefix in ("", f"{where}_"):
        entry[f"{prefix}elements"] += elements
        entry[f"{prefix}bytes"] += nbytes


def _with_total(stats: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, int]]:
    out = {k: dict(v) for k, v in stats.items()}
    out["total"] = {key: sum(v[key] for k, v in stats.items() if k in DATA_KINDS) for key in Ledger.KEYS}
    return out


class Comm:
    """The process group the engine talks over. Without torch.distributed initialised it is a one-rank world.

    `spans_hosts`: whether the group's ranks run on more than one host (set by the topology; books the ledger's
    inter-host column). `collectives`: how its all-gathers and reduce-scatters go on the wire ("auto", "flat",
    "chunked": engine/collectives/), resolved once per device type (`strategy`)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, debug: bool = False, debug_timeout_s: float = 120,
                 ledger: Optional[Ledger] = None, collectives: str = "auto",
                 quantization: Optional[Quantization] = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.debug = debug and self.distributed and self.world_size > 1
        self._global_ranks = ([dist.get_global_rank(group, r) if group is not None else r
                               for r in range(self.world_size)] if self.distributed else [0])
        # The debug store's keys: the group's name (the same on its members, made by new_group in the same order)
        # and how many Comms this process made over it before (its members make them in the same order), so the
        # calls of two engines over one group never meet, whatever other groups other ranks made.
        self.control = control_for(group, self.debug, debug_timeout_s,
                                   f"hfz/{_store_prefix(group)}" if self.debug else "")
        self.ledger = ledger if ledger is not None else Ledger()
        self.spans_hosts = False
        self.collectives = collectives
        self.quantization = quantization  # ZeRO++: what the strategy quantizes (`sibling`)
        self._debug_timeout_s = debug_timeout_s
        self._strategies: Dict[str, Collectives] = {}
        if group is not None:
            hold(self)  # engine/exit.py releases the group at exit (release_groups)

    def release_groups(self) -> None:
        """At exit (engine/exit.py): drop the group and what holds it (the strategies, the control plane); a
        collective afterwards raises."""
        self.group = None
        self._strategies.clear()
        self.control.release_groups()

    def sibling(self, quantization: Quantization) -> "Comm":
        """A Comm over the same group and ledger whose collectives quantize as `quantization` says: the engine gives
        the collectives that ZeRO++ quantizes (stage-3 weight gathers, gradient reduce-scatters, quantized frozen
        shards) their own Comm, so everything else on the group (checkpoints, exports, the step's gathers) stays
        exact."""
        twin = Comm(self.group, debug=self.debug, debug_timeout_s=self._debug_timeout_s, ledger=self.ledger,
                    collectives=self.collectives, quantization=quantization)
        twin.spans_hosts = self.spans_hosts
        return twin

    def global_rank(self, rank: int) -> int:
        """The global rank of this group's `rank` (what torch.distributed's `src`/`dst` arguments take)."""
        return self._global_ranks[rank]

    # ------------------------------------------------------------------ ledger
    @property
    def global_ranks(self) -> List[int]:
        """The group's members as global ranks, in group-rank order."""
        return list(self._global_ranks)

    def reset_stats(self) -> None:
        self.ledger.reset()

    def _record(self, strategy: Collectives, kind: str, tensor: torch.Tensor, elements: int) -> None:
        if strategy.sends:  # a one-rank world without torch.distributed sends nothing
            self.ledger.record(kind, elements, tensor.element_size(), self.spans_hosts, strategy.name,
                               strategy.wire_bytes(kind, elements, tensor.dtype))

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        return self.ledger.snapshot()

    # ------------------------------------------------------------------ collectives
    def strategy(self, device_type: str) -> Collectives:
        """How this group's collectives on `device_type` tensors go on the wire: chosen on first use, then kept."""
        chosen = self._strategies.get(device_type)
        if chosen is None:
            chosen = self._strategies[device_type] = choose(self.collectives, device_type, self.group, self.rank,
                                                            self._global_ranks, self.distributed, self.quantization)
        return chosen

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "", async_op: bool = True) -> Handle:
        """Concatenate every rank's `inp` into `out` (out.numel() == world * inp.numel()); `inp` may be `out`'s
        own chunk `rank`."""
        strategy = self.strategy(out.device.type)
        self.control.check("all_gather", tag, out.numel())
        self._record(strategy, "all_gather", out, out.numel())
        return strategy.all_gather(out, inp, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "", async_op: bool = True,
                       on_done: Optional[Callable[[], None]] = None) -> Handle:
        """Sum `inp` over ranks and leave chunk `rank` of the sum in `out`.

        `inp` is scratch: afterwards its contents are unspecified (per chunk it is reduced in place). `out` may be
        `inp`'s own chunk `rank`, which saves a copy and a buffer.
        """
        strategy = self.strategy(inp.device.type)
        self.control.check("reduce_scatter", tag, inp.numel())
        self._record(strategy, "reduce_scatter", inp, inp.numel())
        return strategy.reduce_scatter(out, inp, async_op, on_done, tag)

    def all_reduce(self, tensor: torch.Tensor, tag: str = "", async_op: bool = True,
                   on_done: Optional[Callable[[], None]] = None, control: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        """Sum (or `op`) `tensor` over ranks in place; `control=True` books it outside the data ledger."""
        strategy = self.strategy(tensor.device.type)
        self.control.check("all_reduce", tag, tensor.numel())
        self._record(strategy, "control" if control else "all_reduce", tensor, 2 * tensor.numel())
        return strategy.all_reduce(tensor, op, async_op, on_done)

    # ------------------------------------------------------------------ the control plane (engine/control.py)
    def agree(self, error: Optional[str], tag: str = "") -> Optional[str]:
        """Collective: every rank's error (or None); returns "rank r: error" for the first rank that had one, so
        that a failure one rank found is raised on all of them instead of leaving the others to hang."""
        return self.control.agree(error, tag)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "") -> None:
        """Copy rank `src`'s tensor to every rank (used once at start so all ranks begin equal)."""
        self.control.broadcast(tensor, src, tag)


_comms_per_group: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()


def _store_prefix(group: Optional[dist.ProcessGroup]) -> str:
    pg = group if group is not None else dist.group.WORLD
    _comms_per_group[pg] = n = _comms_per_group.get(pg, 0) + 1
    return f"{pg.group_name}/{n}"
