"""ZeroConfig: the engine's options, their defaults and their validation.

Each option is declared once, in hf_zero/options (name, default, allowed values, help, what it needs of other
options); `ZeroConfig`'s fields, docstring and checks are made from those declarations. The config is the bottom
layer: it imports only hf_zero.options and hf_zero.deepspeed_config (which import nothing else of hf_zero), so the
planner, the estimator and the integrations can all read it.
"""
from __future__ import annotations

import os
from dataclasses import field
from typing import Any, Mapping, Optional, Union

import torch

from .deepspeed_config import read_deepspeed_config
from .options import ENGINE, ZeroConfigError, check_values, declare

__all__ = ["ZeroConfig", "ZeroConfigError"]

_COMPUTE_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@declare(ENGINE)
class ZeroConfig:
    """Options of the ZeRO engine (declared in hf_zero.options; every option is a keyword argument and an attribute).
    """

    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ZeroConfigError naming the first bad option and what is allowed; put the others in normal form."""
        for name, value in check_values({o.name: getattr(self, o.name) for o in ENGINE}, ENGINE).items():
            setattr(self, name, value)
        k = self.reshard_after_forward
        if type(k) is int and self.hpz_partition_size not in (None, k):
            raise ZeroConfigError(f"reshard_after_forward={k} reshards to a group of {k} ranks (hpZ) but "
                                  f"hpz_partition_size={self.hpz_partition_size!r}: give one of them", "reshard_after_forward")
        if type(k) is int and self.shard_group_size is not None:
            raise ZeroConfigError(f"reshard_after_forward={k} (hpZ over {k} ranks) and shard_group_size="
                                  f"{self.shard_group_size!r} are two ways of keeping all-gathers inside a host; choose "
                                  f"one", "reshard_after_forward")

    # ----------------------------------------------------------------- derived
    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype parameters are cast to for forward/backward, or None to keep each parameter's own dtype."""
        return _COMPUTE_DTYPES[self.mixed_precision]

    @property
    def hpz_size(self) -> Optional[Union[int, str]]:
        """hpZ's secondary group: hpz_partition_size, or reshard_after_forward when it names a number of ranks."""
        k = self.reshard_after_forward
        return self.hpz_partition_size if self.hpz_partition_size is not None or type(k) is not int else k

    def reduce_torch_dtype(self, group_dtype: torch.dtype) -> torch.dtype:
        """The dtype a stage-2/3 bucket of `group_dtype` gradients is reduce-scattered in."""
        low = group_dtype.is_floating_point and torch.finfo(group_dtype).bits < 32
        choice = self.reduce_dtype or ("fp32" if self.compute_dtype is not None else "compute")
        return torch.float32 if (choice == "fp32" and low) else group_dtype

    # ----------------------------------------------------------------- other forms
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ZeroConfig":
        """Build from a mapping (a parsed YAML file); unknown keys are an error that lists the known ones."""
        known = {o.name for o in ENGINE}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ZeroConfigError(f"unknown ZeRO option(s) {unknown}; known options: {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict:
        """Plain-data view (for logs, manifests and YAML)."""
        return {o.name: o.kind.plain(getattr(self, o.name)) for o in ENGINE}

    @classmethod
    def from_deepspeed(cls, config: Union[str, os.PathLike, Mapping[str, Any]], *,
                       mixed_precision: Optional[str] = None, hidden_size: Optional[int] = None,
                       **overrides: Any) -> "ZeroConfig":
        """The engine part of a DeepSpeed config (a JSON file or its dict): stage, offload, bucket sizes (DeepSpeed's
        elements as bytes), hpZ / MiCS, precision and its loss scale, reduction dtypes.

        Gradient accumulation, clipping, the batch size and activation checkpointing are no engine options: they
        are named, with where they go, in the one `DeepSpeedConfigWarning` that also names every key hf_zero
        cannot honour (`hf_zero.deepspeed_config.read_deepspeed_config` returns them all as data). `mixed_precision`
        and `hidden_size` resolve "auto" as Accelerate would; `overrides` are ZeroConfig keywords that win over the
        file. Bad values raise ZeroConfigError naming the DeepSpeed key."""
        settings = read_deepspeed_config(config, mixed_precision=mixed_precision, hidden_size=hidden_size)
        settings.warn("ZeroConfig")
        return cls(**{**settings.engine_kwargs(), **overrides})
