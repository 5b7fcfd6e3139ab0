"""The routes a gradient and a stage-3 parameter take over the engine's groups: plain, HSDP, hpZ, qgZ across hosts.

A route composes Comms (engine/comm.py), each of which puts its collectives on the wire with its own strategy
(engine/collectives/, which sees tensors only); a route sees the flat groups and picks the Comm and the tensors.

Each is chosen once when the engine is built (`Topology.reduce_route` / `gather_route`) over the Comms the topology
made:

- reduce: plain = the partition Comm's reduce-scatter; HSDP (`ReplicatedReduce`) = the reduce-scatter over the
  partition group, then the all-reduce of the owned range over the replicas, chained to its completion; qgZ
  across hosts (`HostsReduce`) = a quantized reduce-scatter inside the host, then one across hosts.
- gather (stage 3, one per unit): plain (`PartitionGather`) = the rank's shard copied into its chunk of the full
  buffer, all-gathered over the partition group (a quantized frozen group: its packed codes, over the Comm whose
  strategy dequantizes them); hpZ (`HostGather`, for a unit that reshards after forward) = the same, but when the
  unit is released after a forward that a backward will follow, `keep` cuts each rank's slice of the gathered
  buffer over its host group; the unit's state holds the slices (SHARDED_POST_FORWARD, engine/unit_state.py) and
  hands them back to `all_gather`, which then runs inside the host, until the unit's backward is done or a step
  changes the shards.

- qgZ's exact slots (`ExactSlots`, around any quantized reduce route): the parameters `keeps_exact` names (1-D ones:
  LayerNorms, biases; and any smaller than one quantization block) are taken out of the bucket and all-reduced
  unquantized over the partition group; the rest of the bucket, zeros in their place, goes through the quantized
  route. Why: a block's scale is its largest element, and a flat group puts a LayerNorm's gradient (often 100x
  smaller) between matrices, so int4 rounded it to zero and the LayerNorm never trained (issue #45). DeepSpeed's qgZ
  also reduces 1-D tensors unquantized. Per-parameter blocks would cost a scale per small tensor and still round
  its small elements away; 1-D tensors are 0.1% of GPT-2 small's elements, 0.004% of Llama-7B's: exact is cheap.

The routes see the flat groups (engine/buffers.py `FlatGroup`: `lo`, `hi`, `shard`, `full`, `plan.padded_numel`;
`quantized`, `packed` for quantized frozen weights; planning.py `GroupPlan.slots`) and the Comms by their attributes
only.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .collectives import Chain, Handle

if TYPE_CHECKING:
    from .buffers import FlatGroup
    from .comm import Comm
    from .planning import GroupPlan


class ReduceRoute(Protocol):
    """What gradients are reduce-scattered through: a Comm or one of the routes below."""

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "",
                       on_done: Optional[Callable[[], None]] = None) -> Handle: ...


class ReplicatedReduce:
    """HSDP: reduce-scatter over the partition group, then all-reduce the owned range over the replicas (the
    ranks holding the same range in the other groups), so the shard holds the sum over all N ranks."""

    def __init__(self, partition: "Comm", replicas: "Comm") -> None:
        self.partition, self.replicas = partition, replicas

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "",
                       on_done: Optional[Callable[[], None]] = None) -> Handle:
        first = self.partition.reduce_scatter(out, inp, tag)
        return Chain(first, lambda: self.replicas.all_reduce(out, f"{tag} across replicas"), on_done)


class HostsReduce:
    """qgZ across hosts (ZeRO++'s hierarchical all-to-all): the quantized reduce-scatter in two hops, first inside
    the host, then across hosts, so only the host's sums leave it (P/K elements of a P-element bucket per rank
    instead of P). Ranks r = h*K + l (host h of H, local index l of K); chunk r of the bucket ends on rank r.

    Hop 1, `intra` (the host's K ranks): the bucket's chunks reordered so that row l' holds the chunks {h'K + l'}
    of every host h', reduce-scattered: local rank l holds its host's sums of the chunks of index l on every host.
    Hop 2, `inter` (the H ranks of local index l, one per host): those H chunks reduce-scattered, so rank h*K + l
    holds chunk h*K + l summed over all N ranks. Both Comms quantize (their strategies are `Quantized`); the
    second hop is issued when the first is waited for (`Chain`), like HSDP's."""

    def __init__(self, intra: "Comm", inter: "Comm") -> None:
        self.intra, self.inter = intra, inter

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "",
                       on_done: Optional[Callable[[], None]] = None) -> Handle:
        hosts, k = self.inter.world_size, self.intra.world_size
        chunk = inp.numel() // (hosts * k)
        by_local = inp.view(hosts, k, chunk).transpose(0, 1).contiguous().view(-1)  # row l': chunks {h'K + l'}
        host_sums = torch.empty(hosts * chunk, dtype=inp.dtype, device=inp.device)
        first = self.intra.reduce_scatter(host_sums, by_local, f"{tag} (inside the host)")
        return Chain(first, lambda: self.inter.reduce_scatter(out, host_sums, f"{tag} (across hosts)"), on_done)


def keeps_exact(shape: Sequence[int], block_size: int) -> bool:
    """qgZ's rule: whether a parameter of `shape` is reduced unquantized. 1-D (and 0-D) ones are, as in DeepSpeed
    (LayerNorm weights, biases: their gradients are orders of magnitude below the matrices' beside them), and so is
    any smaller than one block (it cannot have a block, so a scale, of its own)."""
    return len(shape) <= 1 or math.prod(shape) < block_size


def exact_ranges(plan: "GroupPlan", block_size: int) -> List[Tuple[int, int]]:
    """[start, end) ranges of the flat group that `keeps_exact` keeps out of qgZ (adjacent slots merged)."""
    ranges: List[Tuple[int, int]] = []
    for slot in plan.slots:
        if keeps_exact(slot.shape, block_size) and slot.numel:
            if ranges and ranges[-1][1] == slot.offset:
                ranges[-1] = (ranges[-1][0], slot.offset + slot.numel)
            else:
                ranges.append((slot.offset, slot.offset + slot.numel))
    return ranges


def gradient_tag(plan: "GroupPlan", chunk: Optional[int] = None) -> str:
    """The tag the reducer gives a flat group's gradient reduce-scatter (engine/reducer.py), or that of its column
    chunk `chunk` (a group larger than a bucket): how a route that keeps state per bucket (`ExactSlots`, qgZ's error
    feedback) tells the buckets apart."""
    tag = f"grads of group {plan.index} (unit {plan.unit})"
    return tag if chunk is None else f"{tag}, chunk {chunk}"


def column_chunks(shard_numel: int, partition: int, bucket_elements: int) -> List[Tuple[int, int]]:
    """[c0, c1) column ranges of a flat group seen as [partition, shard_numel] (row r: partition rank r's owned
    range) whose buckets hold at most `bucket_elements`: chunk j is every rank's columns c0..c1, so its
    reduce-scatter leaves each rank its own columns, and the chunks together send exactly the padded group."""
    width = max(1, bucket_elements // partition)
    return [(c, min(c + width, shard_numel)) for c in range(0, shard_numel, width)]


def chunk_ranges(ranges: List[Tuple[int, int]], shard_numel: int, partition: int, c0: int, c1: int
                 ) -> List[Tuple[int, int]]:
    """`ranges` (flat-group coordinates) as they fall in the bucket of column chunk [c0, c1): row r of the bucket
    is the group's [r*S + c0, r*S + c1)."""
    width, out = c1 - c0, []
    for r in range(partition):
        lo, hi = r * shard_numel + c0, r * shard_numel + c1
        for a, b in ranges:
            a, b = max(a, lo), min(b, hi)
            if a < b:
                start = r * width + a - lo
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], start + b - a)
                else:
                    out.append((start, start + b - a))
    return out


class ExactSlots:
    """qgZ with the slots `keeps_exact` names reduced unquantized: the bucket's values there are gathered into one
    short vector and all-reduced over `exact` (the partition group's plain Comm, in the bucket's dtype), zeroed in
    the bucket (int4 codes 0 on the wire; a zero changes no block's scale), and the bucket goes through `quantized`
    (a quantized Comm, or HostsReduce). When both are done, this rank's exact values are written over its chunk
    (an fp16 overflow there stays inf or nan for the loss scaler, as in an unquantized reduce-scatter).

    An all-reduce, not a reduce-scatter: the exact elements are few and unevenly spread over the ranks' chunks, so
    padding every chunk to the fullest would send more. The layout of each group is fixed when the route is built
    (`groups`, the flat groups' plans), and each bucket is known by its reducer tag (`gradient_tag`)."""

    def __init__(self, quantized: ReduceRoute, exact: "Comm", groups: Sequence["GroupPlan"], block_size: int,
                 columns: Optional[Dict[int, List[Tuple[int, int]]]] = None) -> None:
        self.quantized, self.exact = quantized, exact
        self.ranges: Dict[str, List[Tuple[int, int]]] = {}
        for p in groups:
            if not p.trainable:
                continue
            ranges = exact_ranges(p, block_size)
            self.ranges[gradient_tag(p)] = ranges
            partition = p.padded_numel // p.shard_numel if p.shard_numel else 1
            chunks = (columns or {}).get(p.index, ())
            for j, (c0, c1) in enumerate(chunks if len(chunks) > 1 else ()):  # a group reduced in column chunks
                self.ranges[gradient_tag(p, j)] = chunk_ranges(ranges, p.shard_numel, partition, c0, c1)
        self._index: Dict[Tuple[str, str, int], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _positions(self, tag: str, device: torch.device, numel: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(every exact position in the bucket; which of them fall in this rank's chunk; where in the chunk)."""
        key = (tag, str(device), numel)
        if key not in self._index:
            # in Python, once per group: no data-dependent tensor op (nonzero), which fake tensors (the dry run)
            # cannot run; the exact slots are a layer's norms and biases, a few thousand positions
            positions = [i for a, b in self.ranges[tag] for i in range(a, b)]
            n = numel // self.exact.world_size
            lo = self.exact.rank * n
            mine = [k for k, i in enumerate(positions) if lo <= i < lo + n]
            self._index[key] = tuple(torch.tensor(v, dtype=torch.long, device=device)
                                     for v in (positions, mine, [positions[k] - lo for k in mine]))
        return self._index[key]

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "",
                       on_done: Optional[Callable[[], None]] = None) -> Handle:
        if tag not in self.ranges:
            raise ValueError(f"qgZ: no flat group's layout for the reduce-scatter tagged {tag!r} (known: "
                             f"{sorted(self.ranges)[:3]}...): the reducer's tags and routes.gradient_tag differ")
        if not self.ranges[tag]:
            return self.quantized.reduce_scatter(out, inp, tag, on_done=on_done)
        idx, mine, where = self._positions(tag, inp.device, inp.numel())
        flat = inp.view(-1)
        exact = flat.index_select(0, idx)
        flat.index_fill_(0, idx, 0)
        works = [self.exact.all_reduce(exact, f"{tag} (exact slots)"), self.quantized.reduce_scatter(out, inp, tag)]

        def finish() -> None:
            out.view(-1).index_copy_(0, where, exact.index_select(0, mine))
            if on_done is not None:
                on_done()

        return Handle(works, finish)


class PartitionGather:
    """Plain stage 3: a unit's groups all-gathered from every rank's shard over the partition group. Keeps nothing
    after a forward (`keep` returns None). `frozen`: the partition group's Comm whose strategy gathers a packed
    quantized shard (quantized frozen weights: the codes and scales are what the rank keeps)."""

    def __init__(self, comm: "Comm", frozen: Optional["Comm"] = None) -> None:
        self.comm, self.frozen = comm, frozen

    def all_gather(self, group: "FlatGroup", full: torch.Tensor, tag: str,
                   kept: Optional[torch.Tensor] = None) -> Handle:
        if group.quantized:
            return self.frozen.all_gather(full, group.packed, tag)
        local = full[group.lo:group.hi]
        local.copy_(group.shard, non_blocking=True)  # from CPU when parameters are offloaded
        return self.comm.all_gather(full, local, tag)

    def keep(self, group: "FlatGroup") -> Optional[torch.Tensor]:
        """What to keep of a gathered group when it is released after a forward a backward will follow."""
        return None


class HostGather(PartitionGather):
    """hpZ (ZeRO++'s hierarchical partition): `keep` cuts this rank's slice of the gathered group over its host
    group; a gather given that slice (`kept`: the unit's state holds it, SHARDED_POST_FORWARD) runs inside the host."""

    def __init__(self, comm: "Comm", secondary: "Comm", frozen: Optional["Comm"] = None) -> None:
        super().__init__(comm, frozen)
        self.secondary = secondary

    def all_gather(self, group: "FlatGroup", full: torch.Tensor, tag: str,
                   kept: Optional[torch.Tensor] = None) -> Handle:
        if kept is None:
            return super().all_gather(group, full, tag)
        return self.secondary.all_gather(full, kept, f"{tag} (hpZ)")

    def keep(self, group: "FlatGroup") -> Optional[torch.Tensor]:
        size = group.plan.padded_numel // self.secondary.world_size
        j = self.secondary.rank
        return group.full[j * size:(j + 1) * size].clone()
