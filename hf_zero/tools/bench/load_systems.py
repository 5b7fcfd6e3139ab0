"""The load paths `hf-zero bench --load` measures (load.py runs and reports them): hf_zero stages 0-3, FSDP2 the
torchtitan way, DeepSpeed ZeRO through Transformers' own from_pretrained; and the checks of what each loaded.

Transformers is reached inside the functions: the peers need Transformers' own loading path (FSDP2's meta build,
DeepSpeed's HfDeepSpeedConfig), reached through integrations/hf_models.py like every Transformers call of the tools.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

from .base import WorkerContext, local_nbytes

# Presets only big enough to see loading memory; for manual runs (minutes on a CPU).

@dataclass
class LoadJob:
    """What a load worker needs (picklable)."""

    folder: str
    world_size: int
    threads_per_rank: int
    timeout_s: float
    lr: float = 1e-4
    verify: bool = True
    malloc_mmap_threshold: Optional[int] = None  # glibc: allocations of at least this many bytes are mmap'd
    files: List[str] = field(default_factory=list)


def _torch_states(model, optimizer) -> Dict[str, int]:
    """Bytes of the distinct parameters (local shards), their .grad and the optimizer's state tensors."""
    import torch

    seen, params, grads, states = set(), 0, 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += local_nbytes(p)
        grads += local_nbytes(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                states += local_nbytes(v)
    return {"params": params, "grads": grads, "optimizer_states": states, "model_states": params + grads + states}


def _aliases(model) -> List[List[str]]:
    """Names of each distinct parameter (tied weights have several)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return list(names.values())


def weight_files(folder: str) -> List[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in files]
    return [os.path.join(folder, "model.safetensors")]


def _compare_with_files(named: Dict[str, Any], folder: str) -> Dict[str, Any]:
    """Rank 0: every tensor of the files against the model's tensor of that name (max |diff|, missing names)."""
    from safetensors.torch import load_file

    worst, checked, missing = 0.0, 0, []
    for path in weight_files(folder):
        for key, ref in load_file(path).items():
            got = named.get(key)
            if got is None:
                missing.append(key)
                continue
            got = got.detach().to("cpu")
            if tuple(got.shape) != tuple(ref.shape):
                missing.append(f"{key} (shape {tuple(got.shape)} vs {tuple(ref.shape)})")
                continue
            if ref.numel():
                diff = (got.to(ref.dtype) - ref).abs().max() if ref.is_floating_point() else (got != ref).any()
                worst = max(worst, float(diff))
            checked += 1
    return {"weights_checked": checked, "weights_max_abs_diff": worst, "weights_missing": missing[:10]}


def _compare_buffers(model, config) -> Dict[str, Any]:
    """The model's buffers against a freshly built model's (parameters on meta, buffers computed as usual)."""
    import torch

    from ...engine.weights import parameters_on_meta
    from ...integrations.hf_models import causal_lm_from_config

    with parameters_on_meta():
        ref = causal_lm_from_config(config)
    want = dict(ref.named_buffers())
    got = dict(model.named_buffers())
    worst, bad = 0.0, []
    for name, r in want.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(r.shape) or g.device.type == "meta":
            bad.append(name)
            continue
        if r.numel():
            worst = max(worst, float((g.detach().cpu().to(torch.float64) - r.to(torch.float64)).abs().max()))
    return {"buffers_checked": len(want), "buffers_max_abs_diff": worst, "buffers_bad": bad[:10]}


def _recompute_rotary_buffers(model) -> int:
    """After to_empty: rotary embeddings' inv_freq / original_inv_freq from the module's own rope function (what
    Transformers' _init_weights does for every `*RotaryEmbedding` module). Returns how many modules."""
    import torch

    count = 0
    for module in model.modules():
        if "RotaryEmbedding" not in type(module).__name__ or not hasattr(module, "inv_freq"):
            continue
        rope_type = getattr(module, "rope_type", "default")
        fn = getattr(module, "compute_default_rope_parameters", None) if rope_type == "default" else None
        if fn is None:
            from ...integrations.hf_models import rope_init_function

            fn = rope_init_function(rope_type)
        inv_freq, scaling = fn(module.config)
        with torch.no_grad():
            module.inv_freq.copy_(inv_freq)
            if getattr(module, "original_inv_freq", None) is not None:
                module.original_inv_freq.copy_(inv_freq)
        module.attention_scaling = scaling
        count += 1
    return count


# ====================================================================================================== systems
class Loaded:
    """One system's loaded model on one rank: stats, then (untimed) the check against the files."""

    phases: Dict[str, float]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Seconds of one part of load() (reported per rank in `phases_s`)."""
        if not hasattr(self, "phases"):
            self.phases = {}
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = time.perf_counter() - t0

    def stats(self) -> Dict[str, Any]:
        raise NotImplementedError

    def verify(self, rank: int) -> Dict[str, Any]:
        raise NotImplementedError


class HfZeroLoad(Loaded):
    def __init__(self, job: LoadJob, stage: int, device, config) -> None:
        self.job, self.stage, self.device, self.config = job, stage, device, config

    def prepare(self) -> None:
        from ... import ZeroConfig, shard_model
        from ...integrations.hf_models import auto_causal_lm
        from ...integrations.pretrained import from_pretrained

        self._fns = (auto_causal_lm(), ZeroConfig, shard_model, from_pretrained)

    def load(self) -> None:
        import torch

        auto, zero_config, shard_model, from_pretrained = self._fns
        with self.phase("from_pretrained"):
            self.model = from_pretrained(auto, self.job.folder, torch_dtype=torch.float32)
            self.model.train()
        with self.phase("shard_model"):
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.job.lr)
            self.engine = shard_model(self.model, optimizer, zero_config(stage=self.stage), device=self.device)

    def stats(self) -> Dict[str, Any]:
        mem = self.engine.memory_stats()
        plan = self.engine.plan
        import torch

        unit_numel = plan.largest_unit_numel()
        unit_bytes = max((sum(plan.groups[i].padded_numel * torch.empty((), dtype=plan.groups[i].dtype).element_size()
                              for i in u.groups) for u in plan.units), default=0)
        return {"state_bytes": int(mem["model_states"]), "param_bytes": int(mem["params"]),
                "grad_bytes": int(mem["grads"]), "optimizer_state_bytes": int(mem["optimizer_states"]),
                "shard_bytes": int(mem["params"]), "largest_unit_numel": int(unit_numel),
                "largest_unit_bytes": int(unit_bytes), "padding_numel": int(plan.padding),
                "psi": int(plan.num_trainable)}

    def verify(self, rank: int) -> Dict[str, Any]:
        full = self.engine.full_state_dict()  # collective: full fp32 weights on rank 0
        if rank != 0:
            return {}
        return {**_compare_with_files(full, self.job.folder), **_compare_buffers(self.model, self.config)}


class FSDP2Load(Loaded):
    def __init__(self, job: LoadJob, device, config) -> None:
        self.job, self.device, self.config = job, device, config

    def prepare(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from safetensors.torch import load_file

        self.mesh = init_device_mesh(self.device.type, (self.job.world_size,))
        self._fns = (StateDictOptions, set_model_state_dict, fully_shard, load_file)

    def load(self) -> None:
        import torch
        import torch.distributed as dist

        from ...engine.planning import find_unit_modules
        from ...integrations.hf_models import causal_lm_from_config

        options_cls, set_model_state_dict, fully_shard, load_file = self._fns
        with self.phase("meta_build_fully_shard_to_empty"):
            with torch.device("meta"):
                model = causal_lm_from_config(self.config)
            aliases = _aliases(model)
            for _, block in find_unit_modules(model):  # the model's _no_split_modules: its decoder layers
                fully_shard(block, mesh=self.mesh)
            fully_shard(model, mesh=self.mesh)
            model.to_empty(device=self.device)
            self.rotary_modules = _recompute_rotary_buffers(model)
        full: Dict[str, torch.Tensor] = {}
        with self.phase("rank0_read_files"):
            if dist.get_rank() == 0:
                for path in weight_files(self.job.folder):
                    full.update(load_file(path))
                for names in aliases:  # tied weights: every name of the tensor the files hold under one of them
                    held = next((full[n] for n in names if n in full), None)
                    if held is not None:
                        for n in names:
                            full.setdefault(n, held)
        with self.phase("set_model_state_dict"):
            set_model_state_dict(model, full, options=options_cls(full_state_dict=True, broadcast_from_rank0=True))
            del full
        model.train()
        self.model = model
        with self.phase("optimizer"):
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=self.job.lr)

    def stats(self) -> Dict[str, Any]:
        s = _torch_states(self.model, self.optimizer)
        return {"state_bytes": s["model_states"], "param_bytes": s["params"], "grad_bytes": s["grads"],
                "optimizer_state_bytes": s["optimizer_states"], "rotary_modules_recomputed": self.rotary_modules}

    def verify(self, rank: int) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank != 0:
            return {}
        return {**_compare_with_files(full, self.job.folder), **_compare_buffers(self.model, self.config)}


class DeepSpeedLoad(Loaded):
    def __init__(self, job: LoadJob, stage: int, ctx: WorkerContext, config) -> None:
        self.job, self.stage, self.ctx, self.config = job, stage, ctx, config

    def prepare(self) -> None:
        from .deepspeed import deepspeed_config, prepare_process, skip_shm_op_build

        ctx = self.ctx
        prepare_process(ctx)
        import deepspeed

        from ...integrations.hf_models import auto_causal_lm, deepspeed_zero3_config

        if ctx.device.type == "cpu":
            skip_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo" if ctx.device.type == "cpu" else "nccl")
        import importlib

        for name in ("deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
                     "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.partition_parameters"):
            try:  # imported now, not inside the timed initialize (lazy imports are not loading)
                importlib.import_module(name)
            except ImportError:
                pass
        self.ds_config = deepspeed_config(ctx, self.stage)
        self.version = deepspeed.__version__
        self._fns = (deepspeed, auto_causal_lm(), deepspeed_zero3_config)

    def load(self) -> None:
        import torch

        deepspeed, auto, hf_ds_config = self._fns
        # Transformers keeps a weak reference: this object must stay alive while the model is loaded
        with self.phase("from_pretrained"):
            self.hf_ds = hf_ds_config(self.ds_config) if self.stage == 3 else None
            model = auto.from_pretrained(self.job.folder, dtype=torch.float32)
            model.train()
        with self.phase("deepspeed_initialize"):
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.job.lr)
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)

    def stats(self) -> Dict[str, Any]:
        from .deepspeed import model_state_bytes

        s = model_state_bytes(self.engine)
        return {"state_bytes": s["model_states"], "param_bytes": s["params"], "grad_bytes": s["grads"],
                "master_bytes": s["master"], "optimizer_state_bytes": s["optimizer_states"],
                "peer_version": f"deepspeed {self.version}"}

    def verify(self, rank: int) -> Dict[str, Any]:
        deepspeed = self._fns[0]
        module = self.engine.module
        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):  # a no-op below stage 3
            if rank != 0:
                return {}
            named = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
        self.hf_ds = None  # Transformers' zero3 switch off again: the reference model below is a plain one
        gc.collect()
        return {**_compare_with_files(named, self.job.folder), **_compare_buffers(module, self.config)}
