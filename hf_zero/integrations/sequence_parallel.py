"""Ulysses sequence parallelism in a Transformers causal LM, through Transformers' own extension points only.

- attention: the model's kernel (sdpa, flash, flex) is registered again under "hf_zero_ulysses_<kernel>" in
  Transformers' AttentionInterface, wrapped in the all-to-alls of engine/sequence/attention.py, with the kernel's
  own mask function under the same name; `set_attn_implementation` selects it. No model class is patched.
- inputs: a forward pre-hook on the model cuts the batch to this rank's chunk of the sequence (labels shifted first,
  global position ids; engine/sequence/batch.py) and passes the whole sequence's facts down as the keyword argument
  "hf_zero_sequence", which Transformers hands to every attention call and to the loss function.
- loss: the model's `loss_function` (the property Transformers lets a model set) returns the whole sequence's loss
  (engine/sequence/loss.py).

A forward with a cache (generation) is not cut: every rank runs it whole, with the kernel and mask it had.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from ..engine.sequence import SequenceGroups, sequence_parallel_loss, shard_inputs, ulysses_attention

logger = logging.getLogger("hf_zero")

PREFIX = "hf_zero_ulysses_"
KWARG = "hf_zero_sequence"


def _kernels() -> Tuple[Any, Any]:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return (AttentionInterface, ALL_ATTENTION_FUNCTIONS), (AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS)


def _wrapped(kernel: Callable[..., Any]) -> Callable[..., Any]:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Tuple[torch.Tensor, Any]:
        sequence = kwargs.pop(KWARG, None)
        if sequence is None:  # not cut (generation): the kernel over what this rank has, as without hf_zero
            return kernel(module, query, key, value, attention_mask, **kwargs)
        return ulysses_attention(kernel, module, query, key, value, sequence, **kwargs)

    return attention


def register_attention(kernel_name: str) -> str:
    """Register the Ulysses wrapper of `kernel_name` (and its mask function) with Transformers; returns its name."""
    if kernel_name.startswith(PREFIX):
        return kernel_name
    if kernel_name == "eager":
        raise ValueError("sequence parallelism needs an attention kernel that takes the whole sequence without an "
                         "S x S score matrix per head in Python: load the model with attn_implementation='sdpa' (or "
                         "'flash_attention_2' / 'flex_attention' where installed), not 'eager'")
    (attention, attention_registry), (masks, mask_registry) = _kernels()
    if kernel_name not in attention_registry:
        raise ValueError(f"attention implementation {kernel_name!r} is not one Transformers knows: cannot wrap it")
    name = PREFIX + kernel_name
    if name not in attention_registry:
        attention.register(name, _wrapped(attention_registry[kernel_name]))
        masks.register(name, mask_registry[kernel_name])
    return name


class SequenceParallelLoss:
    """The model's loss function under sequence parallelism: the whole sequence's loss when the forward was cut
    (it carries "hf_zero_sequence"), the model's own loss function otherwise."""

    def __init__(self, original: Callable[..., torch.Tensor]) -> None:
        self.original = original

    def __call__(self, logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                 num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        sequence = kwargs.pop(KWARG, None)
        if sequence is None or shift_labels is None:
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        return sequence_parallel_loss(logits, shift_labels, sequence, num_items_in_batch, ignore_index)


def _generating(kwargs: Dict[str, Any]) -> bool:
    return bool(kwargs.get("use_cache")) or any(kwargs.get(k) is not None for k in ("cache", "past_key_values"))


def _cut_kwargs(model: nn.Module, kwargs: Dict[str, Any], groups: SequenceGroups) -> Dict[str, Any]:
    # Transformers separates packed documents (position ids restarting) only when the forward has neither a padding
    # mask nor a cache, and a training forward makes a cache whenever config.use_cache is on: the same rule here,
    # so the cut forward attends as the whole one would. The cut forward itself keeps no cache (one of chunks would
    # be of no use, and costs the memory long sequences need).
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = bool(getattr(model.config, "use_cache", False))
    out = shard_inputs(kwargs, groups, separate_documents=not use_cache)
    out["use_cache"] = False
    return out


def enable_sequence_parallel(model: nn.Module, groups: SequenceGroups) -> None:
    """Make `model` (a Transformers causal LM) split every forward's sequence across `groups`' sp ranks."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"sequence parallelism plugs into Transformers models (attention interface, loss function); "
                         f"{type(model).__name__} is not one")
    loss_type = getattr(model, "loss_type", None) or "ForCausalLM"
    if loss_type != "ForCausalLM":
        raise ValueError(f"sequence parallelism computes a causal LM's loss; {type(model).__name__} has loss type "
                         f"{loss_type!r}")
    model.set_attn_implementation(register_attention(config._attn_implementation))
    if not isinstance(getattr(model, "_loss_function", None), SequenceParallelLoss):
        model.loss_function = SequenceParallelLoss(model.loss_function)

    def cut(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        if KWARG in kwargs or _generating(kwargs):
            return None
        if args:  # input_ids, positionally
            if len(args) > 1:
                raise ValueError("under sequence parallelism pass the model's inputs by keyword (input_ids=..., "
                                 "attention_mask=..., labels=...), as Transformers' Trainer and collators do")
            kwargs = {"input_ids": args[0], **kwargs}
        return (), _cut_kwargs(module, kwargs, groups)

    model.register_forward_pre_hook(cut, with_kwargs=True)
    logger.info("hf_zero: sequence parallelism over %d ranks (%d data-parallel replicas), attention %s",
                groups.size, groups.data_parallel_size, config._attn_implementation)
