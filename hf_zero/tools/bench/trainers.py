"""The systems `hf-zero bench` trains: one Trainer per system (DDP, torch's ZeroRedundancyOptimizer, FSDP2, hf_zero;
DeepSpeed lives in deepspeed.py). Each runs one rank's micro-steps and reports its model-state bytes and,
where it can be measured, its communication."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .base import Trainer, WorkerContext, local_nbytes


def _torch_state_bytes(params, optimizer) -> int:
    """Bytes of parameters, their .grad and the optimizer's state tensors held on this rank (local shards)."""
    import torch

    seen, total = set(), 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += local_nbytes(p) + local_nbytes(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and id(v) not in seen:
                seen.add(id(v))
                total += local_nbytes(v)
    return total


class _TorchTrainer(Trainer):
    def __init__(self, model, optimizer, ctx: "WorkerContext", loss_model=None) -> None:
        self.model, self.optimizer, self.ctx = model, optimizer, ctx
        self.raw = loss_model if loss_model is not None else model

    def _forward(self, input_ids):
        import torch

        if self.ctx.settings.mixed_precision == "bf16" and self.ctx.autocast:
            with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16):
                return self.model(input_ids=input_ids, labels=input_ids).loss
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        return _torch_state_bytes(self.raw.parameters(), self._local_optimizer())

    def _local_optimizer(self):
        return self.optimizer


class DDPTrainer(_TorchTrainer):
    """torch DDP; a comm hook counts 2x the numel of every all-reduced bucket, then runs the default all-reduce."""

    def __init__(self, model, ctx: "WorkerContext", optimizer_factory=None) -> None:
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        kwargs = {"device_ids": [ctx.device.index]} if ctx.device.type == "cuda" else {}
        ddp = DDP(model, **kwargs)
        self.counted = {"all_reduce": 0}

        def counting_allreduce(state, bucket):
            self.counted["all_reduce"] += 2 * bucket.buffer().numel()
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_allreduce)
        factory = optimizer_factory or (lambda params: torch.optim.AdamW(params, lr=ctx.settings.lr))
        super().__init__(ddp, factory(ddp.parameters()), ctx, loss_model=model)

    def micro_step(self, input_ids, final: bool):
        import contextlib

        m = self.ctx.settings.grad_accum
        with (contextlib.nullcontext() if final else self.model.no_sync()):
            loss = self._forward(input_ids)
            (loss / m).backward()
        return loss.detach()

    def comm_elements(self) -> Optional[Dict[str, float]]:
        return dict(self.counted)


class ZeroRedundancyTrainer(DDPTrainer):
    """DDP plus torch.distributed.optim.ZeroRedundancyOptimizer (optimizer states sharded, parameters broadcast
    after the step). Communication is not measured (the DDP hook would see only the all-reduce half)."""

    def __init__(self, model, ctx: "WorkerContext") -> None:
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer

        super().__init__(model, ctx, optimizer_factory=lambda params: ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, lr=ctx.settings.lr))

    def _local_optimizer(self):
        return self.optimizer.optim  # the rank's inner AdamW over the parameters it owns

    def comm_elements(self) -> Optional[Dict[str, float]]:
        return None


class FSDP2Trainer(_TorchTrainer):
    """torch FSDP2: fully_shard on every transformer block, then on the root."""

    def __init__(self, model, ctx: "WorkerContext") -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ...engine.planning import find_unit_modules

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                     if ctx.settings.mixed_precision == "bf16" else MixedPrecisionPolicy())
        blocks = find_unit_modules(model)  # the model's _no_split_modules (GPT2Block, LlamaDecoderLayer, ...)
        for _, block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        ctx.autocast = False  # the mixed-precision policy casts
        super().__init__(model, torch.optim.AdamW(model.parameters(), lr=ctx.settings.lr), ctx)

    def micro_step(self, input_ids, final: bool):
        m = self.ctx.settings.grad_accum
        self.model.set_requires_gradient_sync(final)
        loss = self._forward(input_ids)
        (loss / m).backward()
        return loss.detach()


# The hierarchical options as ZeroConfig spells them (K: the group size).
_OPTION_FIELDS = {"hsdp": "shard_group_size", "hpz": "hpz_partition_size"}


class HfZeroTrainer(Trainer):
    """hf_zero: shard_model(model, AdamW, ZeroConfig(stage=k)), with `option` "hsdp" / "hpz" over groups of
    `group_size` ranks, `collectives` ("auto", "flat", "chunked") and further ZeroConfig `options` (the quantized
    systems' quantized_weights / quantized_gradients); no_sync on non-final micro-batches."""

    def __init__(self, model, ctx: "WorkerContext", stage: int, option: str = "none",
                 group_size: Optional[int] = None, collectives: str = "auto",
                 options: Optional[Dict[str, Any]] = None) -> None:
        import torch

        from ... import ZeroConfig, shard_model

        self.ctx = ctx
        extra = {_OPTION_FIELDS[option]: group_size} if option != "none" else {}
        self.config = ZeroConfig(stage=stage, mixed_precision=ctx.settings.mixed_precision, collectives=collectives,
                                 **extra, **(options or {}))
        optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.settings.lr)
        self.engine = shard_model(model, optimizer, self.config, device=ctx.device)
        self.model = model

    def micro_step(self, input_ids, final: bool):
        import contextlib

        m = self.ctx.settings.grad_accum
        with (contextlib.nullcontext() if final else self.engine.no_sync()):
            loss = self.model(input_ids=input_ids, labels=input_ids).loss
            self.engine.backward(loss / m)
        return loss.detach()

    def optimizer_step(self) -> None:
        self.engine.optimizer.step()

    def state_bytes(self) -> int:
        return int(self.engine.memory_stats()["model_states"])

    def comm_elements(self) -> Optional[Dict[str, float]]:
        from ...engine.comm import DATA_KINDS

        stats = self.engine.comm_stats()
        return {k: v["elements"] for k, v in stats.items() if k in DATA_KINDS}  # not "control", not "total"

    def comm_split(self) -> Optional[Dict[str, Dict[str, float]]]:
        from ...engine.comm import DATA_KINDS

        stats = self.engine.comm_stats()
        return {where: {k: v[f"{where}_elements"] for k, v in stats.items() if k in DATA_KINDS}
                for where in ("intra", "inter")}

    def comm_bytes_split(self) -> Optional[Dict[str, Dict[str, float]]]:
        """Bytes on the wire per kind, intra/inter: the ledger per strategy (a quantizing strategy books its codes
        and scales, the others their elements' bytes), summed over the strategies."""
        from ...engine.comm import DATA_KINDS

        out: Dict[str, Dict[str, float]] = {"intra": {}, "inter": {}}
        for kinds in self.engine.comm_stats_by_strategy().values():
            for kind, v in kinds.items():
                if kind in DATA_KINDS:
                    for where in out:
                        out[where][kind] = out[where].get(kind, 0) + v[f"{where}_bytes"]
        return out

    def row_extras(self) -> Dict[str, Any]:
        topo = self.engine.topology
        # The engine's own view of its groups: shows the option really ran (K = 1 or N would be the plain stage).
        return {"engine_topology": {"option": topo.option, "group_size": topo.group_size,
                                    "num_hosts": topo.num_hosts},
                "hpz_secondary_peak_bytes": int(self.engine.memory_stats()["hpz_secondary_peak"]),
                "collectives": sorted(self.engine.collectives),
                "strategies_booked": sorted(self.engine.comm_stats_by_strategy())}
