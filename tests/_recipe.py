"""The training recipe, twice: a plain single-process reference (never touches hf_zero) and the same recipe through
the hf_zero engine inside a gloo worker.

Recipe: `steps` optimizer steps, each over `accum` global micro-batches of GLOBAL_BATCH rows; loss/accum per
micro-batch; clip the global grad norm to 1.0; AdamW with two param groups (models.param_groups).  The engine run
gives each rank its slice of every global micro-batch and wraps the first accum-1 micro-batches in no_sync().
"""
from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections import deque
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

import models

STEPS = 4
ACCUM = 3


def _detach_state(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


# ------------------------------------------------------------------------------------------------------- reference
@functools.lru_cache(maxsize=None)
def reference_train(kind: str, variant: str = "full", steps: int = STEPS, accum: int = ACCUM,
                    precision: str = "fp32") -> Dict[str, Any]:
    """Single process on the full global micro-batches.  precision "bf16": bf16 compute copy of the model, fp32
    master weights, gradients accumulated in fp32 on the master, AdamW on the master (the mixed-precision recipe)."""
    torch.set_num_threads(1)
    master = models.make_model(kind, variant)
    init = _detach_state(master.state_dict())
    opt = models.make_optimizer(master)
    compute = master
    if precision == "bf16":
        compute = copy.deepcopy(master).to(torch.bfloat16)
    pairs = list(zip(master.parameters(), compute.parameters()))
    trainable = [p for p in master.parameters() if p.requires_grad]
    batches = models.make_batches(steps, accum)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for mb in batches[step]:
            if compute is not master:
                with torch.no_grad():
                    for mp, cp in pairs:
                        cp.copy_(mp)
            loss = compute(input_ids=mb, labels=mb).loss
            (loss / accum).backward()
            total += loss.item()
            if compute is not master:
                for mp, cp in pairs:
                    if cp.grad is not None:
                        mp.grad = cp.grad.float() if mp.grad is None else mp.grad + cp.grad.float()
                        cp.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / accum)
    return {"losses": losses, "norms": norms, "state": _detach_state(master.state_dict()), "init": init}


# ------------------------------------------------------------------------------------------------------ engine side
def engine_train(rank: int, world_size: int, kind: str, variant: str = "full", stage: int = 2,
                 steps: int = STEPS, accum: int = ACCUM, mixed_precision: str = "no",
                 grad_accum_dtype: str = "fp32", checkpointing: bool = False, bucket_size: Optional[int] = None,
                 probe_step: Optional[int] = None, zero_checkpointing: Optional[tuple] = None,
                 offload_optimizer: str = "none", offload_params: str = "none",
                 sync_every_micro_batch: bool = False, zero_options: Optional[dict] = None,
                 stray_forward: bool = False, final_memory: bool = False,
                 after_shard: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]:
    """The recipe through hf_zero on this rank (`sync_every_micro_batch`: never enter no_sync(), so stages 0/1
    reduce after every micro-batch and accumulate on top of reduced sums; `stray_forward`: before each step, one
    more forward with grad enabled whose loss is never backpropagated, as a metric computed in train mode would be).  Records per-step comm_stats (reset at each step's start, read
    after optimizer.step/zero_grad; `final_memory`: memory_stats() after the last step); at `probe_step` (0-based), after the last backward and before clipping,
    records memory_stats and independent byte counts of the tensors the engine holds. `zero_options` may carry
    `collectives` ("flat": the NCCL-shaped collectives on gloo); the run records the strategies it chose and the
    ledger per strategy. `after_shard(engine)`: called once the engine is built, before the first forward."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model(kind, variant)
    models.assert_no_dropout(model)
    init_fp = models.param_fingerprint(model)
    if checkpointing:
        models.enable_checkpointing(model)
    if zero_checkpointing is not None:  # (mode, cpu): hf_zero's own checkpoint function
        from hf_zero.engine.activations import enable_activation_checkpointing

        enable_activation_checkpointing(model, *zero_checkpointing)
    # Calls of a module inside each decoder layer: 1 per micro-batch, 2 with activation checkpointing (the backward
    # recomputes the layer's forward; transformers checkpoints `forward`, so the layer's own hooks run only once).
    layer_calls = [0]
    units = models.unit_modules(model)
    for unit in units:
        inner = next(m for m in unit.children() if any(True for _ in m.parameters()))
        inner.register_forward_pre_hook(lambda *_: layer_calls.__setitem__(0, layer_calls[0] + 1))
    opt = models.make_optimizer(model)
    kw = {} if bucket_size is None else {"reduce_bucket_size": bucket_size, "allgather_bucket_size": bucket_size}
    cfg = ZeroConfig(stage=stage, mixed_precision=mixed_precision, grad_accum_dtype=grad_accum_dtype,
                     offload_optimizer=offload_optimizer, offload_params=offload_params, **kw, **(zero_options or {}))
    engine = shard_model(model, opt, cfg)
    if after_shard is not None:  # a test's look inside the engine before training
        after_shard(engine)
    out: Dict[str, Any] = {"init_fp": init_fp, "same_model": engine.model is model, "losses": [], "norms": [],
                           "norm_is_tensor": [], "comm": [], "comm_by_strategy": [], "memory": None,
                           "collectives": sorted(engine.collectives)}
    batches = models.make_batches(steps, accum)
    for step in range(steps):
        engine.reset_comm_stats()
        total = 0.0
        for j, mb in enumerate(batches[step]):
            x = models.rank_slice(mb, rank, world_size)
            last = j == accum - 1 or sync_every_micro_batch
            ctx = contextlib.nullcontext() if last else engine.no_sync()
            with ctx:
                loss = engine.model(input_ids=x, labels=x).loss
                engine.backward(loss / accum)
            total += loss.item()
        if stray_forward:
            engine.model(input_ids=x, labels=x).loss.detach()
        if step == probe_step:
            out["memory"] = {"stats": dict(engine.memory_stats()), **held_tensor_bytes(engine)}
        norm = engine.clip_grad_norm_(1.0)
        out["norm_is_tensor"].append(isinstance(norm, torch.Tensor))
        out["norms"].append(float(norm))
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        out["comm"].append(copy.deepcopy(engine.comm_stats()))
        out["comm_by_strategy"].append(engine.comm_stats_by_strategy())
        out["losses"].append(total / accum)
    out["layer_calls_per_micro_batch"] = layer_calls[0] / (steps * accum * len(units))
    if final_memory:  # memory_stats() after the run: peaks and budgets
        out["final_memory"] = dict(engine.memory_stats())
    sd = engine.full_state_dict()
    if rank == 0:
        out["state"] = _detach_state(sd)
    else:
        out["state_len"] = len(sd)  # must be {} off rank 0
    return out


# --------------------------------------------------------------------------------------------- held-memory counting
def _storage_key(t: torch.Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count the buffer once)."""
    seen = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        ptr, nbytes = _storage_key(t)
        if nbytes:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, torch.dtype, torch.device, torch.Size,
          types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType)


def _reachable_tensors(root: Any, limit: int = 200_000):
    """Every tensor reachable from `root` through attributes, dicts, lists, tuples and sets (plus .grad).
    Returns (tensors, complete): complete is False if the walk stopped at `limit` objects."""
    found, seen, stack = [], set(), [root]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack.extend(obj)
        else:
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                stack.append(d)
            for slot in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(slot, str) and hasattr(obj, slot):
                    stack.append(getattr(obj, slot))
    return found, not stack


def held_tensor_bytes(engine) -> Dict[str, int]:
    """Independent counts of what this rank holds:
    core: storages of the model's parameters, their .grad, the model's buffers, the engine optimizer's
          param_groups params and their .grad, and the engine optimizer's state tensors (public API only);
    reachable: every tensor storage reachable from the engine object (flat buffers, shards, grad buffers...)."""
    model: nn.Module = engine.model
    opt = engine.optimizer
    core = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    core += [b for b in model.buffers()]
    for g in opt.param_groups:
        core += list(g["params"]) + [p.grad for p in g["params"]]
    for st in opt.state.values():
        core += [v for v in st.values() if isinstance(v, torch.Tensor)]
    reachable, complete = _reachable_tensors(engine)
    return {"core_bytes": _tensor_bytes(core), "reachable_bytes": _tensor_bytes(reachable), "walk_complete": complete,
            "model_buffer_bytes": _tensor_bytes(model.buffers())}


# ------------------------------------------------------------------------------------------------------ comparisons
def state_mismatches(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], rtol: float = 1e-5,
                     atol: float = 1e-6) -> List[str]:
    """Human-readable list of differences between two state dicts (empty when they match)."""
    problems = []
    if set(got) != set(want):
        problems.append(f"keys differ: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}")
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k]
        if tuple(g.shape) != tuple(w.shape):
            problems.append(f"{k}: shape {tuple(g.shape)} != {tuple(w.shape)}")
            continue
        if g.dtype != w.dtype:
            problems.append(f"{k}: dtype {g.dtype} != {w.dtype}")
            continue
        if not torch.allclose(g, w, rtol=rtol, atol=atol):
            err = (g.double() - w.double()).abs()
            problems.append(f"{k}: max abs err {err.max().item():.3g} (ref max {w.abs().max().item():.3g})")
    return problems
