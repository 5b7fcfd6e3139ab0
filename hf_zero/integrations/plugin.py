"""ZeroPlugin: the user-facing ZeRO settings, and `hf_zero.yaml`, the file they live in.

Accelerate rejects unknown keys in its own YAML and has no plugin mechanism, so hf_zero keeps its settings in a
second file beside Accelerate's config: `$HF_ZERO_CONFIG_FILE`, else `hf_zero.yaml` in the folder of
Accelerate's default config. Environment variables reach every worker `accelerate launch` starts.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import yaml

from ..config import ZeroConfig, ZeroConfigError
from ..deepspeed_config import read_deepspeed_config
from ..options import PLUGIN, check_values, declare

CONFIG_ENV = "HF_ZERO_CONFIG_FILE"


def default_config_path() -> Path:
    """Where `hf-zero config` writes and HfZeroAccelerator reads hf_zero.yaml."""
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    from accelerate.commands.config.config_args import default_config_file

    return Path(default_config_file).parent / "hf_zero.yaml"


@declare(PLUGIN)
class ZeroPlugin:
    """ZeRO settings for HfZeroAccelerator / ZeroTrainer: every engine option but the precision (Accelerate's
    `mixed_precision`), and activation checkpointing, which the accelerator installs on the model. The options are
    declared in hf_zero.options; each is also an hf_zero.yaml key and an `hf-zero config` flag. Besides them:

    model_parallel_group: the tensor-parallel process group P_a partitions checkpoints across; with it, give
    data_parallel_group, the group ZeRO shards over (default: all ranks). Runtime objects, not in YAML.
    """

    model_parallel_group: Optional[Any] = dataclasses.field(default=None, repr=False, compare=False)
    data_parallel_group: Optional[Any] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in check_values({o.name: getattr(self, o.name) for o in PLUGIN}, PLUGIN).items():
            setattr(self, name, value)  # the engine's own messages for the engine's options

    def to_zero_config(self, mixed_precision: str) -> ZeroConfig:
        """The engine config for this plugin under Accelerate's mixed-precision setting."""
        return ZeroConfig(mixed_precision=mixed_precision,
                          **{o.name: getattr(self, o.name) for o in PLUGIN if o.engine})

    @classmethod
    def from_deepspeed(cls, config: Union[str, os.PathLike, Mapping[str, Any]], *,
                       mixed_precision: Optional[str] = None, hidden_size: Optional[int] = None,
                       **overrides: Any) -> "ZeroPlugin":
        """The plugin for a DeepSpeed config (a JSON file or its dict): its ZeRO part and activation checkpointing.

        The precision stays Accelerate's, and gradient accumulation, clipping and the batch size belong to the
        accelerator / the Trainer: the one `DeepSpeedConfigWarning` says where each goes, together with every key
        hf_zero cannot honour; `read_deepspeed_config(config).accelerator_kwargs()` / `.training_arguments()` give
        them as keyword arguments. "auto" precision resolves to `mixed_precision` (default: $ACCELERATE_MIXED_PRECISION,
        what `accelerate launch` sets), "auto" buckets to `hidden_size`; `overrides` are ZeroPlugin keywords that win
        over the file."""
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION") or None
        settings = read_deepspeed_config(config, mixed_precision=mixed_precision, hidden_size=hidden_size)
        settings.warn("ZeroPlugin")
        return cls(**{**settings.plugin_kwargs(), **overrides})

    # ---------------------------------------------------------------- files
    @classmethod
    def from_dict(cls, values: Dict[str, Any], source: str = "hf_zero.yaml") -> "ZeroPlugin":
        """Build from hf_zero.yaml's mapping; unknown keys and bad values are errors naming `source`."""
        known = [o.yaml_key for o in PLUGIN]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ZeroConfigError(f"{source}: unknown key(s) {unknown}; allowed keys: {', '.join(known)}")
        try:
            return cls(**values)
        except ZeroConfigError as exc:
            raise ZeroConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: os.PathLike) -> "ZeroPlugin":
        """Read hf_zero.yaml (its `zero:` section, or the whole file)."""
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
        return {o.yaml_key: o.kind.plain(getattr(self, o.name)) for o in PLUGIN}

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
