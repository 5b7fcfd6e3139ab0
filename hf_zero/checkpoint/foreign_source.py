"""A checkpoint another system wrote, read the way `sharded._stage` reads hf_zero's own.

`_stage` asks a source for flat ranges of each parameter's values and optimizer state, its per-parameter scalars
(Adam's step), the persistent buffers and the optimizer's hyper-parameters (`CheckpointSource`'s reading side).
A foreign format says, per parameter, where its elements lie in its own files (`from_deepspeed.py`,
`from_dcp.py`); `ForeignSource` turns that into the view `_stage` checks against the model: one unpartitioned
group per parameter, so that loading at any world size and stage is the interval arithmetic hf_zero's own
checkpoints already use. Nothing here writes; nothing runs code from the folder (the subclasses read with
`load_without_code` / the DCP metadata unpickler).
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .source import CheckpointError

__all__ = ["ADAM_STATE", "HYPER_PARAMETERS", "ForeignSource", "ParamInfo", "json_value"]

ADAM_STATE = ("exp_avg", "exp_avg_sq")  # torch's Adam and AdamW (and DeepSpeed's Adam) per-element state
# the parameter-group keys a foreign checkpoint's groups hand on (torch's Adam/AdamW, and a scheduler's initial_lr)
HYPER_PARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                    "differentiable", "fused", "decoupled_weight_decay", "initial_lr")
ADAM_CLASSES = ("Adam", "AdamW")


def json_value(value: Any) -> Any:
    """A hyper-parameter as JSON data: a tensor as its number (or list), a tuple as a list."""
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return [json_value(v) for v in value]
    return value


def _config_files(folder: str) -> Dict[str, bytes]:
    """config.json (and generation_config.json) in the checkpoint folder or the one above it: the Trainer's
    `checkpoint-N/` holds DeepSpeed's `global_stepN/` beside the model's config."""
    for where in (folder, os.path.dirname(os.path.normpath(folder))):
        path = os.path.join(where, "config.json")
        if os.path.isfile(path):
            out = {"config.json": open(path, "rb").read()}
            gen = os.path.join(where, "generation_config.json")
            if os.path.isfile(gen):
                out["generation_config.json"] = open(gen, "rb").read()
            return out
    return {}


def _optimizer_classes(state_keys: Sequence[str], param_groups: List[Dict[str, Any]]) -> List[str]:
    """The torch optimizers whose state the checkpoint holds: Adam's moments are AdamW's when the groups say the
    weight decay was decoupled (torch records it), Adam's when they say it was not, either when they do not say."""
    if not set(ADAM_STATE) <= set(state_keys):
        return [f"an optimizer with state {sorted(state_keys)}"]
    decoupled = {g.get("decoupled_weight_decay") for g in param_groups if "decoupled_weight_decay" in g}
    if decoupled == {True}:
        return ["AdamW"]
    if decoupled == {False}:
        return ["Adam"]
    return list(ADAM_CLASSES)


class ParamInfo:
    """One parameter of a foreign checkpoint: its name, shape and dtype, whether it was trained (optimizer state
    and an fp32 master) or frozen, its user parameter group, and the other names it is saved under (ties)."""

    __slots__ = ("name", "shape", "dtype", "trainable", "group", "aliases")

    def __init__(self, name: str, shape: Sequence[int], dtype: str = "float32", trainable: bool = True,
                 group: int = 0, aliases: Sequence[str] = ()) -> None:
        self.name, self.shape, self.dtype = name, [int(d) for d in shape], dtype
        self.trainable, self.group, self.aliases = trainable, group, list(aliases)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ForeignSource:
    """The reading side of `CheckpointSource` over another system's checkpoint. Subclasses set `params`,
    `state_keys`, `scalar_keys`, `param_groups`, `buffer_info`, and implement `_read`, `_scalar`, `_buffer`,
    `files_for` and `open_file`."""

    kind = "foreign"

    def __init__(self, folder: str, description: str, world_size: int, step: Optional[int],
                 params: List[ParamInfo], param_groups: List[Dict[str, Any]], state_keys: Sequence[str],
                 scalar_keys: Sequence[str], buffer_info: List[Dict[str, Any]],
                 loss_scaler: Optional[Dict[str, float]] = None, stage: Optional[int] = None,
                 state_dict_keys: Optional[List[str]] = None) -> None:
        self.dir = folder
        self.description = description
        self.world = world_size
        self.params = params
        self.state_keys, self.scalar_keys = list(state_keys), list(scalar_keys)
        self.groups: List[Dict[str, Any]] = []
        self.where: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {}
        self.by_name: Dict[str, ParamInfo] = {}
        for i, p in enumerate(params):
            slot = {"name": p.name, "aliases": [p.name, *p.aliases], "shape": p.shape, "dtype": p.dtype,
                    "offset": 0, "numel": p.numel}
            group = {"index": i, "unit": None, "dtype": p.dtype, "trainable": p.trainable, "numel": p.numel,
                     "padded_numel": p.numel, "shard_numel": p.numel,
                     "master_dtype": "float32" if p.trainable else None, "slots": [slot],
                     "state_keys": self.state_keys if p.trainable else [],
                     "scalar_keys": self.scalar_keys if p.trainable else []}
            self.groups.append(group)
            for name in slot["aliases"]:
                self.where[name] = (group, slot)
                self.by_name[name] = p
        self.configs = _config_files(folder)
        # what _stage, load_state and the export read from a manifest
        self.m: Dict[str, Any] = {
            "format": self.kind, "save_id": f"{self.kind}:{folder}:{step}", "world_size": world_size,
            "stage": stage, "step": step,
            "model": self._model_layout(description, buffer_info, state_dict_keys),
            "optimizer": {"class": None, "classes": _optimizer_classes(state_keys, param_groups),
                          "state_keys": self.state_keys,
                          "param_groups": param_groups,
                          "param_group_of": {p.name: p.group for p in params if p.trainable}},
            "loss_scaler": loss_scaler,
        }

    def _model_layout(self, description: str, buffer_info: List[Dict[str, Any]],
                      state_dict_keys: Optional[List[str]]) -> Dict[str, Any]:
        """The manifest's "model" entry (layout.model_layout's fields) from what the folder records: the keys in
        the folder's order, ties as exact-name patterns on the aliases (save_pretrained keeps the first name), the
        class and precision from a config.json beside the folder when there is one."""
        names = [n for p in self.params for n in (p.name, *p.aliases)] + [b["name"] for b in buffer_info]
        keys = [k for k in (state_dict_keys or []) if k in set(names)]
        keys += [n for n in names if n not in set(keys)]
        config = json.loads(self.configs["config.json"]) if "config.json" in self.configs else {}
        arch = (config.get("architectures") or [None])[0]
        dtypes = [p.dtype for p in self.params]
        return {
            "class": arch or description, "transformers": arch is not None,
            "dtype": dtypes[0] if dtypes else None,
            "can_generate": bool(arch and arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))),
            "num_parameters": sum(p.numel for p in self.params),
            "state_dict_keys": keys,
            "tied_weight_patterns": [f"^{re.escape(a)}$" for p in self.params for a in p.aliases],
            "keys_to_ignore_on_save": [],
            "buffers": buffer_info,
            "description": description,
        }

    # -------------------------------------------------------------------------------- _stage's interface
    def read(self, name: str, kind: str, lo: int, hi: int) -> Optional[torch.Tensor]:
        """Elements [lo, hi) of parameter `name` (kind "values" or "state.<key>"); None if that state is absent."""
        p = self.by_name[name]
        if not 0 <= lo <= hi <= p.numel:
            raise CheckpointError(f"{self.dir}: elements {lo}..{hi} of {name} requested, it has {p.numel}")
        if kind != "values" and not p.trainable:
            return None
        out = self._read(p, kind, lo, hi)
        if out is not None and out.numel() != hi - lo:
            raise CheckpointError(f"{self.dir}: {kind} of {name} [{lo}, {hi}) read {out.numel()} elements: the "
                                  f"checkpoint's partitions do not cover the parameter (damaged or mixed files)")
        return out

    def scalar(self, name: str, key: str, lo: int = 0, hi: Optional[int] = None) -> Optional[float]:
        p = self.by_name[name]
        return self._scalar(p, key) if p.trainable else None

    def buffer(self, name: str) -> torch.Tensor:
        return self._buffer(name)

    def buffers_file(self) -> str:
        return ""

    def close(self) -> None:
        """Drop open files."""

    # -------------------------------------------------------------------------------- the formats implement
    def _read(self, p: ParamInfo, kind: str, lo: int, hi: int) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def _scalar(self, p: ParamInfo, key: str) -> Optional[float]:
        raise NotImplementedError

    def _buffer(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def files_for(self, name: str, lo: int, hi: int) -> List[str]:
        """The files that hold elements [lo, hi) of parameter `name` (opened and checked before any read)."""
        raise NotImplementedError

    def open_file(self, fname: str) -> Any:
        raise NotImplementedError
