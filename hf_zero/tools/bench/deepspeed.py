"""DeepSpeed ZeRO-1/2/3 as peers in `hf-zero bench` (an optional extra: `pip install deepspeed`).

DeepSpeed trains the bench's model with a torch AdamW handed to `deepspeed.initialize` (no compiled optimizer), in
the bench's compute precision, with hf_zero's bucket sizes. On CPU it runs on the bench's gloo group with
DS_ACCELERATOR=cpu. What is measured, on each rank:

- model-state bytes: the distinct storages of the parameters DeepSpeed keeps (stage 3: the `ds_tensor` partitions),
  its gradient partitions, its fp32 master partitions and the optimizer's state, taken after every backward and
  reported as the largest (all of them are live then);
- communication: every collective that reaches torch.distributed, counted the paper's way (all-gather and
  reduce-scatter: the full buffer; all-reduce: twice the tensor). Scalars and non-float tensors (grad norm,
  pickled objects) are control traffic and left out, as hf_zero's ledger leaves them out.
"""
from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import threading
import warnings
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .base import Trainer, WorkerContext

INSTALL_HINT = "pip install deepspeed (the optional `bench` extra)"

# torch.distributed function -> (ledger kind, the argument whose elements are counted, multiplier).
_COLLECTIVES: Dict[str, Tuple[str, str, int]] = {
    "all_reduce": ("all_reduce", "tensor", 2),
    "all_reduce_coalesced": ("all_reduce", "tensors", 2),
    "reduce": ("reduce", "tensor", 1),
    "broadcast": ("broadcast", "tensor", 1),
    "all_gather": ("all_gather", "tensor_list", 1),
    "all_gather_into_tensor": ("all_gather", "output_tensor", 1),
    "all_gather_single": ("all_gather", "output_tensor", 1),
    "_all_gather_base": ("all_gather", "output_tensor", 1),
    "reduce_scatter": ("reduce_scatter", "input_list", 1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "_reduce_scatter_base": ("reduce_scatter", "input", 1),
}
CONTROL = "control"


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None when `import deepspeed` works in a fresh interpreter, else why not (with the install hint).

    A subprocess, not an import here: the parent never imports DeepSpeed (its import detects accelerators and
    logs), and whatever breaks the import must not break the bench.
    """
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu" if not _cuda_available() else "cuda")
    code = "import deepspeed, sys; sys.stdout.write('\\n' + deepspeed.__version__)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"import deepspeed failed: {exc}; {INSTALL_HINT}"
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        return f"import deepspeed failed: {lines[-1] if lines else f'exit code {proc.returncode}'}; {INSTALL_HINT}"
    return None


@functools.lru_cache(maxsize=None)
def quantizer_unavailable_reason() -> Optional[str]:
    """None when DeepSpeed's quantizer op loads on this machine's accelerator, else why not. Its ZeRO++ quantized
    weights (zero_quantized_weights: partition_parameters.CUDAQuantizer) and gradients (zero_quantized_gradients:
    coalesced_collectives.all_to_all_quant_reduce) both load `QuantizerBuilder`, which has no CPU implementation.
    A subprocess, as `unavailable_reason`."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu" if not _cuda_available() else "cuda")
    code = "from deepspeed.ops.op_builder import QuantizerBuilder; QuantizerBuilder().load()"
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"DeepSpeed's quantizer op (QuantizerBuilder) did not load: {exc}"
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        return (f"DeepSpeed's zero_quantized_weights / zero_quantized_gradients need its quantizer op "
                f"(QuantizerBuilder), which does not load on the {env['DS_ACCELERATOR']} accelerator: "
                f"{lines[-1] if lines else f'exit code {proc.returncode}'}")
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ====================================================================================================== comm
def _count_elements(value: Any) -> Tuple[int, bool, int]:
    """(elements, whether it is data, bytes): a tensor or a list of tensors; non-float or single-element is
    control."""
    import torch

    tensors = [t for t in (value if isinstance(value, (list, tuple)) else [value]) if torch.is_tensor(t)]
    numel = sum(t.numel() for t in tensors)
    is_data = numel > 1 and all(t.is_floating_point() for t in tensors)
    return numel, is_data, sum(t.numel() * t.element_size() for t in tensors)


class CollectiveCounter:
    """Counts elements per kind for every collective called through torch.distributed in this process.

    Installed before `import deepspeed`, so DeepSpeed's own references (it keeps some functions it looked up at
    start-up) are the counting wrappers. A call made inside another counted call (torch's deprecated aliases call
    the new names) is counted once, by the outer one.
    """

    def __init__(self) -> None:
        self.elements: Dict[str, float] = defaultdict(float)
        # bytes of the data collectives (paper counting, the tensors' own dtype), intra- / inter-host by whether
        # the collective's group spans hosts (known once `set_hosts` ran; intra before)
        self.bytes: Dict[str, Dict[str, float]] = {"intra": defaultdict(float), "inter": defaultdict(float)}
        self._depth = threading.local()
        self._host_of: Optional[List[str]] = None
        self._spans: Dict[Any, bool] = {}

    def set_hosts(self) -> None:
        """Learn each rank's hostname (one all_gather_object, control traffic) so collectives are booked intra- or
        inter-host."""
        import socket

        import torch.distributed as dist

        names: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, socket.gethostname())
        self._host_of = [str(n) for n in names]

    def _where(self, group: Any) -> str:
        if self._host_of is None:
            return "intra"
        key = id(group) if group is not None else None
        if key not in self._spans:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group) if group is not None else range(len(self._host_of))
            self._spans[key] = len({self._host_of[r] for r in ranks}) > 1
        return "inter" if self._spans[key] else "intra"

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name, (kind, arg, factor) in _COLLECTIVES.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(original, kind, arg, factor)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)

    def _wrap(self, original: Callable, kind: str, arg: str, factor: int) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                bound = signature.bind_partial(*args, **kwargs)
                numel, is_data, nbytes = _count_elements(bound.arguments.get(arg))
                self.elements[kind if is_data else CONTROL] += factor * numel
                if is_data:
                    self.bytes[self._where(bound.arguments.get("group"))][kind] += factor * nbytes
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        return counted

    def data_elements(self) -> Dict[str, float]:
        """Cumulative elements per data kind (control traffic left out)."""
        return {k: v for k, v in self.elements.items() if k != CONTROL}

    def data_bytes(self) -> Dict[str, Dict[str, float]]:
        """Cumulative bytes per data kind, {"intra": {kind: bytes}, "inter": {kind: bytes}}."""
        return {where: dict(kinds) for where, kinds in self.bytes.items()}


# ====================================================================================================== memory
def _tensors(value: Any, depth: int = 0) -> Iterable[Any]:
    """Tensors in a tensor / list / tuple / dict (nested a few levels; DeepSpeed keeps lists of lists)."""
    import torch

    if torch.is_tensor(value):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors`: flat buffers and the views into them count once."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


# Where DeepSpeed 0.1x's ZeRO optimizers keep each model state (stage 1/2: DeepSpeedZeroOptimizer, stage 3:
# DeepSpeedZeroOptimizer_Stage3); a missing attribute counts nothing.
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_GRAD_ATTRS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")


def model_state_tensors(engine) -> Dict[str, List[Any]]:
    """The tensors holding this rank's parameters, gradients, master weights and optimizer states."""
    zero = engine.optimizer
    module_params = list(engine.module.parameters())
    # stage 3 parameters are empty outside a gather; their partition lives in `ds_tensor`
    params = [getattr(p, "ds_tensor", None) for p in module_params] + [p.data for p in module_params]
    grads = [p.grad for p in module_params]
    for name in _GRAD_ATTRS:
        grads += list(_tensors(getattr(zero, name, None)))
    master: List[Any] = []
    for name in _MASTER_ATTRS:
        master += list(_tensors(getattr(zero, name, None)))
    inner = getattr(zero, "optimizer", zero)  # the torch AdamW DeepSpeed wraps
    states = [v for state in inner.state.values() for v in _tensors(state)]
    groups = {"params": params, "grads": grads, "master": master, "optimizer_states": states}
    return {name: [t for t in ts if t is not None] for name, ts in groups.items()}


def model_state_bytes(engine) -> Dict[str, int]:
    """Bytes per model state and their total, each storage counted once across all of them."""
    groups = model_state_tensors(engine)
    out = {name: storage_bytes(ts) for name, ts in groups.items()}
    out["model_states"] = storage_bytes(t for ts in groups.values() for t in ts)
    return out


# ====================================================================================================== trainer
def deepspeed_config(ctx: WorkerContext, stage: int, zero_extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """DeepSpeed's config for the bench's settings: same batch, accumulation and precision; hf_zero's buckets;
    `zero_extra`: further zero_optimization keys (the ZeRO++ systems: zero_hpz_partition_size,
    zero_quantized_weights, zero_quantized_gradients)."""
    from ...config import ZeroConfig

    s = ctx.settings
    bf16 = s.mixed_precision == "bf16"
    element = 2 if bf16 else 4
    hf = ZeroConfig()
    zero: Dict[str, Any] = {
        "stage": stage,
        # DeepSpeed counts bucket sizes in elements, hf_zero in bytes: the same bytes for both
        "reduce_bucket_size": hf.reduce_bucket_size // element,
        "allgather_bucket_size": hf.allgather_bucket_size // element,
    }
    if stage == 3:
        # The default (1e5 elements) keeps every small tensor whole on every rank: all of a small test model.
        zero["stage3_param_persistence_threshold"] = 0
    zero.update(zero_extra or {})
    return {
        "train_micro_batch_size_per_gpu": s.batch_size,
        "gradient_accumulation_steps": s.grad_accum,
        "train_batch_size": s.batch_size * s.grad_accum * ctx.world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        # DeepSpeed clips the gradient norm at 1.0 unless told otherwise; no other system clips (on GPT-2 124M it
        # scaled every gradient by ~0.06 and moved the loss by 1e-3 after six steps)
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,  # the client's torch AdamW
        "zero_force_ds_cpu_optimizer": False,  # no compiled DeepSpeedCPUAdam
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def prepare_process(ctx: WorkerContext) -> None:
    """This worker's environment for DeepSpeed: its accelerator, rank variables, and stdout kept for the table."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # DeepSpeed logs to stdout; `--json -` owns the parent's
    # DeepSpeed calls torch's old collective names, and torch warns on every call site of every rank
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if ctx.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    local_rank = ctx.device.index if ctx.device.type == "cuda" else ctx.rank
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(local_rank))


def skip_shm_op_build() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce op on CPU (about 40 s of g++ per fresh
    TORCH_EXTENSIONS_DIR). The op serves `inference_all_reduce` only, and stays inactive unless LOCAL_SIZE is
    set, so training is the same without it. If this DeepSpeed has no such table, it builds as usual."""
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (AttributeError, ImportError, TypeError):
        pass


class DeepSpeedTrainer(Trainer):
    """deepspeed.initialize(model, torch AdamW, ZeRO stage k); engine.backward and engine.step per micro-batch
    (DeepSpeed scales the loss by the accumulation steps and steps the optimizer on the boundary itself)."""

    def __init__(self, model, ctx: WorkerContext, stage: int, zero_extra: Optional[Dict[str, Any]] = None) -> None:
        import torch

        prepare_process(ctx)
        self.counter = CollectiveCounter()
        self.counter.install()  # before `import deepspeed`: see CollectiveCounter
        import deepspeed

        if ctx.device.type == "cpu":
            skip_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo" if ctx.device.type == "cpu" else "nccl")
        self.counter.set_hosts()
        self.ctx = ctx
        optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.settings.lr)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    config=deepspeed_config(ctx, stage, zero_extra))
        self.zero_extra = dict(zero_extra or {})
        self.version = deepspeed.__version__
        self.peak_states: Dict[str, int] = {}

    def micro_step(self, input_ids, final: bool):
        if self.engine.is_gradient_accumulation_boundary() != final:
            raise RuntimeError("DeepSpeed's gradient accumulation boundary is out of step with the bench's")
        loss = self.engine(input_ids=input_ids, labels=input_ids).loss
        self.engine.backward(loss)
        self._record_states()
        self.engine.step()  # a no-op off the boundary
        return loss.detach()

    def optimizer_step(self) -> None:
        """Done by engine.step() on the final micro-batch."""

    def compile(self, backend: str) -> None:
        self.engine.compile(backend=backend)  # DeepSpeed's own entry: it compiles the module inside its engine

    def _record_states(self) -> None:
        # After a backward every state is live (gradients reduced, not yet freed by the step); keep the largest.
        now = model_state_bytes(self.engine)
        if now["model_states"] >= self.peak_states.get("model_states", -1):
            self.peak_states = now

    def state_bytes(self) -> int:
        return int(self.peak_states.get("model_states", 0))

    def comm_elements(self) -> Optional[Dict[str, float]]:
        return self.counter.data_elements()

    def comm_bytes_split(self) -> Optional[Dict[str, Dict[str, float]]]:
        return self.counter.data_bytes()

    def row_extras(self) -> Dict[str, Any]:
        return {"peer_version": f"deepspeed {self.version}", "state_bytes_measured_by_kind": dict(self.peak_states),
                **({"deepspeed_zero_options": self.zero_extra} if self.zero_extra else {})}
