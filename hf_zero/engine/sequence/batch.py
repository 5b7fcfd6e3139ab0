"""A batch cut into the sp ranks' chunks of the sequence, and what attention and the loss need of the whole.

Labels are shifted before the cut (the target of a chunk's last token is the next chunk's first token, which the
chunk does not hold), position ids are those of the whole sequence (RoPE and absolute embeddings see global
positions), and the padding mask and document boundaries stay whole for attention, which sees the whole sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F

from .groups import SequenceGroups

IGNORE_INDEX = -100  # torch's cross_entropy default, what Transformers' collators put where there is no target

# the keyword arguments of a causal LM's forward that run along the sequence (dimension 1)
SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels",
                   "token_type_ids")


@dataclass
class SequenceBatch:
    """The whole sequence's facts one forward needs on every sp rank.

    `positions`: [B or 1, S] position ids of the whole sequence; `padding`: [B, S] bool (True = a real token), or
    None when nothing is padded; `valid_tokens`: how many shifted labels are not IGNORE_INDEX in the whole
    sequence (the plain loss's denominator), None without labels.
    """

    groups: SequenceGroups
    length: int
    positions: torch.Tensor
    padding: Optional[torch.Tensor] = None
    valid_tokens: Optional[torch.Tensor] = None
    separate_documents: bool = True
    hidden: Optional[torch.Tensor] = None  # the last hidden states, kept for a tiled loss (None: the model's logits)
    # the whole sequence's mask in the form the kernel takes (a BlockMask for flex, None for flash, ...); None: the
    # dense bool mask of _build_mask, which is sdpa's
    mask_builder: Optional[Callable[["SequenceBatch"], Any]] = field(default=None, repr=False)
    _mask: Any = field(default=None, repr=False)

    @property
    def chunk_length(self) -> int:
        return self.length // self.groups.size

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a [B, S, ...] tensor."""
        start = self.groups.rank * self.chunk_length
        return t[:, start:start + self.chunk_length]

    def documents(self) -> Optional[torch.Tensor]:
        """[B or 1, S] document index of each token when the batch is packed (a position that does not follow the
        one before starts a document), else None."""
        p = self.positions
        starts = torch.diff(p, dim=-1, prepend=p[:, :1] - 1) != 1
        if not bool(starts[:, 1:].any()):
            return None
        return starts.cumsum(-1)

    def attention_mask(self) -> Any:
        """The mask over the whole sequence: `mask_builder`'s, else [B, 1, S, S] bool (True = may attend), or None
        when causal alone is right (then the kernel's own causal mode runs and no S x S tensor exists). Built once
        per forward."""
        if self._mask is None:
            built = self.mask_builder(self) if self.mask_builder is not None else self._build_mask()
            self._mask = (built,)
        return self._mask[0]

    def _build_mask(self) -> Any:
        documents = self.documents() if self.separate_documents else None
        if documents is None and self.padding is None:
            return None
        s = self.length
        device = self.positions.device
        mask = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]
        if documents is not None:
            mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
        if self.padding is not None:
            mask = mask & self.padding[:, None, None, :].to(device)
        # a query that may attend to nothing (left padding) attends to itself: its output is never a target, and a
        # row with no key gives NaN, which would reach the gradients through 0 * NaN
        empty = ~mask.any(-1, keepdim=True)
        return mask | (empty & torch.eye(s, dtype=torch.bool, device=device))


def shard_inputs(kwargs: Dict[str, Any], groups: SequenceGroups, separate_documents: bool = True) -> Dict[str, Any]:
    """The forward's keyword arguments for this sp rank: the sequence inputs cut to its chunk, `shift_labels` made
    from `labels` before the cut, `position_ids` always given, and "hf_zero_sequence" the SequenceBatch (see it for
    `separate_documents`, which applies only without a padding mask).

    Raises ValueError when the sequence length is not a multiple of the sp size."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        raise ValueError("sequence parallelism cuts input_ids or inputs_embeds along the sequence; got neither")
    batch, length = tokens.shape[0], tokens.shape[1]
    if length % groups.size:
        raise ValueError(
            f"sequence length {length} is not a multiple of sequence_parallel_size={groups.size}: pad every batch to a "
            f"multiple of {groups.size} (a collator's pad_to_multiple_of={groups.size}, or the tokenizer's), with "
            f"labels -100 on the padding")
    out = dict(kwargs)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=tokens.device)[None]
    out["position_ids"] = positions
    labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is not None and shifted is None:
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if shifted is not None:
        out["shift_labels"] = shifted
        if labels is None:
            out["labels"] = shifted  # the model computes a loss only when labels are given
    mask = kwargs.get("attention_mask")
    padding = None
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(f"sequence parallelism takes a [batch, sequence] attention_mask; got shape "
                             f"{tuple(mask.shape)}")
        if not bool(mask.bool().all()):
            padding = mask.bool()
    seq = SequenceBatch(groups=groups, length=length, positions=positions.expand(positions.shape[0], length),
                        padding=padding, separate_documents=separate_documents and mask is None,
                        valid_tokens=None if shifted is None else (shifted != IGNORE_INDEX).sum())
    for key in SEQUENCE_INPUTS:
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            if value.shape[0] not in (1, batch):
                raise ValueError(f"{key} has batch {value.shape[0]}, the inputs {batch}")
            out[key] = seq.chunk(value)
    out["hf_zero_sequence"] = seq
    return out
