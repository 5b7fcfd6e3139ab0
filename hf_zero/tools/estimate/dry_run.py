"""`hf-zero estimate --dry-run`: the real engine, one real step, as one rank of a world of N, on fake tensors.

The formulas (formulas.py) and the plan (plan.py) say what the engine should allocate and send; the dry run shows
what it does. It builds the model on the meta device, makes its parameters fake CPU tensors (FakeTensorMode: shapes,
dtypes and storages of the right size, no values, no math), creates a world of N ranks on torch's `fake` process-group
backend (every collective returns at once), shards the model with the real `shard_model` as rank r, and runs one real
optimizer step: `micro_batches` forwards and backwards (the non-final ones under `no_sync`), clipping, the step.

What it reports is measured, not computed: the engine's own `memory_stats()` (model states by kind, buffers,
gathered parameters), the peak of live tensor bytes over the step split by the phase that allocated them
(live_bytes.py: activations are what the forward allocated), and the engine's ledger of the step (calls, elements,
intra/inter-host and per-strategy bytes). Beside each: the estimator's plan count and the paper's formula.

The other ranks do not exist. The control plane (engine/control.py) answers for them (`SimulatedControl`: every rank
agrees and runs on host r // K), and the fp16 overflow flag reads "no overflow". What it cannot see: `CANNOT_SEE`.

Long sequences run the real code too: with `sequence_parallel_size` K (or a tiled loss / MLP) the model is prepared
as HfZeroAccelerator prepares it (integrations/sequence_parallel.py: the Ulysses attention wrapper, the pre-hook that
cuts the batch to this rank's S/K tokens, the whole sequence's loss) over sp groups made on the fake world, where
the all-to-alls of q, k, v and the output return at once with tensors of the right shapes.

Device and host: the fake tensors live on the CPU, so the dry run says which bytes the machine it plays keeps in
host memory: with `offload_optimizer` the fp32 master shards, the gradient shards at stages 2/3, and what the
optimizer step allocates (its states and temporaries: the update runs on the host), with `offload_params` the
parameter shards, and with `cpu_checkpointing` the activation checkpoints. The engine's CheckpointStore keeps a
checkpoint where it is when the compute device is the CPU, so the dry run makes the copies a GPU run makes: a host
copy when the store keeps a checkpoint (saved-tensor hooks outside the store's, which it hands what it keeps) and a
device copy when the backward takes it back.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ...config import ZeroConfig
from ...engine.activations import KEEPING_CHECKPOINT
from ...engine.control import simulated_hosts
from ..presets import llama_of_size, names, preset
from .formulas import hierarchical_comm_elements, model_state_bytes, recipe
from .live_bytes import LiveBytes
from .plan import comm_sizes, plan_bytes, wire_bytes

__all__ = ["CANNOT_SEE", "dry_run"]

CANNOT_SEE = ("kernel workspaces (cuBLAS, attention kernels) and the CUDA context",
              "NCCL's own buffers and channels",
              "the caching allocator's rounding and fragmentation (reserved minus allocated)",
              "the other ranks (each rank's bytes differ only by where padding falls; run --rank R for another)",
              "time: fake tensors do no math and fake collectives send nothing")


def _meta_model(model: Any) -> nn.Module:
    """`model` on meta: a number of parameters (a Llama of that size), a preset name, a config.json or its folder,
    a dict or a PretrainedConfig."""
    from ...integrations.hf_models import causal_lm_from_config, config_from_dict, config_from_path, quiet

    quiet()
    spec = llama_of_size(float(model)) if isinstance(model, (int, float)) else model
    if isinstance(spec, str) and preset(spec) is not None:
        spec = preset(spec)
    try:
        config = config_from_dict(spec) if isinstance(spec, dict) else config_from_path(spec)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}; nor is it a model preset ({', '.join(names())})") from None
    with torch.device("meta"):
        return causal_lm_from_config(config)


def _fake_cpu(model: nn.Module) -> nn.Module:
    """`model` (on meta) with fake CPU tensors in place of its parameters and buffers, in place. Unlike
    `to_empty`, a tensor two modules share (tied embeddings) stays one tensor."""
    memo: Dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            empty = torch.empty_like(t, device="cpu")
            memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return memo[id(t)]

    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is not None:
                    slots[name] = fake(t)
    return model


@contextlib.contextmanager
def _fake_world(num_processes: int, rank: int) -> Iterator[None]:
    """torch.distributed's default group as rank `rank` of `num_processes` on the `fake` backend, for the block."""
    if dist.is_initialized():
        raise RuntimeError("hf_zero dry run: torch.distributed is already initialized in this process; the dry run "
                           "makes its own world of fake ranks. Run it in a process of its own (hf-zero estimate "
                           "--dry-run does)")
    # torch's fake store and backend live in its testing package (the one torchtitan's estimator uses too)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=num_processes)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _HostCheckpoints:
    """Saved-tensor hooks around the forward, outside the engine's CheckpointStore (which hands them what it keeps):
    a checkpoint the store keeps goes to the host as a copy, booked there, and comes back as a device copy when the
    backward recomputes, as on a GPU. Everything else autograd saves passes through unchanged."""

    def __init__(self, tracker: LiveBytes) -> None:
        self.tracker = tracker

    def pack(self, t: torch.Tensor) -> Any:
        # the store calls its outer pack itself, on what it keeps; autograd calls it for every other saved tensor
        if not KEEPING_CHECKPOINT.get():
            return t
        self.tracker.host = True
        try:
            return _OnHost(t.detach().clone())
        finally:
            self.tracker.host = False

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor.clone() if isinstance(packed, _OnHost) else packed

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _OnHost:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _AllToAlls(TorchDispatchMode):
    """Counts the all-to-alls (Ulysses' q, k, v and output exchanges), which go to torch.distributed directly rather
    than through the engine's ledger: calls, and elements and bytes of each call's buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.elements = self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.c10d.alltoall_base_.default:
            send = args[1]
            self.calls += 1
            self.elements += send.numel()
            self.bytes += send.numel() * send.element_size()
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.calls = self.elements = self.bytes = 0


def _prepare_long_sequences(model: nn.Module, config: ZeroConfig, gradient_checkpointing: bool,
                            cpu_checkpointing: bool) -> None:
    """What HfZeroAccelerator does to a model before sharding it: sequence parallelism and tiling
    (`enable_long_sequences`, over sp groups of the fake world), then hf_zero's activation checkpointing."""
    from ...engine.activations import enable_activation_checkpointing
    from ...engine.sequence import SequenceGroups
    from ...integrations.sequence_parallel import enable_long_sequences

    sp = config.sequence_parallel_size
    if sp > 1 or config.tiled_loss_tokens or config.tiled_mlp_tokens:
        enable_long_sequences(model, SequenceGroups.build(sp), config.tiled_loss_tokens, config.tiled_mlp_tokens)
    if gradient_checkpointing:
        enable_activation_checkpointing(model, "on", cpu_checkpointing)


def dry_run(model: Any, config: ZeroConfig, num_processes: int, *, ranks_per_host: Optional[int] = None,
            rank: int = 0, batch_size: int = 1, seq_len: int = 128, micro_batches: int = 1, steps: int = 1,
            max_grad_norm: Optional[float] = 1.0, gradient_checkpointing: bool = False,
            cpu_checkpointing: bool = False, trace: bool = False, progress: bool = False) -> Dict[str, Any]:
    """Run one optimizer step of the real engine as rank `rank` of `num_processes` on fake tensors; return what
    it measured (bytes per rank by kind, the peak, the ledger) beside the estimator's figures.

    Args:
        model: a number of parameters (a Llama of about that size), a preset name, a local config.json or model
            folder, a config dict (with "model_type") or a PretrainedConfig. Built on meta; no weights are read.
        config: the ZeroConfig to shard with (HSDP/hpZ: shard_group_size / hpz_partition_size, "host" included).
        num_processes: N, the world size (1 .. 65536).
        ranks_per_host: K, ranks per host (hosts of K consecutive ranks; default: one host of N).
        rank: which rank this process plays.
        batch_size, seq_len: the micro-batch of token ids; micro_batches: accumulation steps per optimizer step.
        steps: optimizer steps to run; everything is reported for the last one (2: the steady state, after the
            first backward has fixed the reducer's launch order, as DDP's first iteration fixes its buckets).
        max_grad_norm: clip to this norm (None: no clipping).
        gradient_checkpointing: hf_zero's activation checkpointing on the model's layers (torch's non-reentrant
            checkpoint), as HfZeroAccelerator installs it.
        cpu_checkpointing: the checkpoints in host memory (P_a+cpu); needs gradient_checkpointing.
        trace: also return the ledger's every call of the step, in order (`"trace"`: kind, elements, bytes, inter).
    """
    if not 1 <= num_processes <= 65536:
        raise ValueError(f"num_processes must be in 1..65536, got {num_processes}")
    if not 0 <= rank < num_processes:
        raise ValueError(f"rank {rank} is not a rank of a world of {num_processes}")
    k = ranks_per_host or num_processes
    if num_processes % k:
        raise ValueError(f"ranks_per_host {k} does not divide num_processes {num_processes}: every host runs the "
                         f"same number of ranks")
    if batch_size < 1 or seq_len < 1 or micro_batches < 1 or steps < 1:
        raise ValueError("batch_size, seq_len, micro_batches and steps must be at least 1")
    if cpu_checkpointing and not gradient_checkpointing:
        raise ValueError("cpu_checkpointing keeps activation checkpoints in host memory, so it needs "
                         "gradient_checkpointing (--gradient-checkpointing)")
    sp = config.sequence_parallel_size
    if num_processes % sp:
        raise ValueError(f"sequence_parallel_size={sp} does not divide num_processes {num_processes}")
    if seq_len % sp:
        raise ValueError(f"seq_len {seq_len} is not a multiple of sequence_parallel_size={sp}: each sp rank holds "
                         f"seq_len / {sp} tokens")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ...engine.engine import shard_model

    seconds: Dict[str, float] = {}
    rss0 = _max_rss()
    t = time.perf_counter()
    from tqdm.auto import tqdm

    bar = tqdm(total=2 + steps * (1 + 2 * micro_batches), desc="dry run (meta, shard, forward/backward, step)", file=sys.stderr,
               leave=False, disable=not progress)
    meta = _meta_model(model)
    from ...integrations.hf_models import attend_as_on_real_tensors

    attend_as_on_real_tensors(meta)
    seconds["build_meta"] = time.perf_counter() - t
    bar.update()
    offload = config.offload_optimizer == "cpu"
    all_to_alls = _AllToAlls()
    kept: Tuple[int, int] = (0, 0)
    with _fake_world(num_processes, rank), simulated_hosts(k), \
            FakeTensorMode(allow_non_fake_inputs=True):  # the meta model is the one real input
        engine = None
        tracker = LiveBytes(lambda: engine.gathered.now if engine is not None and engine.gatherer is not None else 0)
        host_checkpoints = _HostCheckpoints(tracker)
        with tracker, all_to_alls if sp > 1 else contextlib.nullcontext():
            t = time.perf_counter()
            fake = _fake_cpu(meta)
            _prepare_long_sequences(fake, config, gradient_checkpointing, cpu_checkpointing)
            optimizer = torch.optim.AdamW(fake.parameters(), lr=1e-4)
            engine = shard_model(fake, optimizer, config)
            if engine.gatherer is not None:  # resized outside any op: counted by the engine (`gathered`)
                tracker.exclude(g.full for g in engine.groups)
            if offload:  # ZeRO-Offload's own fp32 copy of the shard (the step's input and output), and at stages 2/3
                # the gradient shards, which each reduced bucket's owned range is copied into
                tracker.to_host(g.master for g in engine.groups if g.master is not None and not g.master_is_shard)
                tracker.to_host(g.grad_shard for g in engine.groups if g.grads_on_host)
            if config.offload_params == "cpu":
                tracker.to_host(g.shard for g in engine.groups if g.residency.sharded)
            seconds["shard_model"] = time.perf_counter() - t
            bar.update()
            built = engine.memory_stats()
            vocab = fake.get_input_embeddings().num_embeddings
            for step in range(steps):  # the last step is the one reported
                if trace:
                    engine.comm.ledger.trace = []
                engine.reset_comm_stats()
                engine.reset_peak_memory_stats()
                tracker.reset_peak()
                all_to_alls.reset()
                t = time.perf_counter()
                for m in range(micro_batches):
                    ids = torch.randint(0, vocab, (batch_size, seq_len))
                    context = engine.no_sync() if m < micro_batches - 1 else contextlib.nullcontext()
                    with context:
                        tracker.phase = "forward"
                        with host_checkpoints.hooks() if cpu_checkpointing else contextlib.nullcontext():
                            loss = fake(input_ids=ids, labels=ids).loss
                        kept = (tracker.live["forward"], tracker.host_live["forward"])
                        bar.update()
                        tracker.phase = "backward"
                        engine.backward(loss)
                        del loss
                        bar.update()
                tracker.phase = "step"
                if max_grad_norm is not None:
                    engine.clip_grad_norm_(max_grad_norm)
                tracker.host = offload  # ZeRO-Offload's update runs on the host: its states and temporaries
                engine.optimizer.step()
                tracker.host = False
                engine.optimizer.zero_grad()
                seconds["step"] = time.perf_counter() - t
                bar.update()
        bar.close()
        report = _report(engine, config, num_processes, k, rank, micro_batches, built, tracker)
        report["peak"]["kept_by_forward"] = {"total": kept[0], "host": kept[1]}
        report["long_sequences"] = {
            "sequence_parallel_size": sp, "data_parallel_size": num_processes // sp,
            "tokens_per_rank": batch_size * seq_len // sp, "tiled_loss_tokens": config.tiled_loss_tokens,
            "tiled_mlp_tokens": config.tiled_mlp_tokens,
            "all_to_all": {"calls": all_to_alls.calls, "elements": all_to_alls.elements, "bytes": all_to_alls.bytes}}
        if trace:
            report["trace"] = list(engine.comm.ledger.trace)
        engine.close()
    report.update(batch_size=batch_size, seq_len=seq_len, micro_batches=micro_batches, steps=steps,
                  gradient_checkpointing=gradient_checkpointing, cpu_checkpointing=cpu_checkpointing,
                  seconds={key: round(v, 3) for key, v in seconds.items()},
                  python_peak_rss_growth=_max_rss() - rss0, cannot_see=list(CANNOT_SEE))
    return report


def _report(engine: Any, config: ZeroConfig, n: int, k: int, rank: int, micro_batches: int,
            built: Dict[str, int], tracker: LiveBytes) -> Dict[str, Any]:
    plan = engine.plan
    stats = engine.memory_stats()
    planned = plan_bytes(plan, config, engine.partition_comm.rank)
    option = engine.topology.option
    kk = engine.topology.group_size if option != "none" else k
    psi, frozen = plan.num_trainable, plan.num_frozen
    formula = model_state_bytes(psi, engine.partition_comm.world_size if option == "hsdp" else n, config.stage,
                                recipe(config.mixed_precision, config.grad_accum_dtype), frozen)
    trainable, frozen_padded, resident = comm_sizes(plan)
    elements = hierarchical_comm_elements(trainable, n, kk, config.stage, option, micro_batches,
                                          resident if config.stage == 3 else 0, frozen_padded)
    wire = wire_bytes(plan, config)
    ledger = engine.comm_stats()
    kinds = [kd for kd in ("all_gather", "reduce_scatter", "all_reduce") if kd in ledger]
    return {
        "mode": "dry_run", "world_size": n, "ranks_per_host": k, "hosts": n // k, "rank": rank,
        "stage": config.stage, "topology": engine.topology.describe(), "option": option,
        "mixed_precision": config.mixed_precision, "grad_accum_dtype": config.grad_accum_dtype,
        "psi": psi, "frozen": frozen, "groups": len(plan.groups), "units": len(plan.units),
        "padding_elements": plan.padding,
        "measured": {key: stats[key] for key in ("params", "grads", "master", "optimizer_states", "model_states",
                                                 "module_buffers", "comm_buffers_peak", "comm_buffers_budget",
                                                 "gathered_params_peak", "live_parameters_budget",
                                                 "hpz_secondary_peak", "error_feedback")},
        "max_live_parameters": config.max_live_parameters if config.stage == 3 else None,
        "after_construction": {key: built[key] for key in ("model_states", "buffers")},
        "peak": {"total": tracker.peak, "at_peak": dict(tracker.at_peak),
                 "activations": tracker.phase_peak.get("forward", 0),
                 "device": {"total": tracker.device_peak, "at_peak": dict(tracker.device_at_peak),
                            "activations": tracker.device_phase_peak.get("forward", 0)},
                 "host": {"total": tracker.host_peak, "at_peak": dict(tracker.host_at_peak)}},
        "plan": planned,
        "formula": {"model_states": formula, "recipe": "hf_zero's for these settings, no padding"},
        "ledger": {kd: ledger[kd] for kd in kinds + ["total"]},
        "ledger_by_strategy": {name: v["total"] for name, v in engine.comm_stats_by_strategy().items()},
        "formula_comm": {side: {kd: {"elements": int(v), "bytes": int(v) * wire[kd]} for kd, v in kinds_.items()}
                         for side, kinds_ in elements.items()},
    }


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
