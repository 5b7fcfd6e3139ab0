"""The Transformers calls the tools on top (tools/estimate, tools/bench) make: configs from dicts or
files, causal LMs from configs, activation functions by name. They live here so that Transformers is imported in
`integrations/` only; callers import this module inside their functions, so `hf-zero --help` stays light.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers import logging as hf_logging
from transformers.activations import ACT2FN


def quiet() -> None:
    """Only Transformers' errors on the console (benchmarks build many models from configs)."""
    hf_logging.set_verbosity_error()


def config_from_dict(values: Dict[str, Any]) -> PretrainedConfig:
    """A config from a dict whose "model_type" picks the class."""
    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError("no 'model_type' key; cannot tell which architecture to build")
    return AutoConfig.for_model(model_type, **values)


def config_from_path(path_or_config: Any) -> PretrainedConfig:
    """A config from a PretrainedConfig (returned as is), a local model folder, or a local JSON file."""
    if isinstance(path_or_config, PretrainedConfig):
        return path_or_config
    path = str(path_or_config)
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such config file or folder (only local configs are read)")
    with open(path) as f:
        values = json.load(f)
    try:
        return config_from_dict(values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def causal_lm_from_config(config: PretrainedConfig) -> nn.Module:
    """`AutoModelForCausalLM.from_config` on the current default device (meta inside `torch.device("meta")`)."""
    return AutoModelForCausalLM.from_config(config)


def meta_model(path_or_config: Any) -> nn.Module:
    """A causal LM on the meta device from a local config.json (or its folder), or a PretrainedConfig."""
    with torch.device("meta"):
        return causal_lm_from_config(config_from_path(path_or_config))


def auto_causal_lm() -> Any:
    """`AutoModelForCausalLM` itself (for tools that call its from_pretrained, as the peers they measure do)."""
    return AutoModelForCausalLM


def deepspeed_zero3_config(ds_config: Dict[str, Any]) -> Any:
    """Transformers' HfDeepSpeedConfig: while the returned object lives, from_pretrained builds under zero.Init."""
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def rope_init_function(rope_type: str) -> Callable:
    """Transformers' function that computes a rotary embedding's `inv_freq` for `rope_type`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type]


def activation_function(name: Any) -> Optional[Callable]:
    """Transformers' activation module for `name` (config.hidden_act and friends), or None if it has none."""
    if not isinstance(name, str) or name not in ACT2FN:
        return None
    return ACT2FN[name]


DRY_RUN_ATTENTION = "hf_zero_dry_run_sdpa"


def _unpacked_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """Transformers' sdpa mask as it comes for the dry run's batch on real tensors: one sequence, not packed.

    Without a padding mask or a cache (a training forward under checkpointing or sequence parallelism), Transformers
    looks at the position ids for packed documents. It cannot read a fake tensor's values, so it takes them as
    packed and builds a b x 1 x S x S boolean mask (17 GB at 128K tokens) that a real run of the same batch never
    builds: there the positions are read as one document and the kernel's causal mode runs with no mask. Only that
    composition is undone (a causal mask function that is not the plain one, no padding, no window, no vmap'd extra
    mask functions); every other mask is Transformers' own."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (kwargs.get("mask_function", causal_mask_function) is not causal_mask_function
            and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
            and not kwargs.get("use_vmap")):
        kwargs.update(mask_function=causal_mask_function, allow_is_causal_skip=True)
    return sdpa_mask(*args, **kwargs)


def attend_as_on_real_tensors(model: nn.Module) -> None:
    """For the dry run's fake tensors: an sdpa model runs Transformers' sdpa kernel with `_unpacked_sdpa_mask`,
    registered under DRY_RUN_ATTENTION through Transformers' attention interfaces (as hf_zero registers its Ulysses
    kernel)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    if DRY_RUN_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(DRY_RUN_ATTENTION, ALL_ATTENTION_FUNCTIONS["sdpa"])
    if DRY_RUN_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(DRY_RUN_ATTENTION, _unpacked_sdpa_mask)
    model.set_attn_implementation(DRY_RUN_ATTENTION)
