"""The paper's model-state memory and communication formulas (the reference the engine is measured against).

Per element of Ψ (trainable parameters), a recipe holds: compute parameters (P bytes), gradients (G), a master
copy (M; 0 when the parameters are the master, as in pure fp32) and optimizer states (K_opt). Per rank:

    stage 0: (P + G + M + K_opt) Ψ
    stage 1: (P + G) Ψ + (M + K_opt) Ψ / N
    stage 2: P Ψ + (G + M + K_opt) Ψ / N
    stage 3: (P + G + M + K_opt) Ψ / N

The paper's mixed-precision Adam is P = G = 2, M + K_opt = K = 12: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.

Frozen parameters (Ψ_f: a LoRA base, a frozen tower) hold only their compute copy, P Ψ_f per rank at stages 0-2
and P Ψ_f / N at stage 3, and are never communicated at stages 0-2; at stage 3 they are all-gathered for compute
like the trainable ones (forward and backward) and never reduced.
hf_zero accumulates gradients in fp32 by default (grad_accum_dtype="fp32", G = 4), which the same formula
covers; grad_accum_dtype="compute" reproduces the paper's numbers exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter element of each model state."""

    param: int
    grad: int
    master: int
    optim: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.master + self.optim


_DTYPE_BYTES = {"no": 4, "fp32": 4, "bf16": 2, "fp16": 2}


def recipe(mixed_precision: str = "bf16", grad_accum_dtype: str = "compute", optimizer_states: int = 2) -> Recipe:
    """The recipe hf_zero runs for these settings; `optimizer_states` fp32 tensors per parameter (Adam: 2)."""
    p = _DTYPE_BYTES[mixed_precision]
    g = 4 if grad_accum_dtype == "fp32" else p
    master = 4 if p != 4 else 0  # pure fp32: the parameters are the master weights
    return Recipe(param=p, grad=g, master=master, optim=4 * optimizer_states)


PAPER = Recipe(param=2, grad=2, master=4, optim=8)  # mixed-precision Adam, K = 12


def model_state_bytes(psi: float, n: int, stage: int, r: Recipe = PAPER, frozen: float = 0) -> float:
    """Model-state bytes per rank for Ψ trainable and `frozen` frozen elements on N ranks (no padding)."""
    if stage == 0:
        return r.total * psi + r.param * frozen
    if stage == 1:
        return (r.param + r.grad) * psi + (r.master + r.optim) * psi / n + r.param * frozen
    if stage == 2:
        return r.param * psi + (r.grad + r.master + r.optim) * psi / n + r.param * frozen
    if stage == 3:
        return (r.total * psi + r.param * frozen) / n
    raise ValueError(f"stage must be 0-3, got {stage}")


def paper_table(psi: float, n: int, k: int = 12) -> Dict[int, float]:
    """Bytes per device for stages 0-3 with the paper's 2 + 2 + K recipe (Ψ = 7.5e9, N = 64: 120, 31.4, 16.6, 1.9 GB)."""
    r = Recipe(param=2, grad=2, master=0, optim=k)
    return {stage: model_state_bytes(psi, n, stage, r) for stage in range(4)}


def comm_elements_per_step(psi: float, stage: int, micro_batches: int = 1, resident: float = 0,
                           frozen: float = 0) -> Dict[str, float]:
    """Elements each rank sends per optimizer step (paper counting: all-gather / reduce-scatter Ψ, all-reduce 2Ψ).

    `resident`: stage-3 elements that stay gathered from forward to backward (hf_zero's root unit), which are
    all-gathered once per micro-batch instead of twice: all-gather m(2(Ψ + Ψ_f) - resident). `frozen` (Ψ_f) adds
    to stage 3's all-gathers only: frozen weights are never reduced, and at stages 0-2 never sent at all.
    """
    m = micro_batches
    if stage == 0:
        return {"all_reduce": 2 * psi}
    if stage == 1:
        return {"reduce_scatter": psi, "all_gather": psi}
    if stage == 2:
        return {"reduce_scatter": m * psi, "all_gather": psi}
    if stage == 3:
        return {"reduce_scatter": m * psi, "all_gather": m * (2 * (psi + frozen) - resident)}
    raise ValueError(f"stage must be 0-3, got {stage}")


# ------------------------------------------------------------------------------------------ hierarchical options
# N ranks in hosts of K consecutive ranks (N = H K). Counting per rank and step, paper counting as above, and a
# collective's elements are booked "intra" when its group lies inside one host and "inter" when the group spans
# hosts. That is the ring algorithm's view (NCCL's default for large messages, gloo's all-reduce): every link of
# the ring carries the full per-rank volume, so a ring that leaves the host is as slow as its inter-host link.
#
#   plain stage 3 over N:      intra 0,  inter m(2Ψ' - r) + mΨ           (Ψ' = Ψ + Ψ_f, r = resident root)
#   hpZ (secondary over K):    intra m(Ψ' - r) (backward all-gather),  inter mΨ' (forward all-gather) + mΨ
#   HSDP (partition over K):   intra everything the plain stage sends over K ranks,  inter the all-reduce of
#                              the Ψ/K gradient shard across the H replicas: 2Ψ/K per reduction (m at stages
#                              2/3, once at stage 1)
#
# Memory per rank: HSDP is the plain stage with N replaced by K; hpZ is plain stage 3 plus the secondary shard,
# P (Ψ' - r) / K bytes while the units wait for their backward (between the forward and the backward).
# K = 1 or K = N turns either option off (the engine runs the plain stage: engine/topology.py); HSDP needs stage
# 1-3, hpZ stage 3 (ZeroConfig's rules).

def _effective_option(n: int, k: int, stage: int, option: str) -> str:
    """`option` as the engine runs it (engine/topology.py): K = 1 or K = N is the plain stage. Raises for a K that
    does not divide N and for an option the stage does not have (ZeroConfig's rules)."""
    if option not in ("none", "hsdp", "hpz"):
        raise ValueError(f"option must be none, hsdp or hpz, got {option!r}")
    if k < 1 or n % k:
        raise ValueError(f"K={k} must divide N={n}")
    if option == "hpz" and stage != 3:
        raise ValueError("hpZ is a stage-3 option")
    if option == "hsdp" and stage == 0:
        raise ValueError("HSDP is a stage 1-3 option (stage 0 partitions nothing)")
    return "none" if k in (1, n) else option


def hierarchical_comm_elements(psi: float, n: int, k: int, stage: int, option: str = "none", micro_batches: int = 1,
                               resident: float = 0, frozen: float = 0) -> Dict[str, Dict[str, float]]:
    """{"intra": {kind: elements}, "inter": {kind: elements}} per rank and step for N ranks in hosts of K.

    `option`: "none" (the plain stage over N), "hsdp" (shard_group_size=K) or "hpz" (hpz_partition_size=K, stage
    3). With one host (K = N) everything is intra-host; K = 1 or K = N turns the options off (the plain stage).
    """
    option = _effective_option(n, k, stage, option)
    m = micro_batches
    if option == "hsdp":
        inside = comm_elements_per_step(psi, stage, m, resident, frozen)  # the plain stage over the K-rank group
        reductions = 1 if stage == 1 else m
        return {"intra": inside, "inter": {"all_reduce": reductions * 2 * psi / k}}
    plain = comm_elements_per_step(psi, stage, m, resident, frozen)
    if option == "hpz":
        forward = m * (psi + frozen)
        backward = m * (psi + frozen - resident)
        return {"intra": {"all_gather": backward},
                "inter": {"reduce_scatter": plain["reduce_scatter"], "all_gather": forward}}
    return {"intra": plain, "inter": {}} if n == k else {"intra": {}, "inter": plain}


def hierarchical_state_bytes(psi: float, n: int, k: int, stage: int, option: str = "none", r: Recipe = PAPER,
                             frozen: float = 0, resident: float = 0) -> float:
    """Model-state bytes per rank (no padding): HSDP partitions K ways; hpZ adds the secondary parameter shard
    P (Ψ' - resident) / K held between a unit's forward and its backward."""
    option = _effective_option(n, k, stage, option)
    if option == "hsdp":
        return model_state_bytes(psi, k, stage, r, frozen)
    if option == "hpz":
        return model_state_bytes(psi, n, 3, r, frozen) + r.param * (psi + frozen - resident) / k
    return model_state_bytes(psi, n, stage, r, frozen)
