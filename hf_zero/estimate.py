"""hf-zero estimate: model-state memory and communication per rank, before buying the hardware.

Two modes:

- formula mode (``--params PSI``): the paper's closed forms (hf_zero.memory) for stages 0-3, no model needed;
- plan mode (``--model CONFIG.json|DIR``): the model is built on the meta device from a local config (no weights,
  no download) and hf_zero's own planner (``plan_model``) lays it out, so the bytes are exactly what the engine's
  ``memory_stats()`` reports after the first optimizer step: flat buffers with their padding, the accumulation
  dtype, the master copy and Adam's two fp32 states per owned element plus its 4-byte ``step`` per segment.

``estimate_plan(model_or_config, world_size, config, rank=0)`` is the Python entry point of plan mode.

Activations (plan mode with ``--batch-size b --seq-len s``): hf_zero.activation_estimate (Korthikanti et al.
2022, re-derived per term for the real config), with and without activation checkpointing.
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .config import ZeroConfig
from .memory import Recipe, comm_elements_per_step, model_state_bytes, recipe
from .planning import GroupPlan, ShardPlan, plan_model
from .activation_estimate import ATTENTION_KINDS, activation_report

STAGES = (0, 1, 2, 3)
MAX_WORLD = 65536
GB = 1e9  # the paper's GB (decimal)
STEP_BYTES = 4  # torch's Adam/AdamW keep `step` as a 0-d float32 tensor per parameter (here: per segment)


# ------------------------------------------------------------------------------------------------- model building
def meta_model(path_or_config: Any) -> nn.Module:
    """A causal LM on the meta device from a local config.json (or its folder), or a PretrainedConfig."""
    from .integrations.hf_models import causal_lm_from_config, config_from_path

    cfg = config_from_path(path_or_config)
    with torch.device("meta"):
        return causal_lm_from_config(cfg)


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
    for g in plan.groups:
        e = _elem(g.dtype)
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


def _replan(plan: ShardPlan, world_size: int, stage: Optional[int] = None) -> ShardPlan:
    """The same layout on another world size (or stage): plan_model's groups depend on N only through the padding
    and on the stage only through `stage < 3` (bucket caps) and `stage == 0` (no partitioning)."""
    stage = plan.stage if stage is None else stage
    if (stage == 3) != (plan.stage == 3):
        raise ValueError("stage-3 plans and stage 0-2 plans have different groups; plan the model again")
    partition = 1 if stage == 0 else world_size
    groups = []
    for g in plan.groups:
        padded = -(-g.numel // partition) * partition if g.numel else 0
        groups.append(dataclasses.replace(g, padded_numel=padded, shard_numel=padded // partition))
    return ShardPlan(world_size=world_size, partition_size=partition, stage=stage, units=plan.units,
                     groups=groups)


class Planner:
    """plan_model once for stages 0-2 and once for stage 3 (it is the slow part for 1000-layer models); every other
    (stage, N) is derived by _replan."""

    def __init__(self, model: nn.Module, config: ZeroConfig) -> None:
        self.model, self.config = model, config
        self._base: Dict[bool, ShardPlan] = {}

    def config_for(self, stage: int) -> ZeroConfig:
        return dataclasses.replace(self.config, stage=stage)

    def plan(self, stage: int, world_size: int) -> ShardPlan:
        key = stage == 3
        if key not in self._base:
            self._base[key] = plan_model(self.model, 1, self.config_for(3 if key else 1))
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


def _as_model(model_or_config: Any) -> nn.Module:
    return model_or_config if isinstance(model_or_config, nn.Module) else meta_model(model_or_config)


def estimate_plan(model_or_config: Any, world_size: int, config: Optional[ZeroConfig] = None,
                  rank: int = 0, optimizer_states: int = 2) -> Dict[str, int]:
    """Exact model-state bytes on `rank` (params, grads, master, optimizer_states, model_states), as
    `ZeroEngine.memory_stats()` reports them after the first step of an Adam-like optimizer over every trainable
    parameter. `model_or_config`: an nn.Module (any device, meta included), a PretrainedConfig or a local path."""
    config = config if config is not None else ZeroConfig()
    plan = plan_model(_as_model(model_or_config), world_size, config)
    return plan_bytes(plan, config, rank, optimizer_states)


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
        compute = max((_elem(g.dtype) for g in plan.groups), default=4)
        largest = max((sum(plan.groups[i].padded_numel * _elem(plan.groups[i].dtype) for i in u.groups)
                       for u in plan.units), default=0)
        trainable_padded = sum(g.padded_numel for g in plan.groups if g.trainable)
        root_padded = sum(plan.groups[i].padded_numel for i in plan.units[0].groups if plan.groups[i].trainable)
        comm = comm_elements_per_step(trainable_padded, stage, micro_batches,
                                      resident=root_padded if stage == 3 else 0)
        rows[stage] = {
            "rank0": r0, "max": {k: v for k, v in mx.items()}, "padding_elements": plan.padding,
            "groups": len(plan.groups), "units": len(plan.units),
            "largest_unit_bytes": largest,
            "comm_elements": {k: int(v) for k, v in comm.items()},
            "comm_bytes": {k: int(v) * compute for k, v in comm.items()},
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
                   stages: Sequence[int] = STAGES) -> Dict[str, Any]:
    rows = {}
    for stage in stages:
        comm = comm_elements_per_step(psi, stage, micro_batches)
        byte_of = {"all_gather": r.param, "reduce_scatter": r.grad, "all_reduce": r.grad}
        rows[stage] = {
            "model_states": model_state_bytes(psi, world_size, stage, r),
            "comm_elements": comm,
            "comm_bytes": {k: v * byte_of[k] for k, v in comm.items()},
        }
    return {"mode": "formula", "psi": psi, "world_size": world_size, "recipe": dataclasses.asdict(r),
            "stages": rows}


def formula_recipe(mixed_precision: str, optimizer_k: Optional[int], grad_accum_dtype: str) -> Recipe:
    """The paper's 2 + 2 + K (K = master + optimizer states) when --optimizer-k is given, else hf_zero's recipe."""
    base = recipe(mixed_precision, grad_accum_dtype)
    if optimizer_k is None:
        return base
    master = base.master if base.master <= optimizer_k else 0
    return Recipe(param=base.param, grad=base.grad, master=master, optim=optimizer_k - master)


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


def fits_formula(psi: float, r: Recipe, budget_bytes: float, stages: Sequence[int] = STAGES) -> Dict[int, Optional[int]]:
    return {s: _smallest_n(lambda n, s=s: model_state_bytes(psi, n, s, r) <= budget_bytes) for s in stages}


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


# ------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="formula mode: Ψ, the number of trainable parameters (e.g. 7.5e9)")
    what.add_argument("--model", help="plan mode: a local config.json (or its folder); built on the meta device")
    parser.add_argument("--num-processes", type=int, default=None, help="N, the data-parallel world size")
    parser.add_argument("--stage", type=int, choices=STAGES, default=None, help="one stage (default: all four)")
    parser.add_argument("--mixed-precision", default="bf16", choices=("no", "fp32", "bf16", "fp16"))
    parser.add_argument("--grad-accum-dtype", default=None, choices=("fp32", "compute"),
                        help="gradient accumulation dtype (default: 'compute' with --params, ZeroConfig's 'fp32' "
                             "with --model)")
    parser.add_argument("--optimizer-k", type=int, default=None,
                        help="formula mode: K, bytes of master + optimizer states per parameter (paper: 12)")
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per optimizer step")
    parser.add_argument("--fits", type=float, default=None, metavar="GB",
                        help="also print the smallest N (1..65536) for which each stage fits in GB per device")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help="plan mode: micro-batch size per device; with --seq-len adds the activation estimate "
                             "(with and without checkpointing) and counts it in --fits")
    parser.add_argument("--seq-len", type=int, default=None, metavar="S", help="plan mode: sequence length")
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default="eager",
                        help="eager keeps the a*s*s attention probabilities (the paper's count); sdpa: a fused "
                             "flash / memory-efficient kernel that does not")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")


def _gb(x: float) -> str:
    return f"{x / GB:.1f}" if x >= 0.05 * GB or x == 0 else f"{x / GB:.3g}"


def _fmt_comm(d: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(d.items()))


def _table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    stages = STAGES if args.stage is None else (args.stage,)
    n = args.num_processes
    with_activations = args.batch_size is not None or args.seq_len is not None
    if n is None and args.fits is None and not with_activations:
        print("hf-zero estimate: give --num-processes N (and/or --fits GB, --batch-size B --seq-len S)",
              file=sys.stderr)
        return 2
    if n is not None and not 1 <= n <= MAX_WORLD:
        print(f"hf-zero estimate: --num-processes must be in 1..{MAX_WORLD}", file=sys.stderr)
        return 2
    if with_activations and (args.batch_size is None or args.seq_len is None or args.model is None):
        print("hf-zero estimate: activations need --model with both --batch-size and --seq-len", file=sys.stderr)
        return 2
    budget = args.fits * GB if args.fits is not None else None
    out: Dict[str, Any]
    if args.params is not None:
        r = formula_recipe(args.mixed_precision, args.optimizer_k, args.grad_accum_dtype or "compute")
        out = formula_report(args.params, n or 1, r, args.micro_batches, stages) if n else {
            "mode": "formula", "psi": args.params, "recipe": dataclasses.asdict(r), "stages": {}}
        if budget is not None:
            out["fits"] = {"gb": args.fits, "min_world_size": fits_formula(args.params, r, budget, stages)}
    else:
        config = ZeroConfig(mixed_precision=args.mixed_precision, grad_accum_dtype=args.grad_accum_dtype or "fp32")
        try:
            model = meta_model(args.model)
        except (OSError, ValueError) as exc:  # a missing or unreadable config: say which, no traceback
            print(f"hf-zero estimate: error: {exc}. Give --model a local config.json or model folder, or --params N",
                  file=sys.stderr)
            return 2
        planner = Planner(model, config)
        out = plan_report(model, n or 1, config, stages, micro_batches=args.micro_batches, planner=planner) if n \
            else {"mode": "plan", "stages": {}}
        if with_activations:
            out["activations"] = activation_report(model, args.batch_size, args.seq_len, config, args.attention)
        if budget is not None:
            out["fits"] = {"gb": args.fits, "min_world_size": fits_plan(model, config, budget, stages,
                                                                        planner=planner)}
            if with_activations:
                out["fits"]["with_activations"] = fits_with_activations(model, config, budget, out["activations"],
                                                                        stages, planner)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    if args.json:
        print(json.dumps(out, default=float))
        return 0
    print(_render(out, n))
    return 0


def _render(out: Dict[str, Any], n: Optional[int]) -> str:
    lines = []
    if out["mode"] == "formula":
        r = out["recipe"]
        lines.append(f"Formula mode: Ψ = {out['psi']:.4g} trainable parameters, " + (f"N = {n}, " if n else "") +
                     f"bytes/param: "
                     f"params {r['param']}, grads {r['grad']}, master {r['master']}, optimizer {r['optim']}")
        if out["stages"]:
            rows = [[f"stage {s}", _gb(v["model_states"]), _fmt_comm(v["comm_elements"]), _fmt_comm(v["comm_bytes"])]
                    for s, v in out["stages"].items()]
            lines.append(_table(["", "model states / rank (GB)", "comm elements / step / rank",
                                 "comm bytes / step / rank"], rows))
    else:
        if out["stages"]:
            lines.append(f"Plan mode: Ψ = {out['psi']:,} trainable + {out['frozen']:,} frozen, N = {n}, "
                         f"mixed_precision {out['mixed_precision']}, grad_accum_dtype {out['grad_accum_dtype']}, "
                         f"buckets: reduce {out['reduce_bucket_size']:,} B, all-gather "
                         f"{out['allgather_bucket_size']:,} B")
            rows = []
            for s, v in out["stages"].items():
                r0, mx = v["rank0"], v["max"]
                rows.append([f"stage {s}", _gb(r0["params"]), _gb(r0["grads"]), _gb(r0["master"]),
                             _gb(r0["optimizer_states"]), _gb(r0["model_states"]),
                             f"{_gb(mx['model_states'])} (r{mx['rank']})", f"{v['padding_elements']:,}",
                             _gb(v["largest_unit_bytes"]), _fmt_comm(v["comm_elements"]), _fmt_comm(v["comm_bytes"])])
            lines.append(_table(["", "params GB", "grads GB", "master GB", "optim GB", "rank 0 GB", "max GB",
                                 "padding el.", "largest unit GB", "comm elements/step", "comm bytes/step"], rows))
    if "activations" in out:
        lines.extend(_render_activations(out["activations"]))
    if "fits" in out:
        f = out["fits"]
        lines.append(f"Fits in {f['gb']:g} GB per device (model states only): " + _fits_parts(f["min_world_size"]))
        for mode, mins in f.get("with_activations", {}).items():
            peak = out["activations"][mode]["peak"]
            alone = f" (the activations alone need {_gb(peak)} GB)" if peak >= f["gb"] * GB else ""
            lines.append(f"Fits in {f['gb']:g} GB per device with activations, {mode.replace('_', ' ')}: "
                         + _fits_parts(mins) + alone)
    lines.append(f"({out['seconds']:.2f} s)")
    return "\n".join(lines)


def _fits_parts(mins: Dict[Any, Optional[int]]) -> str:
    return "; ".join(f"stage {s}: " + (f"N >= {m}" if m else f"does not fit (N <= {MAX_WORLD})")
                     for s, m in mins.items())


def _render_activations(act: Dict[str, Any]) -> List[str]:
    rows = [[mode.replace("_", " "), _gb(v["per_layer"]), _gb(v["layers"]), _gb(v["outside"]), _gb(v["stored"]),
             _gb(v["peak"])] for mode, v in ((m, act[m]) for m in ("no_checkpointing", "checkpointing"))]
    return [f"Activations per device (any stage, any N): micro-batch {act['batch_size']} x {act['seq_len']} tokens, "
            f"{act['dtype_bytes']}-byte activations, {act['attention']} attention",
            _table(["", "one layer GB", "layers keep GB", "outside layers GB", "stored GB", "peak GB"], rows),
            f"Formula: {act['formula']}. The paper's 16-bit formula for these layers alone: "
            f"{_gb(act['paper_layers_16bit'])} GB."]
