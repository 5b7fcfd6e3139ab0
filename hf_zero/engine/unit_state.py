"""The one place that says whether a stage-3 unit's parameters are gathered (FSDP2's `ShardedState` is the model).

A unit is SHARDED (each rank holds its shard; the full buffers hold no memory), GATHERING (its all-gathers are
issued, the values not yet there) or GATHERED (the full parameters are readable). The unit moves it, and everything
else asks it: its flat groups (`FlatGroup.gathered`, which PartitionedParameter checks before any read), the bytes
of gathered parameters (`FlatGroup.gathered_bytes`, memory_stats), `state_dict` at stage 3, and whether a gather
was made from shards that a step has changed since (the shard versions it was made from are part of the state).
"""
from __future__ import annotations

import enum
from typing import Sequence, Tuple


class GatherState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class UnitState:
    """A unit's GatherState and the shard versions its current gather was made from."""

    def __init__(self) -> None:
        self.value = GatherState.SHARDED
        self._made_from: Tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"UnitState({self.value.value})"

    @property
    def sharded(self) -> bool:
        return self.value is GatherState.SHARDED

    @property
    def gathered(self) -> bool:
        """The full parameters are readable."""
        return self.value is GatherState.GATHERED

    def to_gathering(self, versions: Sequence[int]) -> None:
        """All-gathers issued from shards at these versions."""
        assert self.value is GatherState.SHARDED, self.value
        self.value, self._made_from = GatherState.GATHERING, tuple(versions)

    def to_gathered(self) -> None:
        assert self.value is GatherState.GATHERING, self.value
        self.value = GatherState.GATHERED

    def to_sharded(self) -> None:
        self.value, self._made_from = GatherState.SHARDED, ()

    def stale(self, versions: Sequence[int]) -> bool:
        """Gathered (or gathering) from shards that have changed since (`versions`: the shards' versions now)."""
        return self.value is not GatherState.SHARDED and self._made_from != tuple(versions)
