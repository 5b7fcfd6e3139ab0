"""The one record of a stage-3 unit's state: what its parameters are and where the step is (FSDP2's model:
`ShardedState` per parameter, `TrainingState` per group).

What the parameters are (`ShardedState`):

    SHARDED --gather--> GATHERING --wait--> GATHERED --release--> SHARDED
                                                     --release, keeping hpZ slices--> SHARDED_POST_FORWARD
    SHARDED_POST_FORWARD --gather (inside the host, from the slices)--> GATHERING
    SHARDED_POST_FORWARD --drop (after the unit's backward, or the shards changed)--> SHARDED

SHARDED: each rank holds its shard, the full buffers hold no memory. SHARDED_POST_FORWARD (hpZ, ZeRO++'s
hierarchical partition): released after a forward that a backward will follow, each rank keeps its slice of the
gathered values over its host group (`kept`), which the next gather of the unit reads instead of the shards until
the unit's backward is done or a step changes the shards. GATHERING: all-gathers issued. GATHERED: the full
parameters are readable. The versions of the shards a gather (and the kept slices) came from are part of the state:
a step that changes a shard makes them stale.

Where the step is (`TrainingState`): IDLE, FORWARD (between the unit's pre-forward and post-forward), BACKWARD
(its backward has started; a recomputation's forward stays in it). Beside it the counts that decide the release
after the backward: `forwards_pending` (forwards with grad whose backward has not yet reached the unit's inputs)
and `groups_pending` (trainable groups not yet handed to the reducer), and `pinned` (inside
`gathered_parameters()`: nothing releases).

The unit moves the state and does the work (collectives, memory); everything else asks it: its flat groups
(`FlatGroup.gathered`, which PartitionedParameter checks before any read), `memory_stats`, `state_dict`.
"""
from __future__ import annotations

import enum
from typing import List, Optional, Sequence, Tuple

import torch


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded after forward"
    GATHERING = "gathering"
    GATHERED = "gathered"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


GatherState = ShardedState  # the name the state had before it knew about hpZ's kept slices


class UnitState:
    """A unit's ShardedState (with the versions it came from and hpZ's kept slices) and its TrainingState."""

    def __init__(self) -> None:
        self.value = ShardedState.SHARDED
        self.training = TrainingState.IDLE
        self.pinned = False
        self.forwards_pending = 0
        self.groups_pending = 0
        self.kept: Optional[List[torch.Tensor]] = None  # hpZ: one slice per group, while SHARDED_POST_FORWARD or
        self._made_from: Tuple[int, ...] = ()          # gathered from them
        self._kept_from: Tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"UnitState({self.value.value}, {self.training.value})"

    # ------------------------------------------------------------------ what the parameters are
    @property
    def sharded(self) -> bool:
        """No full parameters are held (SHARDED or SHARDED_POST_FORWARD)."""
        return self.value in (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD)

    @property
    def gathered(self) -> bool:
        """The full parameters are readable."""
        return self.value is ShardedState.GATHERED

    def to_gathering(self, versions: Sequence[int]) -> None:
        """All-gathers issued (from the kept slices when there are any) of shards at these versions."""
        assert self.sharded, self.value
        self.value, self._made_from = ShardedState.GATHERING, tuple(versions)

    def to_gathered(self) -> None:
        assert self.value is ShardedState.GATHERING, self.value
        self.value = ShardedState.GATHERED

    def to_sharded(self, kept: Optional[List[torch.Tensor]] = None) -> None:
        """Released; `kept`: hpZ's slices of the gathered values, kept for the backward (slices kept before stay)."""
        assert not self.sharded, self.value
        if kept is not None and self.kept is None:
            self.kept, self._kept_from = kept, self._made_from
        self.value = ShardedState.SHARDED if self.kept is None else ShardedState.SHARDED_POST_FORWARD
        self._made_from = ()

    def drop_kept(self) -> Optional[List[torch.Tensor]]:
        """Forget hpZ's kept slices (returned, for the byte count): SHARDED_POST_FORWARD becomes SHARDED."""
        kept, self.kept, self._kept_from = self.kept, None, ()
        if self.value is ShardedState.SHARDED_POST_FORWARD:
            self.value = ShardedState.SHARDED
        return kept

    def stale(self, versions: Sequence[int]) -> bool:
        """Gathered (or gathering) from shards that have changed since (`versions`: the shards' versions now)."""
        return not self.sharded and self._made_from != tuple(versions)

    def kept_stale(self, versions: Sequence[int]) -> bool:
        """hpZ's kept slices were cut from shards that have changed since."""
        return self.kept is not None and self._kept_from != tuple(versions)

    # ------------------------------------------------------------------ where the step is
    def start_forward(self) -> None:
        if self.training is TrainingState.IDLE:
            self.training = TrainingState.FORWARD

    def end_forward(self) -> None:
        if self.training is TrainingState.FORWARD:
            self.training = TrainingState.IDLE

    @property
    def in_backward(self) -> bool:
        return self.training is TrainingState.BACKWARD

    def start_backward(self, trainable_groups: int) -> None:
        """The unit's backward starts (once per backward; a recomputation inside it changes nothing)."""
        if self.training is not TrainingState.BACKWARD:
            self.training, self.groups_pending = TrainingState.BACKWARD, trainable_groups

    def backward_done(self) -> bool:
        """In the backward, every trainable group handed to the reducer and every forward's inputs reached."""
        return self.in_backward and self.groups_pending <= 0 and self.forwards_pending == 0

    def end_backward(self) -> None:
        self.training, self.forwards_pending, self.groups_pending = TrainingState.IDLE, 0, 0
