"""ZeroConfig: every engine option, its default, and its validation.

The config is the bottom layer: it imports nothing from the rest of hf_zero, so the planner, the estimator and
the integrations can all read it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

_MIXED_PRECISION = {"no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_GRAD_ACCUM = ("fp32", "compute")
_REDUCE = ("fp32", "compute")
_OFFLOAD = ("none", "cpu")
_COLLECTIVES = ("auto", "flat", "chunked")


class ZeroConfigError(ValueError):
    """A ZeRO option has a value that is not allowed; the message names the option and the allowed values."""


@dataclass
class ZeroConfig:
    """Options of the ZeRO engine.

    Args:
        stage: 0 (plain data parallel), 1 (partition optimizer states), 2 (+ gradients), 3 (+ parameters).
        mixed_precision: "no"/"fp32" (train in the model's own dtypes), "bf16" or "fp16" (compute copies in that
            dtype, fp32 master weights and optimizer states inside the shard; fp16 adds dynamic loss scaling).
        grad_accum_dtype: "fp32" accumulates gradients (full buffer at stages 0/1, shard at 2/3) in fp32; "compute"
            accumulates them in the compute dtype as the paper counts it (saves memory, loses precision with bf16).
        reduce_dtype: the dtype stage-2/3 gradient buckets are reduce-scattered in: "fp32" or "compute" (the compute
            dtype; fp16 buckets are divided by the world size before the sum so it cannot overflow N times sooner).
            Default (None): "fp32" under fp16 and bf16 (a bf16 sum of N ranks loses bits: see the README), the
            parameters' own dtype otherwise. Stages 0/1 reduce their accumulator, in grad_accum_dtype.
        reduce_bucket_size: bytes per gradient bucket at stages 0-2 (C_B: constant, independent of model size).
        allgather_bucket_size: bytes per all-gather bucket after the step at stages 1-2.
        prefetch: stage 3: how many units ahead to all-gather while the current one computes (0 disables).
        units: module classes (or class names) whose instances are stage-3 units; default: the model's
            `_no_split_modules` (HF models), else every direct child of the first `nn.ModuleList`.
        offload_optimizer: "none" or "cpu": keep fp32 master shards and optimizer states in CPU memory.
        offload_params: "none" or "cpu" (stage 3 only): keep parameter shards in CPU memory.
        optimizer_is_elementwise: declare an optimizer class hf_zero does not know to be element-wise (it then runs
            on 1-D segments of the shard); None means "only the known element-wise torch optimizers".
        shard_group_size: hierarchical partitioning (HSDP / MiCS): partition over groups of K consecutive ranks
            (one host) and replicate across the N/K groups, so every all-gather and reduce-scatter stays inside a
            group and only the gradient shard's all-reduce crosses groups. An integer K that divides the world
            size, or "host" for the ranks per host (LOCAL_WORLD_SIZE). None (default), 1 or N: the plain stage.
            Stages 1-3.
        hpz_partition_size: ZeRO++ hpZ (stage 3): optimizer states and gradients stay partitioned over all N
            ranks; after a unit's forward all-gather each rank keeps a secondary shard of its parameters
            partitioned over its group of K ranks (one host), so the backward all-gather stays inside the host.
            Costs Ψ/K compute-dtype elements per rank. K or "host", as for shard_group_size; None, 1 or N: off.
        collectives: how all-gathers and reduce-scatters are issued: "flat" (one all_gather_into_tensor /
            reduce_scatter_tensor per bucket, as NCCL runs them), "chunked" (per-rank-chunk broadcasts and reduces,
            faster on gloo) or "auto" (chunked on gloo, flat otherwise).
        debug_collectives: before every collective, all-gather a fingerprint (kind, unit, size, call index) and
            raise with both sides' descriptions if ranks disagree, instead of hanging.
        initial_loss_scale / loss_scale_growth_interval / loss_scale_factor / min_loss_scale: fp16 dynamic scaler.
    """

    stage: int = 2
    mixed_precision: str = "no"
    grad_accum_dtype: str = "fp32"
    reduce_dtype: Optional[str] = None
    reduce_bucket_size: int = 25 * 2**20
    allgather_bucket_size: int = 25 * 2**20
    prefetch: int = 1
    units: Optional[Sequence[Union[str, type]]] = None
    offload_optimizer: str = "none"
    offload_params: str = "none"
    optimizer_is_elementwise: Optional[bool] = None
    shard_group_size: Optional[Union[int, str]] = None
    hpz_partition_size: Optional[Union[int, str]] = None
    collectives: str = "auto"
    debug_collectives: bool = False
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    loss_scale_factor: float = 2.0
    min_loss_scale: float = 1.0
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ZeroConfigError naming the first bad option and what is allowed."""
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in (0, 1, 2, 3):
            raise ZeroConfigError(f"stage={self.stage!r} is not a ZeRO stage; allowed: 0, 1, 2 or 3")
        mp = str(self.mixed_precision).lower()
        if mp not in _MIXED_PRECISION:
            raise ZeroConfigError(
                f"mixed_precision={self.mixed_precision!r} is unknown; allowed: {', '.join(_MIXED_PRECISION)}"
            )
        self.mixed_precision = "no" if mp == "fp32" else mp
        if self.grad_accum_dtype not in _GRAD_ACCUM:
            raise ZeroConfigError(f"grad_accum_dtype={self.grad_accum_dtype!r}; allowed: {', '.join(_GRAD_ACCUM)}")
        if self.reduce_dtype is not None and self.reduce_dtype not in _REDUCE:
            raise ZeroConfigError(f"reduce_dtype={self.reduce_dtype!r}; allowed: {', '.join(_REDUCE)} (or None for "
                                  f"the default: fp32 under mixed precision)")
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ZeroConfigError(f"{name}={value!r} must be a positive number of bytes (e.g. 25_000_000)")
            setattr(self, name, int(value))
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ZeroConfigError(f"prefetch={self.prefetch!r} must be an integer >= 0 (units gathered ahead)")
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            value = "none" if value in (None, False) else str(value).lower()
            if value not in _OFFLOAD:
                raise ZeroConfigError(f"{name}={getattr(self, name)!r}; allowed: {', '.join(_OFFLOAD)}")
            setattr(self, name, value)
        if self.offload_params != "none" and self.stage != 3:
            raise ZeroConfigError(
                f"offload_params={self.offload_params!r} needs stage 3 (parameters are only partitioned at stage 3); "
                f"got stage={self.stage}. Use stage=3 or offload_params='none'."
            )
        for name in ("shard_group_size", "hpz_partition_size"):
            value = getattr(self, name)
            if isinstance(value, str) and value.lower() == "host":
                setattr(self, name, "host")
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ZeroConfigError(f"{name}={value!r} must be a positive number of ranks that divides the world "
                                      f"size, \"host\" (the ranks per host) or None (off)")
        if self.shard_group_size is not None and self.hpz_partition_size is not None:
            raise ZeroConfigError(
                f"shard_group_size={self.shard_group_size!r} and hpz_partition_size={self.hpz_partition_size!r} "
                f"are two ways of keeping all-gathers inside a host; choose one (HSDP partitions K ways and "
                f"replicates, hpZ keeps the N-way partition and adds a K-way secondary copy of the parameters)")
        if self.hpz_partition_size is not None and self.stage != 3:
            raise ZeroConfigError(
                f"hpz_partition_size={self.hpz_partition_size!r} needs stage 3 (it partitions the parameters a second "
                f"time, and only stage 3 partitions them); got stage={self.stage}. For stages 1-2 use "
                f"shard_group_size, or drop the option.")
        if self.shard_group_size is not None and self.stage == 0:
            raise ZeroConfigError(
                f"shard_group_size={self.shard_group_size!r} needs stage 1-3 (stage 0 partitions nothing)")
        if str(self.collectives).lower() not in _COLLECTIVES:
            raise ZeroConfigError(f"collectives={self.collectives!r}; allowed: {', '.join(_COLLECTIVES)}")
        self.collectives = str(self.collectives).lower()
        if self.initial_loss_scale <= 0 or self.loss_scale_factor <= 1 or self.loss_scale_growth_interval < 1:
            raise ZeroConfigError("loss scaler: initial_loss_scale > 0, loss_scale_factor > 1, growth_interval >= 1")

    # ----------------------------------------------------------------- derived
    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype parameters are cast to for forward/backward, or None to keep each parameter's own dtype."""
        return _MIXED_PRECISION[self.mixed_precision]

    def reduce_torch_dtype(self, group_dtype: torch.dtype) -> torch.dtype:
        """The dtype a stage-2/3 bucket of `group_dtype` gradients is reduce-scattered in."""
        low = group_dtype.is_floating_point and torch.finfo(group_dtype).bits < 32
        choice = self.reduce_dtype or ("fp32" if self.compute_dtype is not None else "compute")
        return torch.float32 if (choice == "fp32" and low) else group_dtype

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ZeroConfig":
        """Build from a mapping (a parsed YAML file); unknown keys are an error that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ZeroConfigError(f"unknown ZeRO option(s) {unknown}; known options: {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict:
        """Plain-data view (for logs, manifests and YAML)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if out["units"] is not None:
            out["units"] = [u if isinstance(u, str) else u.__name__ for u in out["units"]]
        return out
