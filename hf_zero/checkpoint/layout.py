"""The model's state-dict layout, as a checkpoint manifest and a consolidated export need it: every
`model.state_dict()` key in order, tied-weight declarations, persistent buffers, and the config files
`save_pretrained` would write. Read from the module tree without calling `state_dict()` (stage 3 refuses it).
"""
from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..engine.state import group_layout, state_dict_layout

if TYPE_CHECKING:
    from ..engine import ZeroEngine

logger = logging.getLogger("hf_zero")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tied_weight_patterns(model: nn.Module) -> List[str]:
    """What Transformers' save_pretrained drops from tied groups: every submodule's `_tied_weights_keys`."""
    out: List[str] = []
    for name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        out.extend(f"{name}.{k}" if name else k for k in (tied.keys() if isinstance(tied, dict) else tied))
    return out


def _warn_extra_state(model: nn.Module) -> None:
    extra = [f"{prefix}._extra_state" if prefix else "_extra_state"
             for prefix, module in model.named_modules(remove_duplicate=False)
             if type(module).get_extra_state is not nn.Module.get_extra_state]
    if extra:
        logger.warning("hf_zero: %s keep extra state (get_extra_state); checkpoints and exports do not include it",
                       extra[:3])


def model_layout(engine: "ZeroEngine") -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """The model's state-dict layout (for the manifest and the export) and its persistent buffers by name."""
    model = engine.model
    keys, buffers = state_dict_layout(model)
    _warn_extra_state(model)
    slots = {s["name"]: s for g in group_layout(engine) for s in g["slots"]}
    dtype = None
    for name, p in model.named_parameters():  # PreTrainedModel.dtype: the first floating parameter's dtype
        if name in slots and getattr(torch, slots[name]["dtype"]).is_floating_point:
            dtype = slots[name]["dtype"]
            break
    can_generate = getattr(model, "can_generate", None)
    layout = {
        "class": type(model).__name__.removeprefix("FSDP"),
        "transformers": hasattr(model, "save_pretrained") and hasattr(getattr(model, "config", None), "to_json_string"),
        "dtype": dtype,
        "can_generate": bool(can_generate()) if callable(can_generate) else False,
        "num_parameters": sum(s["numel"] for s in slots.values()),
        "state_dict_keys": keys,
        "tied_weight_patterns": _tied_weight_patterns(model),
        "keys_to_ignore_on_save": sorted(getattr(model, "_keys_to_ignore_on_save", None) or []),
        "buffers": [{"name": b.names[0], "aliases": b.names, "shape": list(b.tensor.shape),
                     "dtype": dtype_name(b.tensor.dtype)} for b in buffers],
    }
    values = {b.names[0]: b.tensor for b in buffers}
    return layout, values


def config_texts(config: Any, generation_config: Any = None, architecture: Optional[str] = None,
                 dtype: Optional[str] = None) -> Dict[str, bytes]:
    """config.json (and generation_config.json) as save_pretrained writes them, with `dtype` and `architectures`
    set as it sets them; {} when `config` is not a Transformers config."""
    if not hasattr(config, "save_pretrained"):
        return {}
    out: Dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="hfz_cfg_") as scratch:
        config = copy.deepcopy(config)
        if dtype is not None:
            config.dtype = dtype
        if architecture is not None:
            config.architectures = [architecture]
        config.save_pretrained(scratch)
        if generation_config is not None:
            generation_config.save_pretrained(scratch)
        for name in ("config.json", "generation_config.json"):
            path = Path(scratch) / name
            if path.is_file():
                out[name] = path.read_bytes()
    return out


def model_config_texts(model: nn.Module, dtype: Optional[str]) -> Dict[str, bytes]:
    """The config files save_pretrained writes for `model` (generation config only if it can generate)."""
    can_generate = getattr(model, "can_generate", None)
    gen = getattr(model, "generation_config", None) if callable(can_generate) and can_generate() else None
    return config_texts(getattr(model, "config", None), gen, type(model).__name__.removeprefix("FSDP"), dtype)
