"""The rank side of a trial, building: each system's model built and wrapped the way its users build one that does
not fit on a rank whole (systems.py says how per system), as a bench `Trainer`."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator

from hf_zero.tools.bench.base import Trainer, WorkerContext
from hf_zero.tools.bench.trainers import DDPTrainer, FSDP2Trainer, HfZeroTrainer

from .systems import SYSTEMS, apply_lora


@contextlib.contextmanager
def default_dtype(dtype) -> Iterator[None]:
    """Build modules with parameters of `dtype` (the peers' ':bf16' storage)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class DeepSpeedCapacityTrainer(Trainer):
    """DeepSpeed on a model built by `build` after its process group is up (stage 3: inside Transformers' zero.Init
    path), the bench's DeepSpeed config plus `extra` zero_optimization keys."""

    def __init__(self, ctx: WorkerContext, stage: int, extra: Dict[str, Any], build: Callable[[], Any]) -> None:
        import torch

        from hf_zero.tools.bench.deepspeed import deepspeed_config, skip_shm_op_build

        import deepspeed

        if ctx.device.type == "cpu":
            skip_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo" if ctx.device.type == "cpu" else "nccl")
        config = deepspeed_config(ctx, stage, extra)
        hf_ds = None
        if stage == 3:
            from hf_zero.integrations.hf_models import deepspeed_zero3_config

            hf_ds = deepspeed_zero3_config(config)  # alive while the model is built: Transformers uses zero.Init
        model = build()
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                                    optimizer=torch.optim.AdamW(params, lr=ctx.settings.lr))
        self._hf_ds = hf_ds  # kept alive with the engine, as Transformers' own DeepSpeed integration does
        self.model = model

    def micro_step(self, input_ids, final: bool):
        loss = self.engine(input_ids=input_ids, labels=input_ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def optimizer_step(self) -> None:
        """Done by engine.step() at the accumulation boundary (every micro-step here)."""

    def zero_grad(self) -> None:
        """DeepSpeed zeroes its own gradients in step()."""

    def state_bytes(self) -> int:
        from hf_zero.tools.bench.deepspeed import model_state_bytes

        return int(model_state_bytes(self.engine)["model_states"])


def _build_fsdp2(job: Dict[str, Any], ctx: WorkerContext, config, dtype) -> Trainer:
    """FSDP2 the torchtitan way: meta parameters (buffers computed), fully_shard, to_empty, shards initialised."""
    import torch

    from hf_zero import parameters_on_meta
    from hf_zero.integrations.hf_models import causal_lm_from_config

    with parameters_on_meta(), default_dtype(dtype):
        model = apply_lora(causal_lm_from_config(config), job["mode"], job["lora_rank"])
    trainer = FSDP2Trainer(model, ctx)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # to_empty would leave them undefined
    model.to_empty(device=ctx.device)
    gen = torch.Generator().manual_seed(int(job["seed"]) * 7919 + ctx.rank)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.dim() == 1 or "lora_B" in name:
                local.fill_(1.0 if local.dim() == 1 else 0.0)
            else:
                local.copy_(torch.randn(local.shape, generator=gen).mul_(0.02))
    trainer.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ctx.settings.lr)
    model.train()
    return trainer


def build_trainer(job: Dict[str, Any], ctx: WorkerContext) -> Trainer:
    """The trial's system (`job["system"]`) on this rank: its model built its way, in `job["mode"]`, wrapped."""
    import torch

    from hf_zero.integrations.hf_models import causal_lm_from_config, config_from_dict

    system = SYSTEMS[job["system"]]
    dtype = torch.bfloat16 if job["dtype"] == "bf16" else torch.float32
    config = config_from_dict(job["model_config"])
    config.use_cache = False
    torch.manual_seed(int(job["seed"]))
    if system.family == "hf_zero":
        from hf_zero.integrations.hf_models import auto_causal_lm
        from hf_zero.integrations.pretrained import from_pretrained

        model = from_pretrained(auto_causal_lm(), job["weights"], torch_dtype=torch.float32)  # meta: no weights yet
        model = apply_lora(model, job["mode"], job["lora_rank"])
        model.train()
        return HfZeroTrainer(model, ctx, system.stage, options=dict(system.options))
    if system.family == "fsdp2":
        return _build_fsdp2(job, ctx, config, dtype)
    if system.family == "deepspeed":
        def build():
            with default_dtype(dtype):
                m = apply_lora(causal_lm_from_config(config), job["mode"], job["lora_rank"])
            m.train()
            return m

        return DeepSpeedCapacityTrainer(ctx, system.stage, dict(system.options), build)
    with default_dtype(dtype):
        model = apply_lora(causal_lm_from_config(config), job["mode"], job["lora_rank"])
    model.train()
    return DDPTrainer(model, ctx)

