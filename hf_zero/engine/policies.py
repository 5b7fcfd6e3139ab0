"""What a ZeRO stage means, decided once: the gradient policy and the parameter residency.

The stage is read here and nowhere else in the engine: the planner, the topology, the reducer, the flat buffers,
the optimizer and the state load ask the policies instead (tests/test_memory_budget.py checks the engine's source).

- `GradientPolicy`: how a rank's gradients become the averaged sum over ranks of its owned range.
  - stage 0 (`ALL_REDUCE`): accumulate at full size across micro-batches, all-reduce the full group on a
    synchronising backward and divide on completion (DDP).
  - stage 1 (`REDUCE_SCATTER_ONCE`): accumulate at full size across micro-batches, reduce-scatter each group once
    on the synchronising backward (or at the step), in place; the shard is divided at the step.
  - stages 2/3 (`REDUCE_SCATTER_PER_BUCKET`): every backward, no_sync() included, reduce-scatters each group's
    gradients in buckets of at most C_B as soon as they have arrived, in the reduce dtype, and adds the owned range
    into an fp32 (grad_accum_dtype) shard; no full-size accumulator exists.
- `Residency`: whether a rank holds every parameter's values (stages 0-2, replicated) or only its shard, gathering
  a unit's full values around its use (stage 3, sharded, with the reshard policy of planning.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class GradientPolicy:
    """How gradients are reduced (see the module's docstring)."""

    name: str
    full_accumulator: bool  # gradients accumulate in a full-size buffer across micro-batches (stages 0/1)
    scatters: bool  # the sum is reduce-scattered to its owners (stages 1-3), not all-reduced (stage 0)
    every_backward: bool  # each backward reduces, inside no_sync() too (stages 2/3: buckets, no accumulator)

    @property
    def divides_at_step(self) -> bool:
        """The owned range holds a sum over ranks that the step divides (stage 0 divides as each all-reduce ends)."""
        return self.scatters

    @property
    def partitions(self) -> bool:
        """Each flat group is split over the partition's P ranks, each owning (and stepping) one range of it, which
        is why the sum goes to its owners; stage 0 owns everything on every rank (P = 1, so HSDP has nothing to
        split)."""
        return self.scatters

    @property
    def reduces_in_buckets(self) -> bool:
        """Gradients are reduce-scattered in buckets of the reduce dtype (stages 2/3), which therefore also cap a flat
        group's size and are what qgZ quantizes; a full-size accumulator (stages 0/1) is reduced in place, in its own
        dtype."""
        return not self.full_accumulator


ALL_REDUCE = GradientPolicy("all-reduce at full size", full_accumulator=True, scatters=False, every_backward=False)
REDUCE_SCATTER_ONCE = GradientPolicy("accumulate, then reduce-scatter once", full_accumulator=True, scatters=True,
                                     every_backward=False)
REDUCE_SCATTER_PER_BUCKET = GradientPolicy("reduce-scatter per bucket", full_accumulator=False, scatters=True,
                                           every_backward=True)


@dataclass(frozen=True)
class Residency:
    """Where a rank's parameter values live (see the module's docstring)."""

    name: str
    sharded: bool  # only the owned range is kept; the full values exist while a unit is gathered (stage 3)


REPLICATED = Residency("replicated", sharded=False)
SHARDED = Residency("sharded", sharded=True)


def policies_for(stage: int) -> Tuple[GradientPolicy, Residency]:
    """The one place a ZeRO stage is turned into behaviour (the gradient policy, the parameter residency)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: expected 0, 1, 2 or 3")
    gradients = (ALL_REDUCE, REDUCE_SCATTER_ONCE, REDUCE_SCATTER_PER_BUCKET, REDUCE_SCATTER_PER_BUCKET)[stage]
    return gradients, SHARDED if stage == 3 else REPLICATED
