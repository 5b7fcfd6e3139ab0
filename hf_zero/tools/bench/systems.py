"""The bench's systems: SYSTEMS, name -> SystemSpec (spec.py) with a builder, in run order (DDP, FSDP2, torch's
ZeroRedundancyOptimizer, hf_zero's stages with their hierarchical, ZeRO++ and collectives variants, DeepSpeed ZeRO-1/2/3
and its ZeRO++; runner.py's docstring says which are in `all`); the recipes and the comm formulas (formulas.py) each
is counted with; `base_system`, the entry a row's name ("zero3+compile") runs. A peer from an optional extra
(DeepSpeed) that cannot be imported says why through its spec's `unavailable`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .base import Settings, Trainer, WorkerContext
from .formulas import (RANKS_PER_HOST_FLAG, group_size, hf_zero_split, merged, paper_comm, resolve_group_size,
                       zero_redundancy_comm)
from .spec import Counts, SystemSpec
from .trainers import DDPTrainer, FSDP2Trainer, HfZeroTrainer, ZeroRedundancyTrainer

HF_ZERO_PREFIX = "zero"  # zero0..zero3 and their variants (zero*-hsdp, -hpz, -flat) are hf_zero: a failure fails
COMPILED = "+compile"  # "<system>+compile": the same system with torch.compile applied after it wraps the model


def base_system(name: str) -> Tuple[str, bool]:
    """("zero3", True) for "zero3+compile": the registry entry a row runs, and whether it is compiled."""
    return (name[:-len(COMPILED)], True) if name.endswith(COMPILED) else (name, False)


# ====================================================================================================== registry
def _fp32_recipe(settings: Settings):
    from ..estimate.formulas import recipe

    return recipe("no")  # fp32 parameters, gradients and Adam states (autocast keeps fp32 weights)


def _hf_zero_recipe(settings: Settings):
    from ...config import ZeroConfig
    from ..estimate.formulas import recipe

    return recipe(settings.mixed_precision, ZeroConfig().grad_accum_dtype)


def _deepspeed_unavailable(settings: Settings) -> Optional[str]:
    from .deepspeed import unavailable_reason

    return unavailable_reason()


def _build_deepspeed(model, ctx: "WorkerContext", stage: int, zero_extra: Optional[Dict[str, Any]] = None) -> Trainer:
    from .deepspeed import DeepSpeedTrainer

    extra = dict(zero_extra or {})
    if extra.get("zero_hpz_partition_size") == "K":  # the hierarchical systems' K (--ranks-per-host / the hosts)
        extra["zero_hpz_partition_size"] = group_size("hpz", ctx.settings)
    return DeepSpeedTrainer(model, ctx, stage, extra)


def _deepspeed_recipe(settings: Settings):
    from ..estimate.formulas import recipe

    return recipe(settings.mixed_precision)  # gradients in the compute dtype, as DeepSpeed keeps them


def _deepspeed_spec(stage: int, zero_extra: Optional[Dict[str, Any]] = None) -> SystemSpec:
    """DeepSpeed ZeRO-`stage`; `zero_extra`: its ZeRO++ keys (zero_hpz_partition_size "K": the hierarchical
    systems' K), such a system is not in `all`."""
    settings = "torch AdamW, hf_zero's bucket bytes" + (", stage3_param_persistence_threshold=0" if stage == 3 else "")
    if zero_extra:
        settings += ", " + ", ".join(f"{k}={v}" for k, v in zero_extra.items())

    def unavailable(s: Settings) -> Optional[str]:
        reason = _deepspeed_unavailable(s)
        if reason is None and (zero_extra or {}).get("zero_hpz_partition_size") == "K":
            reason = resolve_group_size(s.num_processes, s.ranks_per_host)[1]
        if reason is None and any((zero_extra or {}).get(k) for k in ("zero_quantized_weights",
                                                                       "zero_quantized_gradients")):
            from .deepspeed import quantizer_unavailable_reason

            reason = quantizer_unavailable_reason()
        return reason

    return SystemSpec(
        build=lambda model, ctx: _build_deepspeed(model, ctx, stage, zero_extra), state_stage=stage,
        recipe=_deepspeed_recipe, comm_formula=paper_comm(stage), unavailable=unavailable, jit_extensions=True,
        in_all=not zero_extra, options=dict(zero_extra) if zero_extra else None,
        note=f"DeepSpeed ZeRO-{stage} ({settings}); comm counted at torch.distributed (scalars left out)")


def _hf_zero_spec(stage: int, option: str = "none", collectives: str = "auto",
                  options: Optional[Dict[str, Any]] = None) -> SystemSpec:
    """hf_zero at `stage`; the totals of its comm formula use the option's own K (the split is per run's hosts).
    `options`: further ZeroConfig options (the quantized systems)."""
    def build(model, ctx: WorkerContext) -> Trainer:
        return HfZeroTrainer(model, ctx, stage, option, group_size(option, ctx.settings), collectives, options)

    def comm(counts: Counts, settings: Settings) -> Dict[str, float]:
        return merged(hf_zero_split(counts, settings, stage, option, group_size(option, settings)))

    if collectives != "auto":
        form = "per-chunk broadcasts / reduces" if collectives == "chunked" else \
            "all_gather_into_tensor / reduce_scatter_tensor"
        return SystemSpec(build=build, state_stage=stage, recipe=_hf_zero_recipe, comm_formula=comm, hf_zero=True,
                          in_all=False, collectives=collectives,
                          note=f"hf_zero stage {stage}, collectives={collectives!r} ({form})")
    quantized = ", ".join(f"{k}={v!r}" for k, v in (options or {}).items())
    if option == "none":
        if options:
            return SystemSpec(build=build, state_stage=stage, recipe=_hf_zero_recipe, comm_formula=comm,
                              hf_zero=True, in_all=False, options=dict(options),
                              note=f"hf_zero stage {stage}, {quantized}")
        return SystemSpec(build=build, state_stage=stage, recipe=_hf_zero_recipe, comm_formula=comm, hf_zero=True)
    field = "shard_group_size" if option == "hsdp" else "hpz_partition_size"
    return SystemSpec(build=build, state_stage=stage, recipe=_hf_zero_recipe, comm_formula=comm, hf_zero=True,
                      option=option, in_all=False, options=dict(options) if options else None,
                      note=f"hf_zero stage {stage}, {field}=K ({RANKS_PER_HOST_FLAG} K)"
                           + (f", {quantized}" if quantized else ""),
                      unavailable=lambda s: resolve_group_size(s.num_processes, s.ranks_per_host)[1])


# Name -> system. The order is the run order; "ddp" first, it is the reference for the "x DDP" column.
SYSTEMS: Dict[str, SystemSpec] = {
    "ddp": SystemSpec(build=lambda model, ctx: DDPTrainer(model, ctx), state_stage=0, recipe=_fp32_recipe,
                      comm_formula=paper_comm(0)),
    "fsdp2": SystemSpec(build=lambda model, ctx: FSDP2Trainer(model, ctx), state_stage=3, recipe=_fp32_recipe,
                        comm_formula=paper_comm(3)),
    "zero_redundancy_optimizer": SystemSpec(
        build=lambda model, ctx: ZeroRedundancyTrainer(model, ctx), state_stage=1, recipe=_fp32_recipe,
        comm_formula=zero_redundancy_comm, note="comm formula: DDP all-reduce 2Ψ + parameter broadcast Ψ"),
    **{f"zero{k}": _hf_zero_spec(k) for k in range(4)},
    # hf_zero's hierarchical options, over groups of --ranks-per-host ranks (not in `all`).
    **{f"zero{k}-hsdp": _hf_zero_spec(k, "hsdp") for k in range(1, 4)},
    "zero3-hpz": _hf_zero_spec(3, "hpz"),
    # ZeRO++'s quantized communication (not in `all`; `--systems zeropp` runs them): qwZ, the int8 weight
    # all-gather, alone and under hpZ; hpZ + qwZ + qgZ (int4 gradient reduce-scatter), the paper's combination;
    # qgZ alone at stage 2.
    "zero3-qwz": _hf_zero_spec(3, options={"quantized_weights": "int8"}),
    "zero3-hpz-qwz": _hf_zero_spec(3, "hpz", options={"quantized_weights": "int8"}),
    "zero3-hpz-qwz-qgz": _hf_zero_spec(3, "hpz", options={"quantized_weights": "int8",
                                                          "quantized_gradients": "int4"}),
    "zero2-qgz": _hf_zero_spec(2, options={"quantized_gradients": "int4"}),
    # hf_zero's two forms of the collectives, each stage's side by side (not in `all`).
    **{f"zero{k}-{form}": _hf_zero_spec(k, collectives=form) for k in range(1, 4) for form in ("chunked", "flat")},
    # Peers from optional extras (never dependencies): a builder returns a Trainer; `unavailable` says when the
    # extra is missing, and the row is skipped with that reason.
    **{f"deepspeed_zero{k}": _deepspeed_spec(k) for k in range(1, 4)},
    # DeepSpeed's ZeRO++ (not in `all`): hpZ over K ranks, and with its quantized weights and gradients too.
    "deepspeed_zero3-hpz": _deepspeed_spec(3, {"zero_hpz_partition_size": "K"}),
    "deepspeed_zero3-hpz-qwz-qgz": _deepspeed_spec(3, {"zero_hpz_partition_size": "K", "zero_quantized_weights": True,
                                                       "zero_quantized_gradients": True}),
}
