"""Tiles over the sequence for what grows with it (ALST's tiled loss and tiled MLP): a position-wise computation
run over tiles of tokens, each recomputed in the backward (non-reentrant checkpoints), so its largest intermediate
exists for one tile at a time: the [tokens, vocab] logits of the loss, the [tokens, intermediate] MLP activations.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _tile_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
               ignore_index: int) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                           reduction="sum")


def tiled_cross_entropy_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                            tile_tokens: int, ignore_index: int = -100) -> torch.Tensor:
    """Sum over tokens of cross_entropy(head(hidden), labels) in fp32, one tile of `tile_tokens` tokens at a time:
    the logits of one tile exist at once, in the forward and again in the backward."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], tile_tokens):
        stop = start + tile_tokens
        total = total + checkpoint(_tile_loss, head, h[start:stop], y[start:stop], ignore_index, use_reentrant=False)
    return total


def _contiguous_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.forward(x.contiguous())


class TiledMLP:
    """Forward hooks that run a position-wise module ([B, S, H] -> [B, S, H]: an MLP, a norm) over tiles of the
    sequence.

    The pre-hook keeps the input and hands the module's own forward one token (its output is dropped: no model code
    changes, and modules that cannot take zero tokens still run); the forward hook returns the tiles' outputs, each
    computed by the module's forward under a checkpoint."""

    def __init__(self, tile_tokens: int) -> None:
        self.tile_tokens = tile_tokens
        self._inputs: Dict[int, torch.Tensor] = {}

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, module: nn.Module, args: Tuple[Any, ...]) -> Optional[Tuple[Any, ...]]:
        x = args[0]
        if x.dim() != 3 or x.shape[1] <= self.tile_tokens:
            return None
        self._inputs[id(module)] = x
        return (x[:, :1].contiguous(),) + tuple(args[1:])

    def _after(self, module: nn.Module, args: Tuple[Any, ...], output: torch.Tensor) -> Optional[torch.Tensor]:
        x = self._inputs.pop(id(module), None)
        if x is None:
            return None
        # a tile of a batch is a strided view; made contiguous inside the checkpoint, whose saved input is the view
        tiles = [checkpoint(_contiguous_forward, module, x[:, start:start + self.tile_tokens], use_reentrant=False)
                 for start in range(0, x.shape[1], self.tile_tokens)]
        return torch.cat(tiles, dim=1)
