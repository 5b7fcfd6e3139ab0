"""The differentiable all-to-all of Ulysses: split a tensor along one dimension across the group's ranks and
concatenate what arrives along another. Its backward is the same exchange with the two dimensions swapped."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all-to-all over {size} ranks of a dimension of size {x.shape[scatter_dim]}")
    # chunk j (along scatter_dim) goes to rank j: lay the chunks out as the leading dimension
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[i] came from rank i: its piece along gather_dim comes i-th
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int,  # type: ignore[override]
                group) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int,
               group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Collective over `group`: `x` cut into group-size chunks along `scatter_dim`, chunk j sent to rank j, and the
    chunks received concatenated along `gather_dim` in rank order. Differentiable."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)
