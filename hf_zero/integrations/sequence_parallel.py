"""Long sequences in a Transformers causal LM (Ulysses sequence parallelism, tiled loss, tiled MLP), through
Transformers' own extension points and torch's hooks only.

- attention: the model's kernel (sdpa, flash, flex) is registered again under "hf_zero_ulysses_<kernel>" in
  Transformers' AttentionInterface, wrapped in the all-to-alls of engine/sequence/attention.py, with the kernel's
  own mask function under the same name; `set_attn_implementation` selects it. No model class is patched.
- inputs: a forward pre-hook on the model cuts the batch to this rank's chunk of the sequence (labels shifted first,
  global position ids; engine/sequence/batch.py) and passes the whole sequence's facts down as the keyword argument
  "hf_zero_sequence", which Transformers hands to every attention call and to the loss function.
- loss: the model's `loss_function` (the property Transformers lets a model set) returns the whole sequence's loss
  (engine/sequence/loss.py). Tiled, the forward is given logits_to_keep=1 (the head runs on the last position), a
  forward hook on the base model keeps its last hidden states, and the loss runs the head over them tile by tile.
- MLP tiles: forward hooks on each module named "mlp" (engine/sequence/tiled.py).

A forward with a cache (generation) is not cut: every rank runs it whole, with the kernel and mask it had.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from ..engine.sequence import (SequenceBatch, SequenceGroups, TiledMLP, sequence_parallel_loss, shard_inputs,
                               ulysses_attention)

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
    """The model's loss function once `enable_long_sequences` ran: the whole sequence's loss when the forward was
    prepared (it carries "hf_zero_sequence"; tiled when `tile_tokens`), the model's own loss function otherwise."""

    def __init__(self, original: Callable[..., torch.Tensor], head: Optional[nn.Module] = None,
                 tile_tokens: int = 0) -> None:
        self.original, self.head, self.tile_tokens = original, head, tile_tokens

    def __call__(self, logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                 num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        sequence = kwargs.pop(KWARG, None)
        if sequence is None or shift_labels is None:
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        return sequence_parallel_loss(logits, shift_labels, sequence, num_items_in_batch, ignore_index,
                                      head=self.head, tile_tokens=self.tile_tokens)


def _generating(kwargs: Dict[str, Any]) -> bool:
    return bool(kwargs.get("use_cache")) or any(kwargs.get(k) is not None for k in ("cache", "past_key_values"))


def _prepare_kwargs(model: nn.Module, kwargs: Dict[str, Any], groups: SequenceGroups,
                    tiled_loss: bool) -> Dict[str, Any]:
    # Transformers separates packed documents (position ids restarting) only when the forward has neither a padding
    # mask nor a cache, and a training forward makes a cache whenever config.use_cache is on: the same rule here,
    # so the cut forward attends as the whole one would. The cut forward itself keeps no cache (one of chunks would
    # be of no use, and costs the memory long sequences need).
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = bool(getattr(model.config, "use_cache", False))
    out = shard_inputs(kwargs, groups, separate_documents=not use_cache)
    out["use_cache"] = False
    if groups.size > 1:
        out[KWARG].mask_builder = functools.partial(_whole_sequence_mask, model.config)
        # The wrapped kernel takes the whole sequence's mask from the SequenceBatch. A 4D mask reaches the layers as
        # given, so this one-element "attend anywhere" mask keeps the model from building a chunk's mask
        # ([B, 1, S/sp, S/sp] with padding or packed documents) that no kernel would read.
        out["attention_mask"] = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=out[KWARG].positions.device)
    if tiled_loss and out.get("shift_labels") is not None:
        out["logits_to_keep"] = 1  # the loss reads the hidden states (tiled): the head runs on the last position only
    return out


def _whole_sequence_mask(config: Any, sequence: SequenceBatch) -> Any:
    """Transformers' own mask for the whole sequence, in the form the wrapped kernel takes (the registered mask
    function is the kernel's): None for causal sdpa, a bool mask with padding or packed documents, a BlockMask for
    flex. Packed documents are told apart exactly when the model's own forward would (SequenceBatch)."""
    from transformers.masking_utils import create_causal_mask

    batch = sequence.positions.shape[0] if sequence.padding is None else sequence.padding.shape[0]
    shape_only = torch.empty(batch, sequence.length, 0, device=sequence.positions.device)
    return create_causal_mask(config=config, inputs_embeds=shape_only, attention_mask=sequence.padding, cache=None,
                              position_ids=sequence.positions if sequence.separate_documents else None)


def _check_heads(config: Any, sp: int) -> None:
    """At prepare time, what ulysses_attention would find at the first forward: heads that sp does not divide."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        return
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % sp:
        raise ValueError(f"the model's {heads} attention heads do not divide among sequence_parallel_size={sp} ranks: "
                         f"choose a sequence_parallel_size that divides {heads}")
    if kv % sp and sp % kv:
        raise ValueError(f"the model's {kv} key/value heads cannot be replicated evenly onto sequence_parallel_size="
                         f"{sp} ranks: choose a sequence_parallel_size that {kv} divides, or that divides it")


def _check_router_loss(asked: bool, sp: int, tiled_mlp_tokens: int) -> None:
    """A mixture-of-experts' auxiliary load-balancing loss averages the router's choices over the tokens one forward
    of its MoE block sees: a chunk under sp, a tile under the tiled MLP. The product of those means is not the whole
    sequence's, so the loss would silently differ from plain training's. Raises ValueError when it is asked for."""
    if asked and (sp > 1 or tiled_mlp_tokens):
        what = f"sequence_parallel_size={sp}" if sp > 1 else f"tiled_mlp_tokens={tiled_mlp_tokens}"
        raise ValueError(f"output_router_logits adds the router's auxiliary load-balancing loss, which under {what} "
                         f"would be computed per chunk or tile, not over the whole sequence as in plain training: "
                         f"set output_router_logits=False (in the config or the call), or turn {what.split('=')[0]} "
                         f"off")


def _transformers_model(model: nn.Module) -> nn.Module:
    # a PEFT model forwards to a Transformers model whose attention and loss function are the ones that run
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(inner, "config", None) is None or not hasattr(inner, "set_attn_implementation"):
        raise ValueError(f"sequence parallelism and tiling plug into Transformers models (attention interface, loss "
                         f"function); {type(inner).__name__} is not one")
    return inner


def _is_norm(module: nn.Module) -> bool:
    # LayerNorm / RMSNorm over the last dimension (Transformers' XxxRMSNorm classes): position-wise; a norm over
    # heads ([B, S, H, D], Qwen3's q_norm) is left whole by the tiles' 3-dimension check
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("RMSNorm")


def _keep_hidden(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
    sequence = kwargs.get(KWARG)
    if sequence is not None:
        sequence.hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state


def enable_long_sequences(model: nn.Module, groups: SequenceGroups, tiled_loss_tokens: int = 0,
                          tiled_mlp_tokens: int = 0) -> None:
    """Make `model` (a Transformers causal LM, or a PEFT model of one) split every forward's sequence across
    `groups`' sp ranks (when there are several), compute its loss over tiles of `tiled_loss_tokens` tokens and its
    MLPs and norms over tiles of `tiled_mlp_tokens` (when not 0)."""
    inner = _transformers_model(model)
    config = inner.config
    loss_type = getattr(inner, "loss_type", None) or "ForCausalLM"
    if loss_type != "ForCausalLM":
        raise ValueError(f"sequence parallelism and the tiled loss compute a causal LM's loss; {type(inner).__name__} "
                         f"has loss type {loss_type!r}")
    text = getattr(config, "get_text_config", lambda: config)()
    _check_router_loss(bool(getattr(text, "output_router_logits", False)), groups.size, tiled_mlp_tokens)
    if groups.size > 1:
        _check_heads(config, groups.size)
        inner.set_attn_implementation(register_attention(config._attn_implementation))
    head = None
    if tiled_loss_tokens:
        head = inner.get_output_embeddings()
        if head is None or "logits_to_keep" not in inspect.signature(inner.forward).parameters:
            raise ValueError(f"tiled_loss_tokens needs a causal LM whose forward takes logits_to_keep and that has an "
                             f"output embedding; {type(inner).__name__} does not: set tiled_loss_tokens=0")
        inner.base_model.register_forward_hook(_keep_hidden, with_kwargs=True)
    if not isinstance(getattr(inner, "_loss_function", None), SequenceParallelLoss):
        inner.loss_function = SequenceParallelLoss(inner.loss_function, head, tiled_loss_tokens)
    mlps = norms = 0
    if tiled_mlp_tokens:
        tiled = TiledMLP(tiled_mlp_tokens)
        for name, module in inner.named_modules():
            if name.rsplit(".", 1)[-1] == "mlp":
                tiled.attach(module)
                mlps += 1
            elif _is_norm(module):  # position-wise too: its fp32 upcasts are the largest per-token tensors left
                tiled.attach(module)
                norms += 1
        if not mlps:
            raise ValueError(f"tiled_mlp_tokens tiles the decoder layers' modules named 'mlp', and "
                             f"{type(inner).__name__} has none: set tiled_mlp_tokens=0")

    def prepare(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        if KWARG in kwargs or _generating(kwargs):
            return None
        if args:  # input_ids, positionally
            if len(args) > 1:
                raise ValueError("under sequence parallelism or tiling pass the model's inputs by keyword "
                                 "(input_ids=..., attention_mask=..., labels=...), as Transformers' Trainer and "
                                 "collators do")
            kwargs = {"input_ids": args[0], **kwargs}
        _check_router_loss(bool(kwargs.get("output_router_logits")), groups.size, tiled_mlp_tokens)
        return (), _prepare_kwargs(inner, kwargs, groups, bool(tiled_loss_tokens))

    model.register_forward_pre_hook(prepare, with_kwargs=True)
    logger.info("hf_zero: sequence parallelism over %d ranks (%d data-parallel replicas), attention %s; tiled loss "
                "%s, tiled MLP %s", groups.size, groups.data_parallel_size, config._attn_implementation,
                f"{tiled_loss_tokens} tokens" if tiled_loss_tokens else "off",
                f"{tiled_mlp_tokens} tokens in {mlps} MLPs and {norms} norms" if tiled_mlp_tokens else "off")
