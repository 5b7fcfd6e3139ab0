"""The whole sequence's causal-LM loss from per-rank chunks.

Each sp rank holds the logits of its chunk. The value returned is plain training's (the sum over every chunk's
valid tokens, divided by the whole sequence's count, or by `num_items_in_batch`), so what a script prints does not
change. Its gradient is sp x this rank's share: the engine averages gradients over all N = dp x sp ranks, and the sp
ranks' shares together are one replica's gradient, so N x (1 / N) x sp x shares = plain training's average over dp.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .batch import IGNORE_INDEX, SequenceBatch
from .tiled import tiled_cross_entropy_sum


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, sequence: SequenceBatch,
                           num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = IGNORE_INDEX,
                           head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                           tile_tokens: int = 0) -> torch.Tensor:
    """Cross-entropy of this rank's chunk, scaled as the module's docstring says. Collective over the sp group.

    With `tile_tokens` and `sequence.hidden`, the logits are `head(sequence.hidden)`, computed tile by tile
    (tiled.py) and `logits` is not read."""
    if tile_tokens and sequence.hidden is not None and head is not None:
        local = tiled_cross_entropy_sum(head, sequence.hidden, shift_labels, tile_tokens, ignore_index)
    else:
        vocab = logits.shape[-1]
        local = F.cross_entropy(logits.float().reshape(-1, vocab), shift_labels.reshape(-1).to(logits.device),
                                ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is not None:
        denominator = num_items_in_batch
        if torch.is_tensor(denominator):
            denominator = denominator.to(local.device)
    else:
        denominator = sequence.valid_tokens.to(local.device)
    total = local.detach().clone()
    if sequence.groups.group is not None:
        dist.all_reduce(total, group=sequence.groups.group)
    share = local * sequence.groups.size / denominator
    return share + (total / denominator - share).detach()
