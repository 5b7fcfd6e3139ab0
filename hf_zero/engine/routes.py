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

The routes see the flat groups (engine/buffers.py `FlatGroup`: `lo`, `hi`, `shard`, `full`, `plan.padded_numel`;
`quantized`, `packed` for quantized frozen weights) and the Comms by their attributes only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from .collectives import Chain, Handle

if TYPE_CHECKING:
    from .buffers import FlatGroup
    from .comm import Comm


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
