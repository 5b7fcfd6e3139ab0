"""The estimator's numbers: model-state memory and communication per rank, before buying the hardware.

Two modes (the command line is tools/estimate/cli.py):

- formula mode (``--params PSI``): the paper's closed forms (tools/estimate/formulas.py) for stages 0-3, no model needed;
- plan mode (``--model CONFIG.json|DIR``): the model is built on the meta device from a local config (no weights,
  no download) and hf_zero's own planner (``plan_model``) lays it out, so the bytes are exactly what the engine's
  ``memory_stats()`` reports after the first optimizer step: flat buffers with their padding, the accumulation
  dtype, the master copy and Adam's two fp32 states per owned element plus its 4-byte ``step`` per segment.

``estimate_plan(model_or_config, world_size, config, rank=0)`` is the Python entry point of plan mode.

Multiple hosts (``--ranks-per-host K``): for N ranks in hosts of K, each stage's plain layout, HSDP
(``shard_group_size=K``, stages 1-3) and hpZ (``hpz_partition_size=K``, stage 3) with their memory per rank and their
communication per step split into intra-host and inter-host (formulas.hierarchical_comm_elements). In plan mode
HSDP's memory is the planner's own K-way layout (plan_model over K ranks: the padding of a K-way partition).

ZeRO++ (``--zeropp``): intra- and inter-host bytes per rank and step of stage 3 / stage 2 with hpZ, qwZ, qgZ and
HSDP (formulas.zeropp_collectives), next to the paper's figures; in plan mode summed over the planner's flat groups,
one collective per group as the engine issues them.

Activations (plan mode with ``--batch-size b --seq-len s``): tools/estimate/activations.py (Korthikanti et al.
2022, re-derived per term for the real config), with and without activation checkpointing.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...config import ZeroConfig
from ...engine.planning import GroupPlan, ShardPlan, plan_model
from ...engine.policies import policies_for
from ...engine.quantize import quantized_nbytes
from ...options import bits
from .formulas import (DEFAULT_BLOCK_SIZE, PAPER_ZEROPP_INTER_M, ZEROPP_COMBINATIONS, Collective, Recipe,
                       comm_elements_per_step, hierarchical_comm_elements, hierarchical_state_bytes,
                       inter_bytes_per_host, model_state_bytes, recipe, zeropp_collectives)

STAGES = (0, 1, 2, 3)
MAX_WORLD = 65536
GB = 1e9  # the paper's GB (decimal)
STEP_BYTES = 4  # torch's Adam/AdamW keep `step` as a 0-d float32 tensor per parameter (here: per segment)


# ------------------------------------------------------------------------------------------------- exact plan bytes
def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _accum_dtype(group: GroupPlan, config: ZeroConfig) -> torch.dtype:
    """The gradient accumulator's dtype, as the engine picks it (engine._build_groups)."""
    low = group.dtype.is_floating_point and torch.finfo(group.dtype).bits < 32
    return torch.float32 if (config.grad_accum_dtype == "fp32" and low) else group.dtype


def _master_dtype(group: GroupPlan, config: ZeroConfig) -> torch.dtype:
    return torch.float32 if config.compute_dtype is not None else group.dtype


def _master_separate(group: GroupPlan, config: ZeroConfig) -> bool:
    """The engine keeps a second copy for the master unless dtype and device agree (pure fp32, no offload);
    ZeRO-Offload always keeps its own host copy."""
    return _master_dtype(group, config) != group.dtype or config.offload_optimizer == "cpu"


def _owned(group: GroupPlan, rank: int) -> Tuple[int, int]:
    """(real elements, segments) of `rank`'s owned range: padding excluded, one segment per parameter touched."""
    lo, hi = group.owned_range(rank)
    lo, hi = min(lo, group.numel), min(hi, group.numel)
    if lo >= hi:
        return 0, 0
    starts = [s.offset for s in group.slots]
    first = bisect.bisect_right(starts, lo) - 1
    last = bisect.bisect_right(starts, hi - 1) - 1
    return hi - lo, last - first + 1


def plan_bytes(plan: ShardPlan, config: ZeroConfig, rank: int = 0, optimizer_states: int = 2,
               step_bytes: int = STEP_BYTES) -> Dict[str, int]:
    """Model-state bytes on `rank` for this plan, counted the way ZeroEngine.memory_stats() counts them."""
    out = {"params": 0, "grads": 0, "master": 0, "optimizer_states": 0}
    stage = plan.stage
    quantized_frozen = stage == 3 and config.quantized_frozen_weights == "int8"
    for g in plan.groups:
        e = _elem(g.dtype)
        if quantized_frozen and not g.trainable and g.dtype.is_floating_point:  # int8 codes + fp32 scales
            out["params"] += quantized_nbytes(g.shard_numel, config.quantization_block_size,
                                              bits(config.quantized_frozen_weights))
        else:
            out["params"] += (g.padded_numel if stage < 3 else g.shard_numel) * e
        if not g.trainable:
            continue
        out["grads"] += (g.padded_numel if stage < 2 else g.shard_numel) * _elem(_accum_dtype(g, config))
        me = _elem(_master_dtype(g, config))
        if _master_separate(g, config):
            out["master"] += g.shard_numel * me
        if optimizer_states:
            real, segments = _owned(g, rank)
            out["optimizer_states"] += optimizer_states * real * me + step_bytes * segments
    out["model_states"] = sum(out.values())
    return out


def _groups_key(stage: int) -> Tuple[bool, bool]:
    """What of the stage plan_model's groups depend on: the residency (stage 3 splits and gathers units) and whether
    gradients are reduced in buckets of the reduce dtype, which then cap a trainable group too (stages 2-3)."""
    gradients, residency = policies_for(stage)
    return residency.sharded, gradients.reduces_in_buckets


def _replan(plan: ShardPlan, world_size: int, stage: Optional[int] = None) -> ShardPlan:
    """The same layout on another world size (or stage): plan_model's groups depend on N only through the padding
    and on the stage only through `_groups_key` and the gradient policy's partitioning (none at stage 0)."""
    stage = plan.stage if stage is None else stage
    if _groups_key(stage) != _groups_key(plan.stage):
        raise ValueError(f"stage {plan.stage} and stage {stage} plans have different groups; plan the model again")
    partition = world_size if policies_for(stage)[0].partitions else 1
    groups = []
    for g in plan.groups:
        padded = -(-g.numel // partition) * partition if g.numel else 0
        groups.append(dataclasses.replace(g, padded_numel=padded, shard_numel=padded // partition))
    return ShardPlan(world_size=world_size, partition_size=partition, stage=stage, units=plan.units,
                     groups=groups)


class Planner:
    """plan_model once per kind of groups (`_groups_key`: stages 0-1, stage 2, stage 3; it is the slow part for
    1000-layer models); every other (stage, N) is derived by _replan."""

    def __init__(self, model: nn.Module, config: ZeroConfig) -> None:
        self.model, self.config = model, config
        self._base: Dict[Tuple[bool, bool], ShardPlan] = {}

    def config_for(self, stage: int) -> ZeroConfig:
        frozen = self.config.quantized_frozen_weights if stage == 3 else "none"  # a stage-3 option
        return dataclasses.replace(self.config, stage=stage, quantized_frozen_weights=frozen)

    def plan(self, stage: int, world_size: int) -> ShardPlan:
        key = _groups_key(stage)
        if key not in self._base:
            self._base[key] = plan_model(self.model, 1, self.config_for(stage))
        return _replan(self._base[key], world_size, stage)


def max_over_ranks(plan: ShardPlan, config: ZeroConfig, optimizer_states: int = 2,
                   step_bytes: int = STEP_BYTES) -> Dict[str, int]:
    """The bytes of the rank holding the most model states (ranks differ only in their optimizer states: the last
    ranks own padding, and each rank has one `step` per parameter its range touches). Vectorised over ranks."""
    import numpy as np

    ranks = plan.partition_size
    opt = np.zeros(ranks, dtype=np.int64)
    r = np.arange(ranks, dtype=np.int64)
    for g in plan.groups:
        if not g.trainable or not optimizer_states or g.numel == 0:
            continue
        me = _elem(_master_dtype(g, config))
        if g.padded_numel == g.shard_numel:  # not partitioned: every rank owns everything
            opt += optimizer_states * g.numel * me + step_bytes * len(g.slots)
            continue
        starts = np.array([s.offset for s in g.slots], dtype=np.int64)
        lo = np.minimum(r * g.shard_numel, g.numel)
        hi = np.minimum(lo + g.shard_numel, g.numel)
        real = hi - lo
        first = np.searchsorted(starts, lo, side="right") - 1
        last = np.searchsorted(starts, np.maximum(hi - 1, 0), side="right") - 1
        segments = np.where(real > 0, last - first + 1, 0)
        opt += optimizer_states * me * real + step_bytes * segments
    worst = int(np.argmax(opt))
    out = plan_bytes(plan, config, worst, optimizer_states, step_bytes)
    out["rank"] = worst
    return out


def upper_bound_bytes(plan: ShardPlan, config: ZeroConfig, optimizer_states: int = 2,
                      step_bytes: int = STEP_BYTES) -> int:
    """A cheap bound on any rank's model states (for --fits over many N): rank 0 owns the most real elements of
    every group; count a `step` for every parameter of a group on top (a few KB at most)."""
    b = plan_bytes(plan, config, 0, optimizer_states, step_bytes=0)["model_states"]
    if optimizer_states:
        b += step_bytes * sum(len(g.slots) for g in plan.groups if g.trainable)
    return b


def model_states_per_device(model: nn.Module, config: ZeroConfig, world_sizes: Sequence[int],
                            stages: Sequence[int] = STAGES, planner: Optional[Planner] = None
                            ) -> Dict[int, List[int]]:
    """For each stage, the worst rank's exact model-state bytes at each N of `world_sizes` (what a device must hold
    for them; plot it against N). One planner serves every (stage, N)."""
    planner = planner or Planner(model, config)
    return {stage: [max_over_ranks(planner.plan(stage, n), planner.config_for(stage))["model_states"]
                    for n in world_sizes] for stage in stages}


def as_model(model_or_config: Any) -> nn.Module:
    """An nn.Module as is; a PretrainedConfig or local config path built on the meta device."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    from ...integrations.hf_models import meta_model

    return meta_model(model_or_config)


def estimate_plan(model_or_config: Any, world_size: int, config: Optional[ZeroConfig] = None,
                  rank: int = 0, optimizer_states: int = 2) -> Dict[str, int]:
    """Exact model-state bytes on `rank` (params, grads, master, optimizer_states, model_states), as
    `ZeroEngine.memory_stats()` reports them after the first step of an Adam-like optimizer over every trainable
    parameter. `model_or_config`: an nn.Module (any device, meta included), a PretrainedConfig or a local path."""
    config = config if config is not None else ZeroConfig()
    plan = plan_model(as_model(model_or_config), world_size, config)
    return plan_bytes(plan, config, rank, optimizer_states)


def comm_sizes(plan: ShardPlan) -> Tuple[int, int, int]:
    """(trainable, frozen, resident) padded elements of a plan: what its collectives move (the ledger counts the
    padded flat buffers). The resident ones (trainable and frozen) stay gathered from forward to backward at stage 3:
    the root unit's and those of the units the reshard_after_forward policy keeps (the `resident` of the
    formulas)."""
    trainable = sum(g.padded_numel for g in plan.groups if g.trainable)
    frozen = sum(g.padded_numel for g in plan.groups if not g.trainable)
    resident = sum(plan.groups[i].padded_numel for i in plan.resident_groups())
    return trainable, frozen, resident


def wire_bytes(plan: ShardPlan, config: ZeroConfig) -> Dict[str, int]:
    """Bytes per element of each collective kind, as the engine sends it: all-gathers in the compute dtype;
    reductions (reduce-scatter, all-reduce, HSDP's all-reduce of the gradient shard) in the reduce dtype at
    stages 2/3 (ZeroConfig.reduce_dtype: fp32 by default under bf16/fp16) and in the accumulation dtype at
    stages 0/1 (they reduce their accumulator)."""
    compute = max((_elem(g.dtype) for g in plan.groups), default=4)
    trainable = [g for g in plan.groups if g.trainable]
    if plan.stage >= 2:
        reduce = max((_elem(config.reduce_torch_dtype(g.dtype)) for g in trainable), default=compute)
    else:
        reduce = max((_elem(_accum_dtype(g, config)) for g in trainable), default=compute)
    return {"all_gather": compute, "reduce_scatter": reduce, "all_reduce": reduce}


def plan_report(model: nn.Module, world_size: int, config: ZeroConfig, stages: Sequence[int] = STAGES,
                optimizer_states: int = 2, micro_batches: int = 1,
                planner: Optional["Planner"] = None) -> Dict[str, Any]:
    """Per stage: rank 0 and the max over ranks, padding, the largest unit, buckets and communication."""
    rows = {}
    planner = planner or Planner(model, config)
    for stage in stages:
        cfg = planner.config_for(stage)
        plan = planner.plan(stage, world_size)
        r0 = plan_bytes(plan, cfg, 0, optimizer_states)
        mx = max_over_ranks(plan, cfg, optimizer_states)
        largest = max((sum(plan.groups[i].padded_numel * _elem(plan.groups[i].dtype) for i in u.groups)
                       for u in plan.units), default=0)
        trainable, frozen, root = comm_sizes(plan)
        comm = comm_elements_per_step(trainable, stage, micro_batches, resident=root if stage == 3 else 0,
                                      frozen=frozen)
        wire = wire_bytes(plan, cfg)
        rows[stage] = {
            "rank0": r0, "max": {k: v for k, v in mx.items()}, "padding_elements": plan.padding,
            "groups": len(plan.groups), "units": len(plan.units),
            "largest_unit_bytes": largest,
            "comm_elements": {k: int(v) for k, v in comm.items()},
            "comm_bytes": {k: int(v) * wire[k] for k, v in comm.items()},
        }
    probe = planner.plan(stages[0], world_size)
    return {
        "mode": "plan", "world_size": world_size, "mixed_precision": config.mixed_precision,
        "grad_accum_dtype": config.grad_accum_dtype, "psi": probe.num_trainable, "frozen": probe.num_frozen,
        "reduce_bucket_size": config.reduce_bucket_size, "allgather_bucket_size": config.allgather_bucket_size,
        "stages": rows,
    }


# ------------------------------------------------------------------------------------------------- formula mode
def formula_report(psi: float, world_size: int, r: Recipe, micro_batches: int = 1,
                   stages: Sequence[int] = STAGES, frozen: float = 0,
                   frozen_block: Optional[int] = None) -> Dict[str, Any]:
    """The paper's table for Ψ trainable (and `frozen`) parameters on `world_size` ranks (`frozen_block`: stage 3
    keeps the frozen shards as int8 codes, quantized_frozen_weights)."""
    rows = {}
    for stage in stages:
        comm = comm_elements_per_step(psi, stage, micro_batches, frozen=frozen)
        byte_of = {"all_gather": r.param, "reduce_scatter": r.grad, "all_reduce": r.grad}
        rows[stage] = {
            "model_states": model_state_bytes(psi, world_size, stage, r, frozen, frozen_block),
            "comm_elements": comm,
            "comm_bytes": {k: v * byte_of[k] for k, v in comm.items()},
        }
    return {"mode": "formula", "psi": psi, "frozen": frozen, "world_size": world_size,
            "recipe": dataclasses.asdict(r), "stages": rows}


def formula_recipe(mixed_precision: str, optimizer_k: Optional[int], grad_accum_dtype: str) -> Recipe:
    """The paper's 2 + 2 + K (K = master + optimizer states) when --optimizer-k is given, else hf_zero's recipe."""
    base = recipe(mixed_precision, grad_accum_dtype)
    if optimizer_k is None:
        return base
    master = base.master if base.master <= optimizer_k else 0
    return Recipe(param=base.param, grad=base.grad, master=master, optim=optimizer_k - master)


# ------------------------------------------------------------------------------------------------- multiple hosts
def check_ranks_per_host(n: int, k: int) -> None:
    """Raise ValueError, naming N, K and the fix, unless N ranks split into hosts of K (K divides N)."""
    if k < 1:
        raise ValueError(f"--ranks-per-host must be at least 1, got {k}")
    if k > n:
        raise ValueError(f"--ranks-per-host {k} is more than --num-processes {n}: a host cannot run more ranks "
                         f"than the whole run. Use at most {n} (K = N: one host)")
    if n % k:
        below = max(d for d in range(1, k) if n % d == 0)
        above = next((d for d in range(k + 1, n + 1) if n % d == 0), None)
        near = f"{below}" + (f" or {above}" if above else "")
        raise ValueError(f"--ranks-per-host {k} does not divide --num-processes {n}: every host runs the same "
                         f"number of ranks (N = hosts x K). Use a divisor of {n} (such as {near}), or a "
                         f"--num-processes that is a multiple of {k} (such as {-(-n // k) * k})")


def hierarchical_options(stage: int, n: int, k: int) -> List[str]:
    """The options that differ from the plain stage for N ranks in hosts of K: HSDP at stages 1-3, hpZ at stage 3,
    both only for 1 < K < N (the engine runs K = 1 or K = N as the plain stage)."""
    if not 1 < k < n:
        return ["none"]
    return ["none"] + (["hsdp"] if stage >= 1 else []) + (["hpz"] if stage == 3 else [])


def split_row(model_states: float, comm: Dict[str, Dict[str, float]], byte_of: Dict[str, int]) -> Dict[str, Any]:
    """One (stage, option) row: memory per rank, and elements and bytes per kind on each side of the host
    boundary with their totals."""
    row: Dict[str, Any] = {"model_states": model_states, "comm_elements": comm,
                           "comm_bytes": {side: {kind: v * byte_of[kind] for kind, v in kinds.items()}
                                          for side, kinds in comm.items()}}
    for side in ("intra", "inter"):
        row[f"{side}_elements"] = sum(comm[side].values())
        row[f"{side}_bytes"] = sum(row["comm_bytes"][side].values())
    return row


def hierarchical_formula_report(psi: float, n: int, k: int, r: Recipe, micro_batches: int = 1,
                                stages: Sequence[int] = STAGES, frozen: float = 0) -> Dict[int, Dict[str, Any]]:
    """{stage: {option: row}} from the paper's closed forms (formulas.hierarchical_*; no padding)."""
    check_ranks_per_host(n, k)
    byte_of = {"all_gather": r.param, "reduce_scatter": r.grad, "all_reduce": r.grad}
    return {stage: {option: split_row(
        hierarchical_state_bytes(psi, n, k, stage, option, r, frozen),
        hierarchical_comm_elements(psi, n, k, stage, option, micro_batches, frozen=frozen), byte_of)
        for option in hierarchical_options(stage, n, k)} for stage in stages}


def secondary_bytes(plan: ShardPlan, k: int) -> int:
    """hpZ's secondary parameter shard on each rank: 1/K of every stage-3 unit's padded flat groups, in their compute
    dtype, except those of the units that do not reshard after forward (the root, and by default the last block:
    they stay gathered from forward to backward and keep no slices)."""
    resident = set(plan.resident_groups())
    return sum(g.padded_numel // k * _elem(g.dtype) for g in plan.groups if g.index not in resident)


def _plan_row(planner: "Planner", stage: int, n: int, k: int, option: str, micro_batches: int,
              optimizer_states: int) -> Dict[str, Any]:
    """One plan-mode row: HSDP lays the model out over K ranks (plan_model(model, K, config): the K-way padding),
    the others over N; memory is the worst rank's, communication counts the padded buffers."""
    cfg = planner.config_for(stage)
    partition = k if option == "hsdp" else n
    plan = planner.plan(stage, partition)
    worst = max_over_ranks(plan, cfg, optimizer_states)
    trainable, frozen, root = comm_sizes(plan)
    comm = hierarchical_comm_elements(trainable, n, k, stage, option, micro_batches,
                                      resident=root if stage == 3 else 0, frozen=frozen)
    extra = secondary_bytes(plan, k) if option == "hpz" else 0
    row = split_row(worst["model_states"] + extra, comm, wire_bytes(plan, cfg))
    row.update({"max": worst, "partition_size": plan.partition_size, "secondary_bytes": extra})
    return row


def hierarchical_plan_report(planner: "Planner", n: int, k: int, stages: Sequence[int] = STAGES,
                             micro_batches: int = 1, optimizer_states: int = 2) -> Dict[int, Dict[str, Any]]:
    """{stage: {option: row}} from hf_zero's planner (exact padded sizes; memory: the worst rank, hpZ's secondary
    shard included)."""
    check_ranks_per_host(n, k)
    return {stage: {option: _plan_row(planner, stage, n, k, option, micro_batches, optimizer_states)
                    for option in hierarchical_options(stage, n, k)} for stage in stages}


# ------------------------------------------------------------------------------------------------- ZeRO++
ZEROPP_WORLDS = (64, 1024)  # the paper's scales: 8 and 128 hosts of 8 ranks
ZEROPP_RANKS_PER_HOST = 8


def zeropp_options(options: Dict[str, Any], weights_bits: int, gradients_bits: int) -> Dict[str, Any]:
    """A ZEROPP_COMBINATIONS entry's options with its "W" / "G" placeholders set to the code widths."""
    bits = {"W": weights_bits, "G": gradients_bits}
    return {key: bits.get(value, value) if isinstance(value, str) else value for key, value in options.items()}


def _zeropp_row(collectives: List[Collective], k: int, m_bytes: float, label: str) -> Dict[str, Any]:
    """One row: bytes per rank on each side, bytes leaving a host, both as multiples of M, the paper's figure, and
    the collectives (summed by name, side and group shape)."""
    merged: Dict[Tuple[str, str, int], float] = {}
    for c in collectives:
        merged[c.what, c.side, c.host_ranks] = merged.get((c.what, c.side, c.host_ranks), 0) + c.nbytes
    row: Dict[str, Any] = {side + "_bytes": sum(c.nbytes for c in collectives if c.side == side)
                           for side in ("intra", "inter")}
    row["inter_per_host_bytes"] = inter_bytes_per_host(collectives, k)
    row["inter_m"] = row["inter_bytes"] / m_bytes if m_bytes else 0.0
    row["inter_per_host_m"] = row["inter_per_host_bytes"] / m_bytes if m_bytes else 0.0
    row["paper_inter_m"] = PAPER_ZEROPP_INTER_M.get(label)
    row["collectives"] = [{"what": what, "side": side, "bytes": nbytes, "host_ranks": host_ranks}
                          for (what, side, host_ranks), nbytes in merged.items()]
    return row


def zeropp_formula_report(psi: float, worlds: Sequence[int], k: int, gather_bytes: int = 2, reduce_bytes: int = 2,
                          weights_bits: int = 8, gradients_bits: int = 4, block_size: int = DEFAULT_BLOCK_SIZE,
                          micro_batches: int = 1) -> Dict[str, Any]:
    """{"worlds": {N: {label: row}}} for Ψ trainable elements (formulas.zeropp_collectives; no root unit, no
    padding: the paper's count). M = 2Ψ, the model's fp16 bytes."""
    out: Dict[str, Any] = {"mode": "formula", "psi": psi, "m_bytes": 2 * psi, "worlds": {}}
    for n in worlds:
        check_ranks_per_host(n, k)
        out["worlds"][n] = {label: _zeropp_row(zeropp_collectives(
            psi, n, k, stage, block_size=block_size, dtype_bytes=gather_bytes, reduce_dtype_bytes=reduce_bytes,
            micro_batches=micro_batches, **zeropp_options(options, weights_bits, gradients_bits)), k, 2 * psi, label)
            for label, (stage, options) in ZEROPP_COMBINATIONS.items()}
    return out


_REDUCTIONS = ("reduce-scatter", "qgZ all-to-all", "qgZ all-to-all in host", "qgZ all-to-all across hosts",
               "replica all-reduce")


def _plan_collectives(planner: "Planner", stage: int, n: int, k: int, options: Dict[str, Any], block_size: int,
                      micro_batches: int) -> List[Collective]:
    """One combination from the planner: every flat group is one collective per phase (the engine's), with its
    padded size, its compute dtype for the gathers and the reduce dtype (ZeroConfig.reduce_torch_dtype) for the
    reductions; the groups of units that do not reshard after forward are resident; frozen groups are gathered, never reduced. HSDP lays the
    model out over K ranks."""
    cfg = planner.config_for(stage)
    plan = planner.plan(stage, k if options.get("hsdp") and 1 < k < n else n)
    root = set(plan.resident_groups())
    out: List[Collective] = []
    for g in plan.groups:
        if not g.padded_numel:
            continue
        got = zeropp_collectives(g.padded_numel, n, k, stage, block_size=block_size, dtype_bytes=_elem(g.dtype),
                                 reduce_dtype_bytes=_elem(cfg.reduce_torch_dtype(g.dtype)),
                                 micro_batches=micro_batches, resident=g.padded_numel if g.index in root else 0,
                                 **options)
        out.extend(c for c in got if g.trainable or c.what not in _REDUCTIONS)
    return out


def zeropp_plan_report(planner: "Planner", worlds: Sequence[int], k: int, weights_bits: int = 8,
                       gradients_bits: int = 4, block_size: int = DEFAULT_BLOCK_SIZE,
                       micro_batches: int = 1) -> Dict[str, Any]:
    """zeropp_formula_report's table from hf_zero's planner: padded flat groups, one collective per group and phase,
    hf_zero's dtypes (reductions in fp32 under bf16 unless reduce_dtype="compute"). M = 2Ψ (Ψ: the trainable
    parameters, unpadded)."""
    psi = planner.plan(3, 1).num_trainable
    out: Dict[str, Any] = {"mode": "plan", "psi": psi, "m_bytes": 2 * psi, "worlds": {}}
    for n in worlds:
        check_ranks_per_host(n, k)
        out["worlds"][n] = {label: _zeropp_row(_plan_collectives(
            planner, stage, n, k, zeropp_options(options, weights_bits, gradients_bits), block_size, micro_batches),
            k, 2 * psi, label) for label, (stage, options) in ZEROPP_COMBINATIONS.items()}
    return out


# ------------------------------------------------------------------------------------------------- fits
def _smallest_n(fits) -> Optional[int]:
    """Smallest N in 1..MAX_WORLD with fits(N), assuming fits is monotone in N (more ranks, smaller shards)."""
    if not fits(MAX_WORLD):
        return None
    lo, hi = 1, MAX_WORLD
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def fits_formula(psi: float, r: Recipe, budget_bytes: float, stages: Sequence[int] = STAGES,
                 frozen: float = 0) -> Dict[int, Optional[int]]:
    return {s: _smallest_n(lambda n, s=s: model_state_bytes(psi, n, s, r, frozen) <= budget_bytes) for s in stages}


def fits_plan(model: nn.Module, config: ZeroConfig, budget_bytes: float, stages: Sequence[int] = STAGES,
              optimizer_states: int = 2, planner: Optional["Planner"] = None,
              extra_bytes: float = 0) -> Dict[int, Optional[int]]:
    """Smallest N whose worst rank fits (an upper bound per N, off by at most 4 bytes per parameter tensor).
    `extra_bytes`: memory every rank needs beside its model states whatever N is (the activations' peak)."""
    planner = planner or Planner(model, config)
    room = budget_bytes - extra_bytes
    out = {}
    for stage in stages:
        cfg = planner.config_for(stage)
        out[stage] = None if room <= 0 else _smallest_n(lambda n, stage=stage, cfg=cfg: upper_bound_bytes(
            planner.plan(stage, n), cfg, optimizer_states) <= room)
    return out


def fits_with_activations(model: nn.Module, config: ZeroConfig, budget_bytes: float, activations: Dict[str, Any],
                          stages: Sequence[int] = STAGES, planner: Optional["Planner"] = None
                          ) -> Dict[str, Dict[int, Optional[int]]]:
    """fits_plan with the activations' peak added to every rank, without and with activation checkpointing."""
    return {mode: fits_plan(model, config, budget_bytes, stages, planner=planner,
                            extra_bytes=activations[mode]["peak"])
            for mode in ("no_checkpointing", "checkpointing")}
