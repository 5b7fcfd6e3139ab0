"""hf_zero.from_pretrained: a Hugging Face model whose weights stay in their files until shard_model reads each
rank's shards.

    model = hf_zero.from_pretrained(AutoModelForCausalLM, "path/to/folder", torch_dtype=torch.bfloat16)
    engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-4), ZeroConfig(stage=3))

The model is built from the folder's config with its parameters on the meta device and its buffers computed as
usual (`parameters_on_meta`), carries its generation config, and remembers where its weights are and how
Transformers initialises what a checkpoint lacks (`model.hf_zero_weights`). Like `from_pretrained` it is in
eval mode and takes the checkpoint's dtype unless told otherwise.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig

from ..engine.weights import INDEX, SINGLE, PretrainedWeights, meta_copy, parameters_on_meta


def _dtype(value: Any, config: Any) -> torch.dtype:
    if value is None or value == "auto":
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(value, str):
        value = getattr(torch, value.replace("torch.", ""), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"torch_dtype={value!r} is not a torch dtype")
    return value


def init_adapter_param(model: nn.Module, name: str) -> Optional[torch.Tensor]:
    """Initial values of an adapter parameter added on top of a meta-loaded base (PEFT's LoRA A/B): PEFT's own
    `reset_lora_parameters` on a host copy of the LoRA layer. None for anything else (the base's own init)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the innermost ancestor that is a LoRA layer
        layer = model.get_submodule(".".join(parts[:i]))
        if hasattr(layer, "reset_lora_parameters") and hasattr(layer, "lora_A"):
            break
    else:
        return None
    rest = parts[i:]  # e.g. ["lora_A", "default", "weight"]
    if len(rest) != 3 or rest[0] not in ("lora_A", "lora_B"):
        return None
    adapter = rest[1]
    host = meta_copy(layer)  # never reads the (maybe already sharded) originals
    for kind in ("lora_A", "lora_B"):
        getattr(host, kind)[adapter].to_empty(device="cpu")
    config = getattr(model, "peft_config", {}).get(adapter) if hasattr(model, "peft_config") else None
    host.reset_lora_parameters(adapter, getattr(config, "init_lora_weights", True))
    return getattr(getattr(host, rest[0])[adapter], rest[2]).detach()


def from_pretrained(model_class: Any, path: Union[str, os.PathLike], torch_dtype: Any = "auto",
                    dtype: Optional[Any] = None, attn_implementation: Optional[str] = None,
                    **config_kwargs: Any) -> nn.Module:
    """A model of `model_class` (e.g. AutoModelForCausalLM) for the local folder `path`, parameters on the meta
    device; `shard_model` (or `HfZeroAccelerator.prepare`, `ZeroTrainer`) reads its weights into shards.
    `torch_dtype` / `dtype` and `attn_implementation` mean what they mean to `from_pretrained`; other keyword
    arguments override config values."""
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: hf_zero.from_pretrained reads a local folder (what save_pretrained "
                                f"writes); download a Hub model first, e.g. with huggingface_hub.snapshot_download")
    if not (os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))):
        raise FileNotFoundError(f"{path} holds neither {SINGLE} nor {INDEX}: hf_zero loads safetensors weights "
                                f"(convert .bin checkpoints with save_pretrained(safe_serialization=True))")
    config = AutoConfig.from_pretrained(path, local_files_only=True, **config_kwargs)
    want = _dtype(dtype if dtype is not None else torch_dtype, config)
    with parameters_on_meta():
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = model_class.from_config(config, dtype=want, **kwargs)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    model.hf_zero_weights = PretrainedWeights(
        path, init_module=getattr(model, "_init_weights", None),
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
        init_param=init_adapter_param, rename=((".base_layer.", "."),))
    model.eval()
    return model
