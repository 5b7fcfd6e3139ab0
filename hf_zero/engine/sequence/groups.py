"""Which ranks share a sequence: N ranks = dp replicas x sp ranks, the sp ranks of a replica consecutive (as
DeepSpeed's Ulysses and FSDP2's context parallelism lay them out, so on a GPU host they share NVLink)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass
class SequenceGroups:
    """The sequence-parallel layout of one rank.

    `size` ranks split each sequence (sp); `group` is this rank's sp group (None when size is 1);
    `data_parallel_size` = N / sp replicas read distinct samples; `data_parallel_rank` is this rank's replica.
    """

    size: int
    rank: int
    group: Optional[dist.ProcessGroup]
    data_parallel_size: int
    data_parallel_rank: int

    @classmethod
    def build(cls, size: int, world_size: Optional[int] = None, rank: Optional[int] = None) -> "SequenceGroups":
        """Collective over the default group when size > 1 (every rank creates every sp group, as new_group needs).

        Raises ValueError when the world size is not a multiple of `size`."""
        if size < 1:
            raise ValueError(f"sequence_parallel_size={size}: expected a positive number of ranks")
        initialized = dist.is_available() and dist.is_initialized()
        world = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        me = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if world % size:
            raise ValueError(f"sequence_parallel_size={size} does not divide the {world} ranks launched: launch a "
                             f"multiple of {size} processes, or choose a sequence_parallel_size that divides {world}")
        group = None
        if size > 1:
            for replica in range(world // size):  # every rank takes part in creating every group
                ranks = list(range(replica * size, (replica + 1) * size))
                made = dist.new_group(ranks)
                if me in ranks:
                    group = made
        return cls(size=size, rank=me % size, group=group, data_parallel_size=world // size,
                   data_parallel_rank=me // size)
