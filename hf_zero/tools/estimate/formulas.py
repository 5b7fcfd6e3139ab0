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

Multiple hosts: `hierarchical_comm_elements` / `hierarchical_state_bytes` (HSDP, hpZ), and ZeRO++'s quantized
communication in bytes, intra- and inter-host, next to its paper's figures: `zeropp_bytes_per_step`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ...engine.quantize import quantized_nbytes
from ...options import BY_NAME


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


def model_state_bytes(psi: float, n: int, stage: int, r: Recipe = PAPER, frozen: float = 0,
                      frozen_block: Optional[int] = None) -> float:
    """Model-state bytes per rank for Ψ trainable and `frozen` frozen elements on N ranks (no padding).
    `frozen_block` (stage 3, quantized_frozen_weights): frozen shards as int8 codes plus an fp32 scale per block."""
    if stage == 3 and frozen_block is not None:
        return r.total * psi / n + (frozen / n) * (1 + 4 / frozen_block)
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
    if option not in BY_NAME["hierarchy"].kind.values:
        raise ValueError(f"option must be {BY_NAME['hierarchy'].kind.allowed()}, got {option!r}")
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


# ------------------------------------------------------------------------------------------------------- ZeRO++
# ZeRO++ (Wang et al. 2023, arXiv 2306.10209) in bytes per rank and optimizer step, booked as the engine's ledger
# books them: a collective whose group spans hosts entirely inter-host, one inside a host intra-host; an
# all-gather or reduce-scatter of P elements over W ranks sends P x dtype bytes, or quantized W x
# quantized_nbytes(P / W) (the codes plus one fp32 scale per block of each rank's chunk: blocks never straddle
# two ranks' chunks). Per micro-batch at stage 3: forward all-gather Ψ over N, backward all-gather Ψ - r over N
# (r: the root unit, gathered from forward to backward), gradient reduce-scatter Ψ over N; stage 2: the
# reduce-scatter per micro-batch and one all-gather of the updated parameters per step.
#
#   hpZ (K):    the backward all-gather over the host's K ranks, intra-host, in the compute dtype (also with qwZ)
#   qwZ (bits): the forward all-gather and the backward all-gather over N quantized
#   qgZ (bits): the reduce-scatter quantized; with hosts of 1 < K < N ranks in two hops: an all-to-all inside the
#               host over all P elements (intra, K rows of P/K: K quantized_nbytes(P/K)), then an all-to-all of
#               the host-summed P/K elements among the N/K ranks of the same local index (inter, (N/K)
#               quantized_nbytes(P/N)); one hop, N quantized_nbytes(P/N), when K = 1 (inter) or K = N (intra)
#   HSDP (K):   the plain stage over the host's K ranks (intra) and the all-reduce of the Ψ/K gradient shard
#               across the N/K replicas (inter, 2Ψ/K x dtype per reduction); not combined with quantization here
#
# The per-rank count is the ledger's. The paper counts the bytes that cross a host's boundary instead: for a ring
# over a group holding all K ranks of each host, one link per host carries the per-rank volume; a group holding one
# rank per host (qgZ's second hop, HSDP's replica all-reduce) runs K times side by side, so a host sends K times the
# per-rank volume (`inter_bytes_per_host`). Both agree for everything but those two.

DEFAULT_BLOCK_SIZE = BY_NAME["quantization_block_size"].default  # elements per fp32 scale

# The paper's cross-host volume per step in units of M, the model's fp16 bytes (2Ψ), per host (Wang et al. 2023,
# arXiv 2306.10209, "Communication volume" of the ZeRO++ section): ZeRO-3 3M = forward all-gather M + backward
# all-gather M + gradient reduce-scatter M; ZeRO++ 0.75M = qwZ's int8 forward all-gather 0.5M + hpZ's backward
# all-gather inside the node 0 + qgZ's int4 gradients 0.25M. The paper gives no total for the other combinations.
PAPER_ZEROPP_INTER_M: Dict[str, float] = {"stage 3": 3.0, "stage 3 hpZ + qwZ + qgZ": 0.75}

# The rows of `hf-zero estimate --zeropp`: label -> (stage, options) for zeropp_bytes_per_step; "W" / "G" stand for
# the weights' and the gradients' code widths the command line was given (int8 / int4 by default, the paper's).
ZEROPP_COMBINATIONS: Dict[str, Tuple[int, Dict[str, object]]] = {
    "stage 3": (3, {}),
    "stage 3 hpZ": (3, {"hpz": True}),
    "stage 3 qwZ": (3, {"weights_bits": "W"}),
    "stage 3 hpZ + qwZ": (3, {"hpz": True, "weights_bits": "W"}),
    "stage 3 hpZ + qwZ + qgZ": (3, {"hpz": True, "weights_bits": "W", "gradients_bits": "G"}),
    "stage 3 qgZ": (3, {"gradients_bits": "G"}),
    "stage 3 HSDP": (3, {"hsdp": True}),
    "stage 2": (2, {}),
    "stage 2 qgZ": (2, {"gradients_bits": "G"}),
}


@dataclass(frozen=True)
class Collective:
    """One collective of a step as the ledger books it: `nbytes` per rank over the step's micro-batches, on `side`
    ("intra" or "inter"), over a group holding `host_ranks` of each host's K ranks (K for a group over all N ranks
    or inside one host, 1 for a group of one rank per host)."""

    what: str
    side: str
    nbytes: float
    host_ranks: int


def _quantized_bytes(elements: float, world: int, block_size: int, bits: int) -> int:
    """W x quantized_nbytes(P / W): each of the W ranks' chunks quantized on its own. A P / W that is not whole is
    rounded up (the engine pads every flat group to a multiple of the world size)."""
    chunk = math.ceil(elements / world) if elements > 0 else 0
    return world * quantized_nbytes(int(chunk), block_size, bits)


def zeropp_collectives(psi: float, n: int, k: int, stage: int, *, hpz: bool = False, hsdp: bool = False,
                       weights_bits: Optional[int] = None, gradients_bits: Optional[int] = None,
                       block_size: int = DEFAULT_BLOCK_SIZE, dtype_bytes: int = 2,
                       reduce_dtype_bytes: Optional[int] = None, micro_batches: int = 1,
                       resident: float = 0) -> List[Collective]:
    """The collectives of one optimizer step of stage 2 or 3 with ZeRO++'s options, per rank, booked as the
    ledger books them (see the comment above `DEFAULT_BLOCK_SIZE`). Arguments as `zeropp_bytes_per_step`."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO++'s options are for stages 2-3, got stage {stage} (hierarchical_comm_elements "
                         f"counts stages 0-1)")
    for name, bits in (("weights_bits", weights_bits), ("gradients_bits", gradients_bits)):
        if bits not in (None, 8, 4):
            raise ValueError(f"{name} must be None (off), 8 or 4, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")
    if weights_bits is not None and stage != 3:
        raise ValueError("qwZ (weights_bits) quantizes the stage-3 parameter all-gather: it needs stage 3")
    if hpz and hsdp:
        raise ValueError("hpZ and HSDP are alternatives: give one of them")
    if hsdp and (weights_bits is not None or gradients_bits is not None):
        raise ValueError("HSDP is counted here without quantization (the reference row)")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    if not 0 <= resident <= psi:
        raise ValueError(f"resident={resident} must be in [0, psi={psi}]")
    option = _effective_option(n, k, stage, "hpz" if hpz else "hsdp" if hsdp else "none")
    m, gather_b = micro_batches, dtype_bytes
    reduce_b = dtype_bytes if reduce_dtype_bytes is None else reduce_dtype_bytes
    spans = "intra" if n == k else "inter"  # a group over all N ranks spans hosts unless there is one host

    def gather(elements: float, world: int, bits: Optional[int]) -> float:
        return m * (_quantized_bytes(elements, world, block_size, bits) if bits else elements * gather_b)

    if option == "hsdp":  # the plain stage inside the host, the gradient shard's all-reduce across the replicas
        inside = [Collective(c.what, "intra", c.nbytes, k)
                  for c in zeropp_collectives(psi, k, k, stage, dtype_bytes=dtype_bytes, reduce_dtype_bytes=reduce_b,
                                              micro_batches=m, resident=resident)]
        return inside + [Collective("replica all-reduce", "inter", m * 2 * psi / k * reduce_b, 1)]
    out: List[Collective] = []
    if stage == 3:
        out.append(Collective("forward all-gather", spans, gather(psi, n, weights_bits), k))
        if option == "hpz":  # from the host's secondary shard, in the compute dtype even under qwZ
            out.append(Collective("backward all-gather", "intra", gather(psi - resident, k, None), k))
        else:
            out.append(Collective("backward all-gather", spans, gather(psi - resident, n, weights_bits), k))
    else:  # stage 2: the updated parameters, once per step
        out.append(Collective("parameter all-gather", spans, psi * gather_b, k))
    if gradients_bits is None:
        out.append(Collective("reduce-scatter", spans, m * psi * reduce_b, k))
    elif 1 < k < n:  # qgZ's two hops
        chunk = _quantized_bytes(psi, n, block_size, gradients_bits) // n  # quantized_nbytes(P / N)
        # hop 1 is a quantized reduce-scatter over the host's K ranks: K rows of P/K (engine HostsReduce)
        out.append(Collective("qgZ all-to-all in host", "intra", m * _quantized_bytes(psi, k, block_size,
                                                                                        gradients_bits), k))
        out.append(Collective("qgZ all-to-all across hosts", "inter", m * (n // k) * chunk, 1))
    else:
        out.append(Collective("qgZ all-to-all", spans, m * _quantized_bytes(psi, n, block_size, gradients_bits), k))
    return out


def zeropp_bytes_per_step(psi: float, n: int, k: int, stage: int, *, hpz: bool = False, hsdp: bool = False,
                          weights_bits: Optional[int] = None, gradients_bits: Optional[int] = None,
                          block_size: int = DEFAULT_BLOCK_SIZE, dtype_bytes: int = 2,
                          reduce_dtype_bytes: Optional[int] = None, micro_batches: int = 1,
                          resident: float = 0) -> Dict[str, float]:
    """{"intra": bytes, "inter": bytes} one rank sends per optimizer step, as the engine's ledger books them.

    Ψ (`psi`) trainable elements on N ranks in hosts of K (K divides N; K = 1 or K = N turns hpZ and HSDP off, as
    the engine does), `stage` 2 or 3. `hpz`: hpz_partition_size=K (stage 3); `hsdp`: shard_group_size=K (the
    reference, unquantized); `weights_bits` (qwZ, stage 3) / `gradients_bits` (qgZ): None (off), 8 or 4, with one
    fp32 scale per `block_size` elements. `dtype_bytes`: the all-gathers' element size (the compute dtype);
    `reduce_dtype_bytes`: the reductions' (default: the same). `micro_batches`: stage 3 gathers and both stages
    reduce once per micro-batch. `resident`: stage-3 elements that stay gathered from forward to backward (the
    root unit), not gathered again in the backward. No padding, except that a quantized chunk P / W is rounded up
    to a whole element.

    Plain stage 3 sends 3Ψ x 2 bytes = 3M inter-host in fp16 (M = 2Ψ); hpZ + qwZ (int8) + qgZ (int4) with blocks
    of 256 sends Ψ(1 + 4/256) (the forward all-gather) + (Ψ/K)(1/2 + 4/256) (qgZ's second hop) per rank: 0.540M at
    K = 8, and its hosts send 0.765625M each (`inter_bytes_per_host`), the paper's 0.75M plus the scales.
    """
    out = {"intra": 0.0, "inter": 0.0}
    for c in zeropp_collectives(psi, n, k, stage, hpz=hpz, hsdp=hsdp, weights_bits=weights_bits,
                                gradients_bits=gradients_bits, block_size=block_size, dtype_bytes=dtype_bytes,
                                reduce_dtype_bytes=reduce_dtype_bytes, micro_batches=micro_batches,
                                resident=resident):
        out[c.side] += c.nbytes
    return out


def inter_bytes_per_host(collectives: List[Collective], k: int) -> float:
    """Bytes leaving one host per step (the paper's count): a ring over a group holding all K of a host's ranks
    crosses the host's boundary once with the per-rank volume; a group of one rank per host runs K times side by
    side, so its per-rank volume leaves the host K times (in general K / host_ranks times)."""
    return sum(c.nbytes * k / c.host_ranks for c in collectives if c.side == "inter")
