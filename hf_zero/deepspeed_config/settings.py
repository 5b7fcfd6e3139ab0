"""What a DeepSpeed config means for hf_zero (`DeepSpeedSettings`), and the one warning about what it cannot take."""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from ..options import BY_NAME

AUTO = "auto"


class DeepSpeedConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that hf_zero does not honour (one warning per read, every such key named)."""


def show_value(value: Any) -> str:
    """A value as the JSON file writes it (1e9 as 1000000000), cut at 60 characters."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        value = int(value)
    text = json.dumps(value, default=str, separators=(",", ":"))
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config means for hf_zero.

    Attributes:
        source: the file (or "DeepSpeed config dict").
        values: hf_zero option -> value, for the options the file sets (ZeroConfig's and ZeroPlugin's).
        origin: hf_zero option -> the DeepSpeed key it came from.
        mixed_precision: "no", "bf16" or "fp16": the file's own choice, else the `mixed_precision` it was read with
            for "auto" or no section; None when neither says.
        gradient_accumulation_steps: the file's, or None ("auto" or not set: Accelerate's / the Trainer's own).
        gradient_clipping: the max norm, "auto" (Accelerate clips at 1.0, the Trainer at its max_grad_norm), or None
            (not set or 0: DeepSpeed clips nothing).
        micro_batch_size: train_micro_batch_size_per_gpu, or None.
        not_honoured: "key=value" -> why hf_zero cannot honour it (and what it does instead).
        no_effect: "key=value" of DeepSpeed tuning and logging knobs that have no counterpart in hf_zero.
        auto_precision: bf16 or fp16 "enabled" was "auto" (left to Accelerate's setting).
    """

    source: str
    values: Dict[str, Any] = field(default_factory=dict)
    origin: Dict[str, str] = field(default_factory=dict)
    mixed_precision: Optional[str] = None
    gradient_accumulation_steps: Optional[int] = None
    gradient_clipping: Union[None, float, str] = None
    micro_batch_size: Optional[int] = None
    not_honoured: Dict[str, str] = field(default_factory=dict)
    no_effect: List[str] = field(default_factory=list)
    auto_precision: bool = False

    def engine_kwargs(self) -> Dict[str, Any]:
        """ZeroConfig's keyword arguments (mixed_precision: the resolved one, else "no")."""
        out = {k: v for k, v in self.values.items() if BY_NAME[k].engine}
        out["mixed_precision"] = self.mixed_precision or "no"
        return out

    def plugin_kwargs(self) -> Dict[str, Any]:
        """ZeroPlugin's keyword arguments (its hf_zero.yaml keys): the engine's options and activation checkpointing,
        not the precision, which is Accelerate's."""
        return {k: v for k, v in self.values.items() if BY_NAME[k].plugin}

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The norm to clip at in your own loop, "auto" resolved as Accelerate does (1.0); None: no clipping."""
        return 1.0 if self.gradient_clipping == AUTO else self.gradient_clipping

    def accelerator_kwargs(self) -> Dict[str, Any]:
        """HfZeroAccelerator keyword arguments for what the file fixes outside ZeroPlugin: gradient accumulation and
        the precision ("auto" leaves both to Accelerate)."""
        out: Dict[str, Any] = {}
        if self.gradient_accumulation_steps is not None:
            out["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if "mixed_precision" in self.origin:
            out["mixed_precision"] = self.mixed_precision
        return out

    def training_arguments(self) -> Dict[str, Any]:
        """TrainingArguments keyword arguments for the same, as the Trainer fills DeepSpeed's "auto" values: the batch
        size, accumulation, clipping (0.0 where DeepSpeed would not clip) and bf16 / fp16."""
        out: Dict[str, Any] = {}
        if self.micro_batch_size is not None:
            out["per_device_train_batch_size"] = self.micro_batch_size
        if self.gradient_accumulation_steps is not None:
            out["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if self.gradient_clipping != AUTO:
            out["max_grad_norm"] = float(self.gradient_clipping or 0.0)
        if "mixed_precision" in self.origin and self.mixed_precision in ("bf16", "fp16"):
            out[self.mixed_precision] = True
        return out

    def _elsewhere(self, reader: str) -> List[str]:
        """Where the file's training-loop settings go, for `reader` (ZeroConfig, ZeroPlugin or hf-zero config)."""
        lines = []
        n = self.gradient_accumulation_steps
        if n is not None and n != 1:
            lines.append(f"gradient_accumulation_steps={n}: HfZeroAccelerator(gradient_accumulation_steps={n}) or "
                         f"TrainingArguments(gradient_accumulation_steps={n}); with the engine alone, {n} "
                         f"micro-batches per step, all but the last inside engine.no_sync()")
        if self.gradient_clipping == AUTO:
            lines.append("gradient_clipping='auto': the Trainer clips at its max_grad_norm; in your own loop call "
                         "accelerator.clip_grad_norm_(model.parameters(), 1.0) (Accelerate's value for 'auto')")
        elif self.gradient_clipping:
            c = self.gradient_clipping
            lines.append(f"gradient_clipping={c}: accelerator.clip_grad_norm_(model.parameters(), {c}) (or "
                         f"engine.clip_grad_norm_({c})) before each step, or TrainingArguments(max_grad_norm={c})")
        if self.micro_batch_size is not None:
            lines.append(f"train_micro_batch_size_per_gpu={self.micro_batch_size}: your DataLoader's batch size "
                         f"(TrainingArguments(per_device_train_batch_size={self.micro_batch_size}))")
        if reader == "ZeroPlugin" and "mixed_precision" in self.origin:
            mp = self.mixed_precision
            lines.append(f"{self.origin['mixed_precision']}: the precision is Accelerate's setting: "
                         f"HfZeroAccelerator(mixed_precision='{mp}') or `accelerate launch --mixed_precision {mp}`")
        if reader == "ZeroConfig":
            if "mixed_precision" not in self.origin and self.mixed_precision is None and self.auto_precision:
                lines.append("bf16/fp16 'enabled': 'auto' and no mixed_precision= given: trained in 'no' (pass "
                             "mixed_precision=... as Accelerate's setting would)")
            for name in ("activation_checkpointing", "cpu_checkpointing"):
                if name in self.values:
                    lines.append(f"{self.origin[name]}: ZeroPlugin({name}={self.values[name]!r}), or "
                                 f"hf_zero.engine.enable_activation_checkpointing(model, ...) before shard_model")
        return lines

    def notes(self, reader: str) -> List[str]:
        """The warning's lines: keys not honoured, knobs with no effect, and where the training-loop keys go."""
        lines = [f"{key}: {why}" for key, why in self.not_honoured.items()]
        if self.no_effect:
            lines.append("DeepSpeed tuning / logging with no counterpart in hf_zero (no effect): "
                         + ", ".join(self.no_effect))
        elsewhere = self._elsewhere(reader)
        if elsewhere:
            lines.append(f"not {reader} options; pass them yourself:")
            lines.extend("  " + line for line in elsewhere)
        return lines

    def warn(self, reader: str, stacklevel: int = 3) -> None:
        """One DeepSpeedConfigWarning with every note, if there is any."""
        lines = self.notes(reader)
        if lines:
            warnings.warn(f"hf_zero read the DeepSpeed config {self.source}; keys it does not take as they are:\n"
                          + "\n".join("  - " + line if not line.startswith("  ") else "      " + line.strip()
                                      for line in lines),
                          DeepSpeedConfigWarning, stacklevel=stacklevel)
