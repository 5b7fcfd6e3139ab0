"""The communication formulas a bench row is compared with, per system: elements per kind and step (`paper_comm`:
the paper's count of a stage; `zero_redundancy_comm`; `hf_zero_split`: hf_zero's, its hierarchical option's groups
split intra- and inter-host; `merged`: such a split summed), split for the hosts a run had
(`formula_split_for_hosts`), and bytes on the wire (`formula_bytes_for_hosts`: elements x dtype bytes, or
`quantized_wire_bytes` for ZeRO++'s quantized collectives; on several hosts the estimator's ZeRO++ collectives).
Also the hierarchical systems' K (`resolve_group_size`, `group_size`). The formulas themselves are
hf_zero.tools.estimate.formulas'; this module maps a system (spec.py) and a run onto them.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

from .base import Settings
from .spec import Counts, Split, SystemSpec

RANKS_PER_HOST_FLAG = "--ranks-per-host"


def paper_comm(stage: int) -> Callable[[Counts, Settings], Dict[str, float]]:
    def formula(counts: Counts, settings: Settings) -> Dict[str, float]:
        from ..estimate.formulas import comm_elements_per_step

        return comm_elements_per_step(counts.psi, stage, settings.grad_accum, frozen=counts.frozen)

    return formula


def zero_redundancy_comm(counts: Counts, settings: Settings) -> Dict[str, float]:
    return {"all_reduce": 2 * counts.psi, "broadcast": counts.psi}  # DDP's all-reduce, then each shard broadcast


def resolve_group_size(n: int, k: Optional[int]) -> Tuple[Optional[int], Optional[str]]:
    """(K, None): the group size of the hierarchical systems on N ranks for `--ranks-per-host k` (None: the
    default N//2), or (None, why they cannot run). K = 1 or K = N would quietly be the plain stage (the engine
    turns the option off), so such a row is skipped rather than measured under the option's name."""
    divisors = [d for d in range(2, n) if n % d == 0]
    if not divisors:
        return None, (f"needs {RANKS_PER_HOST_FLAG} K with 1 < K < N dividing N, and N={n} (--num-processes) "
                      f"has no such K")
    usable = f"give {RANKS_PER_HOST_FLAG} K, one of {', '.join(map(str, divisors))}"
    if k is None:
        if n % 2 == 0:
            return n // 2, None
        return None, f"needs {RANKS_PER_HOST_FLAG} K (the default N//2 needs an even N, got N={n}); {usable}"
    if k in (1, n):
        return None, f"{RANKS_PER_HOST_FLAG} {k} with N={n} ranks is the plain stage (K = 1 or K = N); {usable}"
    if n % k:
        return None, f"{RANKS_PER_HOST_FLAG} {k} does not divide N={n} ranks; {usable}"
    return k, None


def group_size(option: str, settings: Settings) -> int:
    """K of a system's groups: N for the plain systems, the resolved --ranks-per-host for the hierarchical ones."""
    if option == "none":
        return settings.num_processes
    k, reason = resolve_group_size(settings.num_processes, settings.ranks_per_host)
    if k is None:
        raise ValueError(reason)
    return k


def hf_zero_split(counts: Counts, settings: Settings, stage: int, option: str, k: int) -> Split:
    from ..estimate.formulas import hierarchical_comm_elements

    return hierarchical_comm_elements(counts.psi, counts.world, k, stage, option, settings.grad_accum,
                                      resident=counts.resident if stage == 3 else 0, frozen=counts.frozen)


def merged(split: Split) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for kinds in split.values():
        for kind, n in kinds.items():
            out[kind] = out.get(kind, 0) + n
    return out


def formula_split_for_hosts(spec: SystemSpec, counts: Counts, settings: Settings,
                            host_size: Optional[int]) -> Optional[Split]:
    """An hf_zero system's formula elements split for the hosts the run had (`host_size` ranks each): on one host
    everything is intra, whatever the option's K; None where the formulas do not cover the layout (hosts of
    another size than the option's groups)."""
    n, k = counts.world, group_size(spec.option, settings)
    if host_size == n:
        return {"intra": spec.comm_formula(counts, settings), "inter": {}}
    if spec.option == "none" and host_size is not None and n % host_size == 0:
        split = hf_zero_split(counts, settings, spec.state_stage, "none", host_size)
    elif host_size == k:
        split = hf_zero_split(counts, settings, spec.state_stage, spec.option, k)
    else:
        return None
    if _two_hop_qgz(spec, n, host_size):
        # qgZ's two hops (engine HostsReduce): the reduce-scatter of P elements inside the host, then of the
        # host's P / K sums across the hosts
        rs = split["inter"].pop("reduce_scatter")
        split["intra"]["reduce_scatter"] = split["intra"].get("reduce_scatter", 0) + rs
        split["inter"]["reduce_scatter"] = rs / host_size
    return split


def _two_hop_qgz(spec: SystemSpec, n: int, host_size: Optional[int]) -> bool:
    """Whether the engine reduces this system's quantized gradients in two hops (inside the host, then across):
    qgZ over the world group (not HSDP's host groups) on hosts of 1 < K < N ranks."""
    quantized = (spec.options or {}).get("quantized_gradients", "none") != "none"
    return quantized and spec.option != "hsdp" and host_size is not None and 1 < host_size < n


_BITS = {"int8": 8, "int4": 4}


def _element_bytes(kind: str, settings: Settings) -> int:
    """Bytes per element hf_zero sends of `kind`: parameters in the compute dtype, gradients in the reduce dtype
    (ZeroConfig's default: fp32, also under mixed precision)."""
    if kind in ("all_gather", "broadcast"):
        return 2 if settings.mixed_precision == "bf16" else 4
    return 4


def quantized_wire_bytes(elements: float, world: int, block_size: int, bits: int) -> float:
    """Bytes on the wire of quantized all-gathers / reduce-scatters of `elements` (paper counting) over `world`
    ranks: each rank's 1/world of them as codes plus one fp32 scale per block, world times (engine/quantize.py's
    `quantized_nbytes`). A formula over a step's total: the engine quantizes per collective, whose blocks and
    padding add a few scales more (at most one block and the padding per rank and collective)."""
    from ...engine.quantize import quantized_nbytes

    return world * quantized_nbytes(math.ceil(elements / world), block_size, bits)


def formula_bytes_for_hosts(spec: SystemSpec, counts: Counts, settings: Settings,
                            host_size: Optional[int]) -> Optional[Split]:
    """An hf_zero system's formula bytes on the wire per step, split as `formula_split_for_hosts` splits its
    elements. Unquantized kinds: elements x their dtype's bytes. A quantized kind (quantized_weights: the
    all-gathers, quantized_gradients: the reduce-scatters) over the world group: `quantized_wire_bytes`, except
    hpZ's backward all-gather inside the host, which copies the already quantized values exactly; on several
    hosts the estimator's ZeRO++ collectives (`_zeropp_bytes`, qgZ's two hops included)."""
    n, k = counts.world, group_size(spec.option, settings)
    opts = spec.options or {}
    block = int(opts.get("quantization_block_size", 256))
    bits = {"all_gather": _BITS.get(opts.get("quantized_weights", "none")),
            "reduce_scatter": _BITS.get(opts.get("quantized_gradients", "none"))}
    over = k if spec.option == "hsdp" else n  # the group the quantized collectives run over

    def nbytes(where: str, kind: str, elements: float) -> float:
        b = bits.get(kind)
        if b is None or (spec.option == "hpz" and kind == "all_gather" and where == "intra" and k != n):
            return elements * _element_bytes(kind, settings)
        return quantized_wire_bytes(elements, over, block, b)

    if spec.options and spec.option != "hsdp" and not counts.frozen and host_size is not None and \
            1 <= host_size < n and n % host_size == 0 and (spec.option == "none" or host_size == k):
        return _zeropp_bytes(spec, counts, settings, host_size, bits, block)
    roles = hf_zero_split(counts, settings, spec.state_stage, spec.option, k)  # the option's own groups
    by_role = {w: {kind: nbytes(w, kind, e) for kind, e in kinds.items()} for w, kinds in roles.items()}
    if host_size == n:
        return {"intra": merged(by_role), "inter": {}}
    if spec.option == "none" and host_size is not None and n % host_size == 0:
        return {"intra": {}, "inter": merged(by_role)}  # the world group spans the hosts
    if host_size == k:
        return by_role
    return None


def _zeropp_bytes(spec: SystemSpec, counts: Counts, settings: Settings, host_size: int,
                  bits: Dict[str, Optional[int]], block: int) -> Split:
    """A quantized system on several hosts of `host_size` ranks: the estimator's ZeRO++ collectives
    (`hf_zero.tools.estimate.formulas.zeropp_collectives`: quantized collectives as W x quantized_nbytes(P / W),
    hpZ's backward all-gather exact inside the host, qgZ in two hops), booked per kind and side as the ledger
    books them (qgZ's all-to-alls are the ledger's reduce-scatters)."""
    from ..estimate.formulas import zeropp_collectives

    stage = spec.state_stage
    collectives = zeropp_collectives(
        counts.psi, counts.world, host_size, stage, hpz=spec.option == "hpz",
        weights_bits=bits["all_gather"] if stage == 3 else None, gradients_bits=bits["reduce_scatter"],
        block_size=block, dtype_bytes=_element_bytes("all_gather", settings),
        reduce_dtype_bytes=_element_bytes("reduce_scatter", settings), micro_batches=settings.grad_accum,
        resident=counts.resident if stage == 3 else 0)
    out: Split = {"intra": {}, "inter": {}}
    for c in collectives:
        kind = "all_gather" if "all-gather" in c.what else "reduce_scatter"
        out[c.side][kind] = out[c.side].get(kind, 0) + c.nbytes
    return out
