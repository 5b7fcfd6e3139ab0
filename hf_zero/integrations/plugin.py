"""ZeroPlugin: the user-facing ZeRO settings, and `hf_zero.yaml`, the file they live in.

Accelerate rejects unknown keys in its own YAML and has no plugin mechanism, so hf_zero keeps its settings in a
second file beside Accelerate's config: `$HF_ZERO_CONFIG_FILE`, else `hf_zero.yaml` in the folder of
Accelerate's default config. Environment variables reach every worker `accelerate launch` starts.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import yaml

from ..config import ZeroConfig, ZeroConfigError

CONFIG_ENV = "HF_ZERO_CONFIG_FILE"
_CHECKPOINTING = ("off", "on", "partitioned")
_NOT_IN_YAML = ("model_parallel_group", "data_parallel_group")


def default_config_path() -> Path:
    """Where `hf-zero config` writes and HfZeroAccelerator reads hf_zero.yaml."""
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    from accelerate.commands.config.config_args import default_config_file

    return Path(default_config_file).parent / "hf_zero.yaml"


@dataclass
class ZeroPlugin:
    """ZeRO settings for HfZeroAccelerator / ZeroTrainer (mixed precision comes from Accelerate).

    Args:
        stage: 0-3 (see ZeroConfig).
        reduce_bucket_size, allgather_bucket_size: bucket bytes (C_B).
        prefetch: stage 3 units gathered ahead.
        offload_optimizer: "none" | "cpu". offload_params: "none" | "cpu" (stage 3 only).
        activation_checkpointing: "off" | "on" | "partitioned" (P_a; needs a model-parallel group).
        cpu_checkpointing: keep activation checkpoints in CPU memory (P_a+cpu); needs activation checkpointing.
        model_parallel_group: the tensor-parallel process group P_a partitions checkpoints across; with it, give
            data_parallel_group, the group ZeRO shards over (default: all ranks). Runtime objects, not in YAML.
        grad_accum_dtype: "fp32" | "compute".
        reduce_dtype: "fp32" | "compute" | None (default: fp32 under mixed precision); see ZeroConfig.
        shard_group_size: HSDP / MiCS: partition within groups of K ranks ("host": one host), replicate across.
        hpz_partition_size: ZeRO++ hpZ at stage 3: a secondary parameter shard over K ranks ("host") for the
            backward all-gather. See ZeroConfig for both.
        debug_collectives: check every collective's fingerprint across ranks (raises instead of hanging).
    """

    stage: int = 2
    reduce_bucket_size: int = 25 * 2**20
    allgather_bucket_size: int = 25 * 2**20
    prefetch: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    activation_checkpointing: str = "off"
    cpu_checkpointing: bool = False
    grad_accum_dtype: str = "fp32"
    reduce_dtype: Optional[str] = None
    shard_group_size: Optional[Any] = None
    hpz_partition_size: Optional[Any] = None
    debug_collectives: bool = False
    model_parallel_group: Optional[Any] = dataclasses.field(default=None, repr=False, compare=False)
    data_parallel_group: Optional[Any] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.activation_checkpointing in (False, None):
            self.activation_checkpointing = "off"
        if self.activation_checkpointing is True:
            self.activation_checkpointing = "on"
        if self.activation_checkpointing not in _CHECKPOINTING:
            raise ZeroConfigError(
                f"activation_checkpointing={self.activation_checkpointing!r}; allowed: {', '.join(_CHECKPOINTING)}"
            )
        if not isinstance(self.cpu_checkpointing, bool):
            raise ZeroConfigError(f"cpu_checkpointing={self.cpu_checkpointing!r}; allowed: true or false")
        if self.cpu_checkpointing and self.activation_checkpointing == "off":
            raise ZeroConfigError("cpu_checkpointing=true keeps activation checkpoints in CPU memory, so it needs "
                                  "activation_checkpointing 'on' or 'partitioned'; got 'off'")
        self.to_zero_config("no")  # validates every engine option now, with the engine's messages

    def to_zero_config(self, mixed_precision: str) -> ZeroConfig:
        """The engine config for this plugin under Accelerate's mixed-precision setting."""
        return ZeroConfig(
            stage=self.stage, mixed_precision=mixed_precision, grad_accum_dtype=self.grad_accum_dtype,
            reduce_dtype=self.reduce_dtype, reduce_bucket_size=self.reduce_bucket_size, allgather_bucket_size=self.allgather_bucket_size,
            prefetch=self.prefetch, offload_optimizer=self.offload_optimizer, offload_params=self.offload_params,
            shard_group_size=self.shard_group_size, hpz_partition_size=self.hpz_partition_size,
            debug_collectives=self.debug_collectives,
        )

    # ---------------------------------------------------------------- files
    @classmethod
    def from_dict(cls, values: Dict[str, Any], source: str = "hf_zero.yaml") -> "ZeroPlugin":
        known = [f.name for f in dataclasses.fields(cls) if f.name not in _NOT_IN_YAML]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ZeroConfigError(f"{source}: unknown key(s) {unknown}; allowed keys: {', '.join(known)}")
        try:
            return cls(**values)
        except ZeroConfigError as exc:
            raise ZeroConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: os.PathLike) -> "ZeroPlugin":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"hf_zero config file {path} does not exist. Write one with `hf-zero config`, or point "
                f"{CONFIG_ENV} at an existing hf_zero.yaml"
            )
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ZeroConfigError(f"{path} is not valid YAML: {exc}") from None
        section = data.get("zero", data) if isinstance(data, dict) else data
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise ZeroConfigError(f"{path}: expected a mapping of ZeRO options (e.g. 'zero:\n  stage: 3'), got "
                                  f"{type(section).__name__} {section!r}")
        return cls.from_dict(section, source=str(path))

    @classmethod
    def from_env(cls) -> "ZeroPlugin":
        """The plugin from $HF_ZERO_CONFIG_FILE (must exist) or the default hf_zero.yaml (defaults if absent)."""
        if os.environ.get(CONFIG_ENV):
            return cls.from_yaml(os.environ[CONFIG_ENV])
        path = default_config_path()
        return cls.from_yaml(path) if path.is_file() else cls()

    def to_dict(self) -> Dict[str, Any]:
        """The settings hf_zero.yaml holds (a process group is a runtime object, never written)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_IN_YAML}

    def to_yaml(self, path: os.PathLike) -> None:
        """Write atomically (a crash never leaves a half-written config)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "w") as f:
            f.write(yaml.safe_dump({"zero": self.to_dict()}, sort_keys=False))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
