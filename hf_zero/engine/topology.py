"""Who partitions with whom: the world, the hosts, and the groups of the hierarchical options.

N ranks run in hosts of K consecutive ranks (torchrun and `accelerate launch` number them host by host).

- plain stages: one partition over the whole world.
- HSDP (`shard_group_size=K`, FSDP2's HSDP, DeepSpeed's MiCS): rank r's partition group is the K ranks of its
  host block [K*(r//K), K*(r//K) + K); its replica group holds the ranks with the same index in the other blocks
  (r % K, r % K + K, ...). Shards, gradient shards and optimizer states are split K ways and replicated N/K times;
  all-gathers and reduce-scatters go over the partition group, the gradient shard's all-reduce over the replicas.
- hpZ (`hpz_partition_size=K`, ZeRO++): the partition is the world; the secondary group is the host block, over
  which the backward all-gather runs from a secondary copy of the parameters.

Every group is made by every rank in the same order (torch.distributed.new_group is collective over the world).
Each Comm learns whether its group spans hosts from the hostnames, gathered once, which books the ledger's
inter-host column, and puts its collectives on the wire the way `ZeroConfig.collectives` says
(engine/collectives/). The routes over the groups (plain, HSDP's replicated reduce, hpZ's host-group gather) are
chosen here too, once: `reduce_route`, `gather_route`. Which groups a stage needs is asked of its policies
(policies.py): HSDP splits a partition (none at stage 0), qwZ gathers sharded parameters (stage 3), qgZ quantizes
per-bucket reduce-scatters (stages 2/3).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from ..config import ZeroConfig, ZeroConfigError
from ..options import bits
from .comm import Comm, Ledger, Quantization
from .policies import GradientPolicy, Residency, policies_for
from .routes import ExactSlots, HostGather, HostsReduce, PartitionGather, ReduceRoute, ReplicatedReduce

if TYPE_CHECKING:
    from .planning import GroupPlan

logger = logging.getLogger("hf_zero")


@dataclass
class Topology:
    """The engine's process groups.

    Attributes:
        world: every rank of the engine's group.
        partition: the ranks one shard is split over (the world, or the rank's HSDP group).
        replicas: HSDP: the ranks that hold this rank's shard in the other groups (None otherwise).
        secondary: hpZ: the rank's host group, over which the backward all-gather runs (None otherwise).
        hosts: the hostname of each world rank.
        option: "none", "hsdp" or "hpz"; group_size: K (N for "none").
    """

    world: Comm
    partition: Comm
    replicas: Optional[Comm]
    secondary: Optional[Comm]
    hosts: List[str]
    option: str
    group_size: int
    weights: Optional[Comm] = None  # ZeRO++ qwZ: the partition group, all-gathers block-quantized
    gradients: Optional[Comm] = None  # ZeRO++ qgZ: the partition group, reduce-scatters block-quantized
    frozen: Optional[Comm] = None  # quantized frozen weights: the partition group, gathering packed int8 shards
    hosts_reduce: Optional[HostsReduce] = None  # qgZ over ranks on several hosts of K > 1: two hops

    @property
    def feedback_bytes(self) -> int:
        """Bytes of qgZ's error-feedback residuals (one fp32 residual per gradient group and hop)."""
        stores = {id(q.feedback): q.feedback for c in self.comms() if (q := c.quantization) and q.feedback}
        return sum(f.nbytes for f in stores.values())

    def reduce_route(self, groups: Optional[Sequence["GroupPlan"]] = None,
                     columns: Optional[Dict[int, List[Tuple[int, int]]]] = None) -> ReduceRoute:
        """What gradients are reduce-scattered through: the partition group (quantized under qgZ), or under HSDP
        that group chained to the replicas' all-reduce (never quantized). Under qgZ, given the flat groups' plans
        (`groups`), the parameters `routes.keeps_exact` names (1-D, smaller than a block) are reduced unquantized
        beside the quantized bucket (`ExactSlots`; `columns`: the column chunks of groups larger than a bucket,
        reducer.py's `reduction_columns`); without them every element is quantized."""
        quantized: Optional[ReduceRoute] = self.hosts_reduce if self.hosts_reduce is not None else self.gradients
        if quantized is not None and groups is not None:
            quantized = ExactSlots(quantized, self.partition, groups, self.gradients.quantization.block_size,
                                   columns)
        if self.hosts_reduce is not None:
            return quantized
        partition = quantized or self.partition
        return partition if self.replicas is None else ReplicatedReduce(partition, self.replicas)

    def gather_route(self, reshard_after_forward: bool = True) -> PartitionGather:
        """Where one stage-3 unit's all-gathers come from: the partition group (quantized under qwZ), or under hpZ,
        for a unit that reshards after forward, the host group's slices in the backward (slices of the gathered
        values: under qwZ already quantized, copied exactly)."""
        partition = self.weights or self.partition
        if self.secondary is None or not reshard_after_forward:
            return PartitionGather(partition, self.frozen)
        return HostGather(partition, self.secondary, self.frozen)

    def comms(self) -> List[Comm]:
        """Every Comm of the engine (world first)."""
        two_hops = (self.hosts_reduce.intra, self.hosts_reduce.inter) if self.hosts_reduce is not None else ()
        return [c for c in (self.world, self.partition, self.replicas, self.secondary, self.weights, self.gradients,
                            self.frozen, *two_hops) if c is not None]

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))

    def describe(self) -> str:
        n, k = self.world.world_size, self.group_size
        where = f"{n} ranks on {self.num_hosts} host{'s' if self.num_hosts > 1 else ''}"
        if self.option == "hsdp":
            return f"{where}; HSDP: partitioned over groups of {k}, replicated {n // k}x"
        if self.option == "hpz":
            return f"{where}; hpZ: secondary parameter partition over groups of {k}"
        return where


def _ranks_per_host(name: str, hosts: List[str], local_sizes: List[Optional[int]]) -> int:
    """K for `name="host"`: LOCAL_WORLD_SIZE, checked against the hostnames (blocks of K consecutive ranks, one
    host each)."""
    sizes = set(local_sizes)
    if None in sizes:
        counts = {h: hosts.count(h) for h in hosts}
        sizes = set(counts.values())
        source = "the hostnames"
    else:
        source = "LOCAL_WORLD_SIZE"
    if len(sizes) != 1:
        raise ZeroConfigError(f"{name}='host': the hosts run different numbers of ranks ({source}: {sorted(sizes)}); "
                              f"give {name} as a number of ranks that divides the world size")
    k = sizes.pop()
    for start in range(0, len(hosts), k):
        block = hosts[start:start + k]
        if len(set(block)) > 1:
            raise ZeroConfigError(
                f"{name}='host' takes K={k} ranks per host from {source}, but ranks {start}-{start + k - 1} run on "
                f"hosts {sorted(set(block))}: the ranks are not numbered host by host. Give {name} explicitly.")
    return k


def _resolve(name: str, value: Union[int, str], n: int, hosts: List[str], local_sizes: List[Optional[int]]) -> int:
    k = _ranks_per_host(name, hosts, local_sizes) if value == "host" else int(value)
    if n % k:
        raise ZeroConfigError(f"{name}={value!r} (K={k}) does not divide the world size {n}: each group must hold "
                              f"the same number of ranks. Use a divisor of {n} (the ranks per host), or None.")
    return k


def _blocks(comm: Comm, k: int, config: ZeroConfig, ledger: Ledger, by_host: bool) -> Comm:
    """Make every block's group (all ranks, same order) and return this rank's. by_host: blocks of K consecutive
    ranks; else the strided groups that take one rank of every block (HSDP's replicas)."""
    n, members = comm.world_size, comm.global_ranks
    groups = ([members[s:s + k] for s in range(0, n, k)] if by_host
              else [members[i::k] for i in range(k)])
    mine = None
    for ranks in groups:
        pg = dist.new_group(ranks)
        if members[comm.rank] in ranks:
            mine = pg
    return Comm(mine, debug=config.debug_collectives, ledger=ledger, collectives=config.collectives)


def build_topology(group: Optional[dist.ProcessGroup], config: ZeroConfig) -> Topology:
    """The engine's groups for `config` over `group` (default: the world); K is checked on every rank alike."""
    policies = policies_for(config.stage)
    gradients = policies[0]
    ledger = Ledger()
    world = Comm(group, debug=config.debug_collectives, ledger=ledger, collectives=config.collectives)
    hosts, local_sizes = world.control.hosts()  # one all_gather_object at start
    n = world.world_size
    option, k = "none", n
    hpz_name = "hpz_partition_size" if config.hpz_partition_size is not None else "reshard_after_forward"
    for name, kind, value in (("shard_group_size", "hsdp", config.shard_group_size),
                              (hpz_name, "hpz", config.hpz_size)):
        if value is None or (kind == "hsdp" and not gradients.partitions):  # stage 0: no partition to split
            continue
        k = _resolve(name, value, n, hosts, local_sizes)
        if k in (1, n):
            if world.rank == 0:
                logger.info("hf_zero: %s=%r is K=%d of %d ranks: the plain stage %d", name, value, k, n, config.stage)
            k = n
        else:
            option = kind
    partition, replicas, secondary = world, None, None
    if option == "hsdp":
        partition = _blocks(world, k, config, ledger, by_host=True)
        replicas = _blocks(world, k, config, ledger, by_host=False)
    elif option == "hpz":
        secondary = _blocks(world, k, config, ledger, by_host=True)
    for comm in (world, partition, replicas, secondary):
        if comm is not None:
            comm.spans_hosts = len({hosts[world.global_ranks.index(r)] for r in comm.global_ranks}) > 1
    topo = Topology(world, partition, replicas, secondary, hosts, option, k)
    _quantize(topo, config, local_sizes, policies)
    spanning = [c for c in (partition if option == "hsdp" else None, secondary) if c is not None and c.spans_hosts]
    if spanning and world.rank == 0:
        logger.warning("hf_zero: %s: a group of %d ranks spans hosts, so its all-gathers cross the network; "
                       "K should be the ranks per host ('host')", topo.describe(), k)
    return topo


def _quantize(topo: Topology, config: ZeroConfig, local_sizes: List[Optional[int]],
              policies: Tuple[GradientPolicy, Residency]) -> None:
    """ZeRO++: the partition group's quantized twins for the weight all-gathers of sharded parameters (qwZ) and the
    per-bucket gradient reduce-scatters (qgZ; in two hops when the partition spans hosts of K > 1 ranks), and the
    one that gathers quantized frozen shards. A one-rank partition sends nothing, so qwZ and qgZ quantize nothing
    there. `policies`: the stage's (gradient policy, residency)."""
    gradients, residency = policies
    block = config.quantization_block_size
    if config.quantized_frozen_weights != "none" and residency.sharded:  # the shards are codes: even on one rank
        topo.frozen = topo.partition.sibling(Quantization(bits(config.quantized_frozen_weights), block_size=block))
    if topo.partition.world_size == 1:
        return
    if config.quantized_weights != "none" and residency.sharded:
        topo.weights = topo.partition.sibling(Quantization(bits(config.quantized_weights), block_size=block))
    if config.quantized_gradients == "none" or not gradients.reduces_in_buckets:  # an accumulator is sent exact
        return
    quantized = Quantization(gradients_bits=bits(config.quantized_gradients), block_size=block,
                             error_feedback=config.quantized_error_feedback)
    topo.gradients = topo.partition.sibling(quantized)
    k = _host_size(topo, local_sizes)
    if k is not None:
        intra = _blocks(topo.partition, k, config, topo.world.ledger, by_host=True).sibling(quantized)
        inter = _blocks(topo.partition, k, config, topo.world.ledger, by_host=False).sibling(quantized)
        inter.spans_hosts = True
        topo.hosts_reduce = HostsReduce(intra, inter)


def _host_size(topo: Topology, local_sizes: List[Optional[int]]) -> Optional[int]:
    """K for qgZ's two hops: the ranks per host when the partition (the world: HSDP's groups stay inside a host)
    spans H > 1 hosts of K > 1 consecutive ranks each; None for one hop (one host, one rank per host, or hosts
    that do not hold equal consecutive blocks, which is logged)."""
    if not topo.partition.spans_hosts or topo.partition is not topo.world:
        return None
    try:
        k = _ranks_per_host("quantized_gradients", topo.hosts, local_sizes)
    except ZeroConfigError as exc:
        if topo.world.rank == 0:
            logger.warning("hf_zero: qgZ reduces in one hop across hosts: %s", exc)
        return None
    return k if 1 < k < topo.world.world_size else None
