"""Ulysses attention around any attention kernel: q, k and v arrive sequence-sharded ([B, H, S/sp, D]), are
all-to-all'd to head-sharded ([B, H/sp, S, D]) so the kernel attends over the whole sequence for this rank's share of
the heads, and the output goes back to sequence-sharded. The kernel and the model do not know.

Key/value heads that sp does not divide (GQA with fewer KV heads than ranks) are replicated to sp heads first, so
each rank gets the KV head its query heads use; autograd sums the replicas' gradients."""
from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

from .all_to_all import all_to_all
from .batch import SequenceBatch


class _HeadsView:
    """The attention module as the kernel should see it after the exchange: its own attributes, with the number of
    query heads per KV head this rank holds (kernels repeat KV heads by `num_key_value_groups`)."""

    def __init__(self, module: Any, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(kernel: Callable[..., Tuple[torch.Tensor, Any]], module: Any, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, sequence: SequenceBatch,
                      **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """Run `kernel(module, q, k, v, attention_mask, **kwargs)` (Transformers' attention-function signature, output
    [B, S, H, D]) over the whole sequence; returns this rank's chunk, [B, S/sp, H, D]. Collective over the sp group.
    """
    groups = sequence.groups
    sp = groups.size
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp:
        raise ValueError(f"{heads} attention heads do not divide among sequence_parallel_size={sp} ranks: choose a "
                         f"sequence_parallel_size that divides {heads}")
    view: Any = module
    if kv_heads % sp:
        if sp % kv_heads:
            raise ValueError(f"{kv_heads} key/value heads cannot be replicated evenly onto sequence_parallel_size={sp} "
                             f"ranks: choose a sequence_parallel_size that {kv_heads} divides, or that divides it")
        key = key.repeat_interleave(sp // kv_heads, dim=1)
        value = value.repeat_interleave(sp // kv_heads, dim=1)
        view = _HeadsView(module, heads // sp)  # one KV head per rank now
    q = all_to_all(query, 1, 2, groups.group)
    k = all_to_all(key, 1, 2, groups.group)
    v = all_to_all(value, 1, 2, groups.group)
    if "position_ids" in kwargs:  # kernels that read positions (flash's packed sequences) see the whole sequence's
        kwargs["position_ids"] = sequence.positions
    out, _ = kernel(view, q, k, v, sequence.attention_mask(), **kwargs)
    return all_to_all(out, 1, 2, groups.group), None
