"""shard_model(): wires the plan, the flat buffers, the reducer, the gatherer and the optimizer together.

This is the one entry point of the engine. It speaks torch.nn.Module, torch.optim.Optimizer and
torch.distributed only; the Accelerate and Transformers integrations sit on top of it. The step (prepare the
gradients, clip, update, gather the updated parameters) is the optimizer's (optimizer.py); checkpoints are
functions of `hf_zero.checkpoint` that take the engine.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..config import ZeroConfig
from .buffers import BufferPool, FlatGroup
from .comm import Comm
from .gatherer import GatheredBytes, Gatherer, Unit
from .loading import ShardLoader, Weights, resolve_weights
from .optimizer import ZeroOptimizer, check_elementwise, shard_optimizer
from .placement import compute_device
from .planning import ShardPlan, plan_model
from .partitioned import set_placeholders
from .policies import GradientPolicy, Residency, policies_for
from .reducer import Reducer, comm_buffers_budget, largest_bucket, largest_reduction, reduction_columns
from .rendezvous import Rendezvous, RendezvousTimeout
from .scaler import LossScaler
from .state import ShardState, apply_shard_state, capture_shard_state, full_group_values
from .topology import Topology, build_topology
from .unit_state import UnitState
from .weights import WeightsError

logger = logging.getLogger("hf_zero")


def _default_device(model: nn.Module, group: Optional[dist.ProcessGroup], loading: bool) -> torch.device:
    """The facts placement.compute_device decides from, read once."""
    config = dist.get_backend_config(group) if dist.is_available() and dist.is_initialized() else None
    first = next(model.parameters(), None)
    cuda = torch.cuda.is_available()
    return compute_device(config, first.device if first is not None else None, loading, cuda,
                          torch.cuda.current_device() if cuda else 0)


class ZeroEngine:
    """A model and optimizer sharded with ZeRO. Build it with `shard_model`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Optional[ZeroConfig] = None,
                 process_group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None,
                 weights: Weights = None) -> None:
        self.config = config = config if config is not None else ZeroConfig()
        self.model = model
        self.topology: Topology = build_topology(process_group, config)
        self.comm: Comm = self.topology.world  # every rank: start-up broadcasts, agreements, the ledger
        self.partition_comm: Comm = self.topology.partition  # the ranks a shard is split over
        record = resolve_weights(weights, model)  # (PretrainedWeights, name prefix) or None
        self.device = (torch.device(device) if device is not None
                       else _default_device(model, process_group, record is not None))
        if self.device.type == "cpu":
            self.device = torch.device("cpu")  # Accelerate says "cpu:0"; CPU tensors report "cpu"
        # how each group's collectives go on the wire (config.collectives), chosen once for the engine's device
        self.collectives = {comm.strategy(self.device.type).name for comm in self.topology.comms()}
        self._check_optimizer(model, optimizer)
        self.plan: ShardPlan = plan_model(model, self.comm.world_size, config, self.partition_comm.world_size)
        # the stage as behaviour, decided once: how gradients are reduced, where parameter values live
        self.policies: Tuple[GradientPolicy, Residency] = policies_for(config.stage)
        # stage 3: one state per unit (gathered or not, where the step is), shared by the unit and its groups
        self.unit_states = [UnitState() for _ in self.plan.units]
        self.groups = self._load(record) if record is not None else None
        if self.groups is None:
            self._move_buffers()
            self.groups = self._build_groups()
        # stages 2/3: each group's buckets (column chunks for a group larger than C_B), from slabs of the largest
        # bucket (at most C_B: a small model's buckets take no more than they need)
        columns = reduction_columns(self.groups, self.policies[0], config.reduce_torch_dtype,
                                    config.reduce_bucket_size)
        # gloo's reduce-scatter receives the peers' chunks into scratch: from the pool too, within the budget
        strategy = self.partition_comm.strategy(self.device.type)
        scratch = lambda nbytes: strategy.reduce_scatter_scratch(nbytes, self.device.type)  # noqa: E731
        bucket = largest_bucket(self.groups, columns, config.reduce_torch_dtype)
        self.pool = BufferPool(max(bucket, scratch(largest_reduction(self.groups, self.policies[0], bucket))))
        strategy.scratch = self.pool
        self.reducer = Reducer(
            self.groups, self.policies[0], self.partition_comm, self.pool,
            budget_bytes=comm_buffers_budget(self.pool.slab_bytes), scratch_bytes=scratch,
            bucket_bytes=config.reduce_bucket_size,
            route=self.topology.reduce_route([g.plan for g in self.groups], columns), world_size=self.comm.world_size,
            reduce_dtype=config.reduce_torch_dtype, on_launch=self._on_group_launched,
            on_backward_end=self._on_backward_end, agree=self.comm.control.share, columns=columns,
        )
        self.reducer.guess_order(self._registration_guess())
        self.gathered = GatheredBytes()
        self.gatherer: Optional[Gatherer] = self._build_gatherer() if self.policies[1].sharded else None
        # stage 3: model.state_dict() / save_pretrained() outside a gather is collective (the full weights to rank
        # 0), checked first by a rendezvous so that a call on one rank only is an error, not a hang
        self._collective_state_dict = False
        self._state_dict_rendezvous: Optional[Rendezvous] = None
        if self.gatherer is not None:
            if self.comm.world_size > 1 and dist.get_backend(self.comm.group) != "fake":
                self._state_dict_rendezvous = Rendezvous("model.state_dict() at ZeRO stage 3", self.comm.group)
            model.register_state_dict_pre_hook(self._guard_state_dict)
            # a function, not the bound method: torch marks the hooks its public API registered with an attribute
            model.register_state_dict_post_hook(lambda *args: self._fill_state_dict(*args))
        elif config.compute_dtype is not None and any(g.plan.trainable for g in self.groups):
            model.register_state_dict_pre_hook(self._warn_compute_copy)
        self._allow_state_dict = False
        # set by the checkpoint layer at the first background save: wait() and close() on it (engine.py imports
        # nothing of that layer)
        self.background_save: Optional[Any] = None
        # the user's optimizer itself, turned into the ZeRO optimizer over this rank's shard (optimizer.py)
        self.optimizer: ZeroOptimizer = shard_optimizer(optimizer, self.groups, self.reducer, self.partition_comm,
                                                        config, self.device, world=self.comm)
        self.comm.reset_stats()  # the start-up broadcast is not training traffic
        # At exit, wait for this engine's collectives in flight, then close and free the process groups before
        # the interpreter finalizes (gloo's threads abort it otherwise): engine/exit.py.
        from .exit import close_at_exit
        close_at_exit(self)
        if self.comm.rank == 0:
            self._log_plan()

    @property
    def scaler(self) -> Optional[LossScaler]:
        """The fp16 loss scaler (None unless mixed_precision="fp16"); the optimizer's step updates it."""
        return self.optimizer.scaler

    def wait(self) -> None:
        """Wait for every collective this engine has in flight (reductions, prefetched all-gathers)."""
        self.reducer.wait()
        if self.gatherer is not None:
            self.gatherer.wait()

    def wait_for_save(self) -> Optional[Path]:
        """Wait for the checkpoint save this engine runs in the background (`save_checkpoint(...,
        async_save=True)`), if any: its folder, or CheckpointError if it failed (raised once)."""
        return self.background_save.wait() if self.background_save is not None else None

    def close(self) -> None:
        """Wait for a background checkpoint save (raising its error) and the engine's collectives, and remove its
        hooks (the model keeps its current, possibly sharded, storage)."""
        try:
            if self.background_save is not None:
                self.background_save.close()  # and frees the host copies a background save keeps for the next one
        finally:
            self.wait()
            self.reducer.remove_hooks()
            if self.gatherer is not None:
                self.gatherer.remove_hooks()

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        names = {id(p): n for n, p in model.named_parameters()}
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in names:
                    raise ValueError(
                        f"optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a parameter "
                        f"of the model: build the optimizer over model.parameters() of the model you shard"
                    )
        return None

    def _move_buffers(self) -> None:
        for module in self.model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != self.device:
                    module._buffers[key] = buf.to(self.device)
        for name, buf in self.model.named_buffers():
            self.comm.broadcast(buf.data if buf.is_floating_point() or buf.numel() else buf, tag=f"buffer {name}")

    def _load(self, found) -> List[FlatGroup]:
        """The weights files, read straight into this rank's shards (engine/loading.py). A failure on any rank,
        whatever it is, is raised on every rank as the same WeightsError, and every rank puts the model back as
        it was (parameters on meta, its buffers), so that it can be loaded again."""
        record, prefix = found
        error, cause, groups, loader = None, None, [], None
        try:
            loader = ShardLoader(self.model, self.plan, record, prefix)
            loader.load_buffers()
            groups = self._build_groups(loader)
        except Exception as exc:  # any: a rank that escaped before the agreement would leave the others waiting
            import traceback

            error, cause = f"{type(exc).__name__}: {exc}", exc
            traceback.clear_frames(exc.__traceback__)  # the traceback stays; the flat buffers in its frames go
        failed = self.comm.agree(error, "weights loaded")
        if failed is not None:
            groups = []  # the flat buffers go before the parameters are swapped back
            stuck = loader.undo() if loader is not None else []
            left = (f"; {len(stuck)} parameter(s) stayed loaded (e.g. {stuck[:3]}): build the model again"
                    if stuck else "")
            raise WeightsError(f"hf_zero: loading {record.path} failed on {failed}{left}") from cause
        self._move_buffers()
        loader.finish(self.comm.rank)
        return groups

    def _build_groups(self, loader: Optional[ShardLoader] = None) -> List[FlatGroup]:
        cfg, rank = self.config, self.partition_comm.rank
        params = dict(self.model.named_parameters())
        master_device = torch.device("cpu") if cfg.offload_optimizer == "cpu" else self.device
        shard_device = torch.device("cpu") if cfg.offload_params == "cpu" else self.device
        groups = []
        sharded = self.policies[1].sharded
        ranges = [gp.owned_range(rank) if sharded else (0, gp.padded_numel) for gp in self.plan.groups]
        if loader is not None:  # headers, shapes, missing keys: what can fail short of reading, before any swap
            for gp, (lo, hi) in zip(self.plan.groups, ranges):
                loader.check(gp, lo, hi)
        # quantized frozen weights: frozen stage-3 shards kept as int8 codes (floating groups only)
        quantize_frozen = sharded and cfg.quantized_frozen_weights == "int8"
        for gp, (lo, hi) in zip(self.plan.groups, ranges):
            members = [params[s.name] for s in gp.slots]
            frozen_block = (cfg.quantization_block_size if quantize_frozen and not gp.trainable
                            and gp.dtype.is_floating_point else None)
            # Values in the master dtype for trainable groups (fp32 under mixed precision: the master starts from
            # the un-rounded weights), in the compute dtype for frozen ones.
            master_dtype = (torch.float32 if cfg.compute_dtype is not None else gp.dtype) if gp.trainable else None
            value_dtype = master_dtype or gp.dtype
            if loader is not None:  # from the files: the owned range only at stage 3, one group at a time
                full = loader.values(gp, value_dtype, lo, hi).to(self.device)
                loader.materialise(members, gp.dtype, self.device)
            else:
                lo, full = 0, torch.zeros(gp.padded_numel, dtype=value_dtype, device=self.device)
                for p, s in zip(members, gp.slots):
                    full[s.offset:s.offset + s.numel].copy_(p.detach().reshape(-1))
                self.comm.broadcast(full, tag=f"initial values of group {gp.index}")  # every rank starts equal
            # fp32 accumulation lifts low-precision gradients; fp32/fp64 parameters accumulate in their own dtype
            low = gp.dtype.is_floating_point and torch.finfo(gp.dtype).bits < 32
            accum = torch.float32 if (cfg.grad_accum_dtype == "fp32" and low) else gp.dtype
            groups.append(FlatGroup(gp, members, self.policies, rank, self.device, master_dtype, master_device, accum,
                                    full, shard_device, offload_master=cfg.offload_optimizer == "cpu",
                                    values_lo=lo, frozen_block=frozen_block,
                                    unit_state=self.unit_states[gp.unit] if sharded else None,
                                    grad_device=master_device if cfg.offload_optimizer == "cpu" else None))
            if loader is None:  # a model read from its files gets its gradients at the first backward (peak)
                groups[-1].allocate_grads()
            del full
        return groups

    def _build_gatherer(self) -> Gatherer:
        units = [Unit(u.index, u.name, self.model.get_submodule(u.name), [self.groups[i] for i in u.groups],
                      self.topology.gather_route(u.reshard_after_forward), self.gathered, self.unit_states[u.index],
                      u.reshard_after_forward) for u in self.plan.units]
        return Gatherer(units, self.config.prefetch, self.gathered,
                        on_backward_start=self._on_backward_start,
                        max_live=self.config.max_live_parameters)

    def _log_plan(self) -> None:
        mem = self.memory_stats()
        logger.info(
            "hf_zero: %s; %s; %s collectives; reduce bucket %d B, all-gather bucket %d B, prefetch %d; model states "
            "on this rank: %.1f MiB (params %.1f, grads %.1f, master %.1f, optimizer %.1f)",
            self.plan.describe(), self.topology.describe(), "/".join(sorted(self.collectives)),
            self.config.reduce_bucket_size, self.config.allgather_bucket_size,
            self.config.prefetch, mem["model_states"] / 2**20, mem["params"] / 2**20, mem["grads"] / 2**20,
            mem["master"] / 2**20, mem["optimizer_states"] / 2**20,
        )
        if self.config.offload_optimizer == "cpu" or self.config.offload_params == "cpu":
            logger.info("hf_zero: offload: optimizer=%s (step kernel: %s), params=%s; %.1f MiB in host memory",
                        self.config.offload_optimizer, self.optimizer.kernel, self.config.offload_params,
                        mem["offloaded"] / 2**20)

    # ------------------------------------------------------------------ hooks from the reducer
    def _registration_guess(self) -> List[int]:
        """The first backward's launch order, before the ranks have seen one: a group completes when its parameter
        used first in the forward gets its gradient, so groups by their earliest parameter in registration order,
        latest first (the head before the final norm before the last layer, the embeddings last). The same on every
        rank: it reads the model's structure only."""
        position = {name: i for i, (name, _) in enumerate(self.model.named_parameters())}
        plans = [g.plan for g in self.groups if g.plan.trainable]
        first = {p.index: min(position.get(s.name, 0) for s in p.slots) for p in plans}
        return [p.index for p in sorted(plans, key=lambda p: -first[p.index])]

    def _on_backward_start(self) -> None:
        """Stage 3, as a backward reaches a unit: until the ranks have agreed the reducer's order, guess it from the
        units' forward order, which every rank shares (their all-gathers had to match): the groups of the units in
        reverse, so the first backward already releases each unit as its gradients are launched."""
        if not self.reducer.order_agreed and self.gatherer.order:
            self.reducer.guess_order([i for u in reversed(self.gatherer.order) for i in reversed(self.plan.units[
                u.index].groups)])
        self.reducer.queue_end_of_backward()

    def _on_group_launched(self, group: FlatGroup) -> None:
        if self.gatherer is not None:
            self.gatherer.on_group_launched(group)

    def _on_backward_end(self) -> None:
        if self.gatherer is not None:
            self.gatherer.end_of_backward()

    def _guard_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """Stage 3, before `model.state_dict()` walks the model: outside a gather the call is collective (as under
        FSDP2, whose state_dict save_pretrained gathers): every rank must make it, checked within
        `state_dict_timeout_s`; the released parameters then read as meta placeholders that `_fill_state_dict`
        replaces."""
        if self._allow_state_dict or all(u.state.gathered for u in self.gatherer.units):
            return
        if self._state_dict_rendezvous is not None:
            try:
                self._state_dict_rendezvous.arrive(self.config.state_dict_timeout_s)
            except RendezvousTimeout as exc:
                raise RuntimeError(
                    f"hf_zero: this model's parameters are partitioned across ranks (ZeRO stage 3), so "
                    f"model.state_dict() and save_pretrained() gather them from every rank and must be called on "
                    f"every rank; {exc} (ZeroConfig state_dict_timeout_s). Call it on all ranks, e.g. "
                    f"accelerator.unwrap_model(model).save_pretrained(output_dir, is_main_process="
                    f"accelerator.is_main_process, save_function=accelerator.save) outside `if "
                    f"accelerator.is_main_process:`, or take the weights on every rank with "
                    f"accelerator.get_state_dict(model) (engine.full_state_dict()) and pass them as "
                    f"save_pretrained(..., state_dict=...) on the main process. No weights were written; "
                    f"save_pretrained may have written config.json before it asked for the weights."
                ) from exc
        set_placeholders(self._partitioned_params(), True)
        self._collective_state_dict = True

    def _fill_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                         local_metadata: Dict[str, Any]) -> None:
        """Stage 3, after a collective `model.state_dict()` walked the model: each parameter's entry becomes its
        full value on rank 0 (a CPU tensor in its original dtype, trainable ones from the fp32 master, as
        `full_state_dict()`) and a meta tensor of its shape and dtype on the other ranks, which keep no full copy.
        Gathered one flat group at a time, so the peak is `full_state_dict()`'s."""
        if not self._collective_state_dict:
            return
        self._collective_state_dict = False
        set_placeholders(self._partitioned_params(), False)
        values = self._gathered_values("state_dict")
        slots = {alias: slot for g in self.groups for slot in g.plan.slots for alias in slot.aliases}
        for name, slot in slots.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = values[name] if self.comm.rank == 0 else torch.empty(
                    slot.shape, dtype=slot.orig_dtype, device="meta")

    def _partitioned_params(self) -> List[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    def _warn_compute_copy(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._allow_state_dict or prefix:
            return
        warnings.warn(
            f"hf_zero: under mixed_precision={self.config.mixed_precision!r} the model's parameters are the "
            f"{self.config.mixed_precision} compute copy; the fp32 master weights live in the ZeRO optimizer's "
            f"shards. model.state_dict() / save_pretrained() save the rounded copy: use engine.full_state_dict() "
            f"(accelerator.save_model / accelerator.get_state_dict) for the fp32 weights.", stacklevel=3)

    # ------------------------------------------------------------------ training API
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the fp16 loss scale applied."""
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Non-final micro-batches of gradient accumulation: stages 0/1 only accumulate locally; stages 2/3 keep
        reduce-scattering every micro-batch (that is what bounds their gradient memory)."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (global) gradient to `max_norm` and return the global norm over all ranks' shards. Inside
        `no_sync()` it finalises nothing: stages 0/1 measure (and clip) the rank's local accumulated gradient, as
        DDP does; stages 2/3 the reduce-scattered sums so far, scaled as the final average (docs/gradient_accumulation.md)."""
        return self.optimizer.clip_grad_norm_(max_norm, norm_type)

    def zero_grad(self) -> None:
        """Reset the gradient accumulators (every optimizer step does it too)."""
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ introspection
    def comm_stats(self) -> Dict[str, Dict[str, int]]:
        """Cumulative calls, elements (paper counting) and bytes per collective kind, plus "total" (data only)."""
        return self.comm.snapshot()

    def comm_stats_by_strategy(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """The same counters per collectives strategy ("flat", "chunked", ...) and kind, bytes as each strategy
        sent them, intra-/inter-host as in `comm_stats`, plus "total" (data only) per strategy."""
        return self.comm.ledger.by_strategy()

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()

    def memory_stats(self) -> Dict[str, int]:
        """Bytes of model states this rank holds (params, split into params_trainable and params_frozen; grads,
        master, optimizer_states; `offloaded`: the part of them kept in host memory), plus buffers (module buffers, pooled buckets and gathered parameters) and the
        total."""
        out = {"params": 0, "params_trainable": 0, "params_frozen": 0, "grads": 0, "master": 0}
        for g in self.groups:
            for k, v in g.state_bytes().items():
                out[k] += v
        seen = set()
        opt = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v) and id(v) not in seen:
                    seen.add(id(v))
                    opt += v.numel() * v.element_size()
        out["optimizer_states"] = opt
        out["model_states"] = out["params"] + out["grads"] + out["master"] + opt
        # ZeRO-Offload: the model states placed in host memory by the config (master + optimizer states, and the
        # gradient shards at stages 2/3; the parameter shards too with offload_params), whatever the compute device is
        host_grads = sum(g.state_bytes()["grads"] for g in self.groups if g.grads_on_host)
        out["offloaded"] = (out["master"] + opt + host_grads if self.config.offload_optimizer == "cpu" else 0) + (
            out["params"] if self.config.offload_params == "cpu" else 0)
        out["module_buffers"] = sum(b.numel() * b.element_size() for b in self.model.buffers())
        out["comm_buffers"] = self.pool.reserved_bytes  # C_B: gradient buckets and reduce-scatter outputs, reused
        out["comm_buffers_peak"] = self.pool.peak_bytes
        out["comm_buffers_budget"] = self.reducer.budget_bytes  # what the reducer keeps the peak to
        out["comm_buffer_allocations"] = self.pool.allocations  # M_D: stops growing after the first step
        out["gathered_params_peak"] = self.gathered.peak
        out["live_parameters_budget"] = self._live_budget()  # max_live_parameters, in bytes
        out["hpz_secondary"] = self.gathered.secondary  # hpZ's host-group slices kept for the backward
        out["hpz_secondary_peak"] = self.gathered.secondary_peak
        out["gathered_params"] = sum(g.gathered_bytes for g in self.groups)
        out["error_feedback"] = self.topology.feedback_bytes  # qgZ's: an fp32 residual per gradient group and hop
        out["buffers"] = (out["module_buffers"] + out["comm_buffers"] + out["gathered_params"] + out["hpz_secondary"]
                          + out["error_feedback"])
        out["total"] = out["model_states"] + out["buffers"]
        return out

    def reset_peak_memory_stats(self) -> None:
        """Start memory_stats()' peaks (gradient buckets, gathered parameters, hpZ slices) from what is held now,
        as torch.cuda.reset_peak_memory_stats() does for CUDA's."""
        self.pool.peak_bytes = self.pool.live_bytes
        self.gathered.peak = self.gathered.now
        self.gathered.secondary_peak = self.gathered.secondary

    def _live_budget(self) -> int:
        """Stage 3: `max_live_parameters` in bytes of the compute dtype (0: no budget, or below stage 3). No unit
        is larger unless one module's own parameters are, and a prefetch never takes the gathered parameters past
        it; a unit needed now (its forward, its backward) is gathered whatever is held, so the peak can exceed it by
        the units in use at once (two MLP projections of a split layer whose backward branches meet)."""
        if self.gatherer is None:
            return 0
        element = max((g.full.element_size() for g in self.groups), default=0)
        return self.config.max_live_parameters * element

    # ------------------------------------------------------------------ full parameters
    def gathered_parameters(self) -> contextlib.AbstractContextManager:
        """Stage 3: full parameters on every rank inside the block (read-only; no collectives from forwards
        inside, so ranks may run different numbers of forwards, e.g. generate()). Other stages: a no-op."""
        return self.gatherer.gathered() if self.gatherer is not None else contextlib.nullcontext()

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Collective. Full weights with model.state_dict()'s keys on rank 0 (trainable ones from the fp32 master,
        in each parameter's original dtype), one group at a time; {} on other ranks."""
        self._allow_state_dict = True
        try:
            local_sd = self.model.state_dict(keep_vars=True)
        finally:
            self._allow_state_dict = False
        values = self._gathered_values("full_state_dict")
        if self.comm.rank != 0:
            return {}
        out = {}
        for key, value in local_sd.items():
            out[key] = values[key] if key in values else value.detach().to("cpu").clone()
        return out

    @torch.no_grad()
    def _gathered_values(self, purpose: str) -> Dict[str, torch.Tensor]:
        """Collective: every parameter's full value under each of its names on rank 0 (CPU tensors in the
        parameter's original dtype; trainable ones from the fp32 master), one flat group at a time; {} on the
        other ranks."""
        rank0 = self.comm.rank == 0
        values: Dict[str, torch.Tensor] = {}
        reuse: Dict[torch.dtype, torch.Tensor] = {}  # one gather buffer: one group's bytes at a time
        for g in self.groups:
            full = full_group_values(self, g.plan.index, purpose, reuse=reuse)
            if rank0:
                for slot in g.plan.slots:
                    view = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    t = view.to(device="cpu", dtype=slot.orig_dtype, copy=True)
                    for alias in slot.aliases:
                        values[alias] = t
            del full
        return values

    # ------------------------------------------------------------------ training state (checkpoints)
    def shard_state(self) -> ShardState:
        """This rank's training state (owned values, optimizer state per segment, hyper-parameters, loss scale,
        persistent buffers) as views of the engine's tensors: what a checkpoint saves. See engine/state.py."""
        return capture_shard_state(self)

    def load_shard_state(self, staged: ShardState) -> None:
        """Replace this rank's training state with `staged` (fresh tensors in `shard_state()`'s layout), all at
        once; a layout mismatch raises ValueError before anything changes. Collective at stages 1/2 (the full
        parameters are all-gathered from the new shards): call it on every rank."""
        apply_shard_state(self, staged)


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer, config: Optional[ZeroConfig] = None,
                process_group: Optional[dist.ProcessGroup] = None,
                device: Optional[torch.device] = None, weights: Weights = None) -> ZeroEngine:
    """Shard `model` (in place) and `optimizer` with ZeRO over `process_group` (default: the world).

    The model keeps its class and module tree (hooks are added; parameters become views of flat buffers, or
    empty between uses at stage 3). `optimizer` is sharded in place too: `engine.optimizer` is the same object, now
    an instance of `ZeroOptimizer` and of its own class, stepping this rank's shard.

    `weights`: a safetensors file or a folder save_pretrained wrote (single file or sharded with an index), for a
    model whose parameters are on the meta device (`hf_zero.from_pretrained`, or built inside
    `hf_zero.parameters_on_meta()`): each rank reads only its own shards (stage 3) or one group at a time
    (stages 0-2). A model from `hf_zero.from_pretrained` carries its weights and needs no argument.
    """
    check_elementwise(optimizer, (config or ZeroConfig()).optimizer_is_elementwise)
    return ZeroEngine(model, optimizer, config, process_group, device, weights)
