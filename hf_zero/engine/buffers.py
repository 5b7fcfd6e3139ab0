"""M_D: flat, contiguous parameter / gradient storage per group, views into it, and a reuse pool for the
temporary full-size buffers (stage-2/3 gradient buckets, stage-3 gathered parameters)."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .partitioned import partition_parameter, set_gathered
from .policies import GradientPolicy, Residency
from .quantize import dequantize, pack, quantize, unpack
from .unit_state import UnitState
from .planning import GroupPlan


class BufferPool:
    """Hands out gradient buckets as views of fixed-size slabs of `slab_bytes` (C_B) and takes them back, so
    steady-state steps allocate nothing new (M_D) and what the pool holds is a number of slabs, whatever the
    buckets' sizes (a pool keyed by size kept one buffer per distinct group size: up to the whole gradient). A
    request larger than a slab gets a buffer of its own, freed when given back. `scratch` hands out the same slabs
    for what a reduce-scatter receives its peers' chunks into while in flight (gloo, collectives/chunked.py), so
    buckets and scratch share one budget. Tracks live and peak bytes (of slabs, the memory held) for
    memory_stats(); the reducer bounds them (its budget)."""

    def __init__(self, slab_bytes: int) -> None:
        self.slab_bytes = slab_bytes
        self._free: Dict[torch.device, List[torch.Tensor]] = defaultdict(list)
        self._slab_of: Dict[int, torch.Tensor] = {}  # id(buffer) -> the slab it views
        self.live_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0  # fresh allocations (not reuses): M_D means this stops growing after step 1

    def held(self, nbytes: int) -> int:
        """Bytes the pool holds for a buffer of `nbytes`: a whole slab, or the buffer's own bytes beyond one."""
        return self.slab_bytes if 0 < nbytes <= self.slab_bytes else nbytes

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reduce-scatter's scratch: a buffer of `numel` elements, contents unspecified."""
        return self.take(numel, dtype, device)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
        """A gradient bucket of `numel` elements (zeroed if `zero`)."""
        nbytes = numel * dtype.itemsize
        if nbytes <= self.slab_bytes:
            free = self._free[self._device(device)]
            if free:
                slab = free.pop()
            else:
                slab = torch.empty(self.slab_bytes, dtype=torch.uint8, device=device)
                self.allocations += 1
            buf = slab[:nbytes].view(dtype)
            self._slab_of[id(buf)] = slab
        else:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.allocations += 1
        self.live_bytes += self.held(nbytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if zero:
            buf.zero_()
        return buf

    def _device(self, device: torch.device) -> torch.device:
        """`device` with its index ("cuda" is "cuda:0" on device 0), as the slabs report theirs."""
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        return device

    def give(self, buf: torch.Tensor) -> None:
        slab = self._slab_of.pop(id(buf), None)
        if slab is None:
            self.live_bytes -= buf.numel() * buf.element_size()
            return
        self.live_bytes -= self.slab_bytes
        self._free[slab.device].append(slab)

    @property
    def reserved_bytes(self) -> int:
        """Bytes held by the pool: live buffers plus free slabs kept for reuse."""
        return self.live_bytes + sum(s.numel() for slabs in self._free.values() for s in slabs)


def share_full_storage(groups: List["FlatGroup"]) -> None:
    """Stage 3: make a unit's groups' full buffers views of one storage, so that a gather allocates the unit's
    parameters as one block and a release frees one block, however many C_B-capped groups the unit has.

    Why: the groups of a unit are gathered and released together anyway (gatherer.Unit), but one allocation per
    group made several buffers under 32 MiB per unit, which glibc serves from its heap (its dynamic mmap threshold)
    instead of mmap'ing them and giving them back: allocated and freed at every gather and release among the step's
    longer-lived tensors, they fragmented the heap, whose freed pages the process keeps (issue 43's capacity bench,
    docs/benchmarks.md). The storage is resized to zero bytes and back, as each group's was: the parameters and
    autograd's saved views of them keep pointing into it. Each group starts at a multiple of the largest element
    size among the unit's dtypes (what a view as its dtype needs), so a unit of one dtype has no padding and
    its storage holds exactly its groups' bytes."""
    if len(groups) < 2:
        return
    device = groups[0].full.device
    align = max(g.full.element_size() for g in groups)
    offsets, end = [], 0
    for g in groups:
        assert g.full.device == device, "a unit's groups live on one device"
        end = -(-end // align) * align
        offsets.append(end)
        end += g.full_bytes
    base = torch.empty(end, dtype=torch.uint8, device=device)
    for g, offset in zip(groups, offsets):
        g.full = base[offset:offset + g.full_bytes].view(g.plan.dtype)
        g.storage_bytes = end
        g.point_params(g.full)
    base.untyped_storage().resize_(0)  # every group's `full` (and its parameters) now views this storage


def _host_pinned(t: torch.Tensor, compute_device: torch.device) -> torch.Tensor:
    """A host tensor that copies to/from an accelerator asynchronously (page-locked); unchanged otherwise."""
    return t.pin_memory() if t.device.type == "cpu" and compute_device.type != "cpu" else t


def _bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class FlatGroup:
    """The runtime storage of one GroupPlan on one rank.

    - `full`: stages 0-2, the padded flat compute buffer; every parameter's `.data` is a view into it.
    - `shard`: the rank's owned range in the compute dtype (a view of `full`, or its own storage at stage 3).
    - `master`: the owned range in the master dtype (fp32 under mixed precision); the same tensor as `shard`
      when dtypes and devices agree (pure fp32 keeps no second copy).
    - `grad_full` (stages 0/1): padded full gradient accumulator; `grad_shard`: the owned range of the reduced
      gradient (a view of `grad_full` at stages 0/1, its own storage at 2/3: in host memory under offload_optimizer,
      `grad_device`). The engine allocates them when it builds the group, except for a model read from its files:
      there they come with the first backward (as FSDP2's do), so that loading never holds more than the
      parameters.
    """

    def __init__(self, plan: GroupPlan, params: List[nn.Parameter], policies: Tuple[GradientPolicy, Residency],
                 rank: int,
                 device: torch.device, master_dtype: Optional[torch.dtype], master_device: torch.device,
                 accum_dtype: torch.dtype, values: torch.Tensor, shard_device: torch.device,
                 offload_master: bool = False, values_lo: int = 0, frozen_block: Optional[int] = None,
                 unit_state: Optional[UnitState] = None, grad_device: Optional[torch.device] = None) -> None:
        self.plan, self.params, self.rank = plan, params, rank
        self.gradients, self.residency = policies  # policies.py: the stage, read once
        self.device = device
        self.lo, self.hi = plan.owned_range(rank)
        # stage 3: the state of the unit that owns the group, the one answer to "gathered?"; None below stage 3,
        # where the parameters always hold their values
        sharded = self.residency.sharded
        assert (unit_state is not None) == sharded, "sharded groups, and only they, share their unit's state"
        self.unit_state = unit_state
        self.version = 0  # bumped whenever the shard's values change (hpZ: secondary slices cut before are stale)
        # `values`: the initial flat values from element `values_lo` on (the whole padded buffer, or at stage 3
        # possibly just the owned range, when the weights were read straight into shards)
        owned = values[self.lo - values_lo:self.hi - values_lo]
        if not sharded:
            assert values_lo == 0 and values.numel() == plan.padded_numel, "stages 0-2 need the full buffer"
            self.full = values.to(device=device, dtype=plan.dtype)
            self.shard = self.full[self.lo:self.hi]
        else:
            # Stage 3: `full` keeps one storage for the group's whole life; it is resized to zero bytes when the
            # unit is released and back when it is gathered. Parameters and any views autograd saved of them
            # (F.linear saves weight.t()) therefore see the re-gathered values in the backward.
            shard = owned.to(device=shard_device, dtype=plan.dtype)
            if shard is owned and (values_lo != self.lo or values.numel() != self.hi - self.lo):
                shard = shard.clone()  # a view of a larger buffer: keep only the owned range
            # (the owned range read straight from the files is already a tensor of its own: no second copy)
            self.shard = _host_pinned(shard, device)
            self.full = torch.empty(plan.padded_numel, dtype=plan.dtype, device=device)
        # quantized frozen weights (stage 3, frozen groups): the shard kept as int8 codes + fp32 scales only, packed
        # in one uint8 tensor (quantize.pack), which is also what its all-gather sends
        self.packed: Optional[torch.Tensor] = None
        self.block = frozen_block
        self.storage_bytes = 0  # stage 3: bytes of the storage `full` views, when its unit's groups share one
        if sharded and not plan.trainable and frozen_block is not None:
            self._store_quantized(self.shard)
        self.point_params(self.full)
        if sharded:
            for p, slot in zip(params, plan.slots):  # reads outside a gather raise instead of reading freed memory
                partition_parameter(p, " / ".join(slot.aliases), self)
            self.free_full()
        self.master: Optional[torch.Tensor] = None
        self._grad_full: Optional[torch.Tensor] = None
        self._grad_shard: Optional[torch.Tensor] = None
        self._accum_dtype = accum_dtype
        # where the gradient shard lives: host memory under ZeRO-Offload at stages 2/3 (host_grads.py); the
        # full-size accumulator of stages 0/1 stays on the device, where the backward adds into it
        self.grads_on_host = grad_device is not None and plan.trainable and not self.gradients.full_accumulator
        self._grad_device = grad_device if self.grads_on_host else device
        if plan.trainable:
            if master_dtype == plan.dtype and master_device == self.shard.device and not offload_master:
                self.master = self.shard
            else:  # ZeRO-Offload keeps its own host copy, the step's input and output (pinned for async copies)
                self.master = _host_pinned(
                    owned.to(device=master_device, dtype=master_dtype).clone(), device)

    # ---------------------------------------------------------------- gradients (allocated on first use)
    def allocate_grads(self) -> None:
        """Allocate the (zeroed) gradient accumulator now, if it does not exist yet."""
        if not self.plan.trainable or self._grad_shard is not None:
            return
        if self.gradients.full_accumulator:
            self._grad_full = torch.zeros(self.plan.padded_numel, dtype=self._accum_dtype, device=self.device)
            self._grad_shard = self._grad_full[self.lo:self.hi]
        else:
            self._grad_shard = torch.zeros(self.plan.shard_numel, dtype=self._accum_dtype, device=self._grad_device,
                                           pin_memory=self.grads_on_host and self.device.type != "cpu")

    @property
    def accum_dtype(self) -> torch.dtype:
        """The dtype gradients accumulate in (grad_accum_dtype: fp32 for a low-precision group by default)."""
        return self._accum_dtype

    @property
    def grad_full(self) -> Optional[torch.Tensor]:
        """Stages 0/1: the padded full gradient accumulator (None at stages 2/3 and for frozen groups)."""
        if self.gradients.full_accumulator:
            self.allocate_grads()
        return self._grad_full

    @property
    def grad_shard(self) -> Optional[torch.Tensor]:
        """The owned range of the reduced gradient (None for frozen groups)."""
        self.allocate_grads()
        return self._grad_shard

    def zero_grads(self) -> None:
        """Zero the gradient accumulator, if it exists yet."""
        if self._grad_full is not None:
            self._grad_full.zero_()
        elif self._grad_shard is not None:
            self._grad_shard.zero_()

    @property
    def master_is_shard(self) -> bool:
        return self.master is self.shard

    def views(self, buf: torch.Tensor) -> List[torch.Tensor]:
        """Parameter-shaped views of a full flat buffer, in slot order."""
        return [buf[s.offset:s.offset + s.numel].view(s.shape) for s in self.plan.slots]

    def point_params(self, buf: torch.Tensor) -> None:
        """Make every parameter's storage its view of `buf` (no copy)."""
        for p, view in zip(self.params, self.views(buf)):
            p.data = view

    def set_gathered(self, gathered: bool) -> None:
        """Stage 3: the parameters read their values (the unit is gathered) or refuse reads (partitioned.py)."""
        set_gathered(self.params, gathered)

    def alloc_full(self) -> torch.Tensor:
        """Stage 3: give the full buffer its memory back (contents undefined until the all-gather lands); where
        the unit's groups share one storage (`share_full_storage`), the first of them allocates it for all."""
        storage = self.full.untyped_storage()
        nbytes = self.storage_bytes or self.full_bytes
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self.full

    def free_full(self) -> None:
        """Stage 3: drop the full buffer's memory; parameters keep their shapes but have no data until gathered."""
        self.full.untyped_storage().resize_(0)

    @property
    def gathered(self) -> bool:
        """Whether the parameters hold their full values: always below stage 3, else as the unit's state says."""
        return self.unit_state is None or self.unit_state.gathered

    @property
    def full_bytes(self) -> int:
        """Bytes a gather of this group materialises (its padded full buffer)."""
        return self.full.numel() * self.full.element_size()

    @property
    def gathered_bytes(self) -> int:
        """Bytes of full parameters this stage-3 group holds now (0 while its unit is sharded, and below stage 3)."""
        return self.full_bytes if self.unit_state is not None and not self.unit_state.sharded else 0

    # ---------------------------------------------------------------- quantized frozen shards
    @property
    def quantized(self) -> bool:
        """Whether the shard is kept as int8 codes and scales (quantized_frozen_weights)."""
        return self.packed is not None

    def _store_quantized(self, values: torch.Tensor) -> None:
        self.packed = _host_pinned(pack(*quantize(values.reshape(-1), self.block, 8)), self.device)
        self.shard = self.shard.new_empty(0)  # the compute-dtype shard is gone: the codes are the storage

    def frozen_values(self) -> torch.Tensor:
        """A frozen group's owned values in the compute dtype (dequantized from the codes when quantized)."""
        if not self.quantized:
            return self.shard
        n = self.hi - self.lo
        return dequantize(*unpack(self.packed, n, self.block, 8), self.block, n, 8, dtype=self.plan.dtype).view(n)

    def load_frozen_values(self, values: torch.Tensor) -> None:
        """Replace a frozen group's owned values (quantized again when the group keeps codes)."""
        if self.quantized:
            self._store_quantized(values.to(device=self.packed.device, dtype=self.plan.dtype))
        else:
            self.shard.copy_(values)
        self.version += 1

    def write_master_to_shard(self) -> None:
        """After the optimizer step: the updated master range becomes the compute-dtype parameter range."""
        self.version += 1
        if self.master is not None and not self.master_is_shard:
            self.shard.copy_(self.master, non_blocking=True)

    def state_bytes(self) -> Dict[str, int]:
        """Bytes of model states this group holds on this rank."""
        params = _bytes(self.shard) + _bytes(self.packed) if self.residency.sharded else _bytes(self.full)
        grads = _bytes(self._grad_full) if self._grad_full is not None else _bytes(self._grad_shard)
        master = 0 if (self.master is None or self.master_is_shard) else _bytes(self.master)
        trainable = params if self.plan.trainable else 0
        return {"params": params, "params_trainable": trainable, "params_frozen": params - trainable, "grads": grads,
                "master": master}
