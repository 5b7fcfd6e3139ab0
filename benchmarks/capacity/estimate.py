"""The estimator's prediction for a cell: model-state bytes per rank at any layer count (the paper's formulas for
the peers, hf_zero's own plan for hf_zero), exactly linear in the layer count, and the largest layer count whose
model states fit a budget. Everything is computed on the meta device: no weights are made."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from .systems import SYSTEMS, apply_lora, parse_system
from .weights import hf_config, model_config


def _param_counts(shape: Dict[str, int], mode: str, lora_rank: int, layers: int) -> Tuple[int, int]:
    """(trainable, frozen) elements of the model at `layers` layers (built on the meta device)."""
    from hf_zero.integrations.hf_models import meta_model

    model = meta_model(hf_config(model_config(shape, layers)))
    model = apply_lora(model, mode, lora_rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen


@dataclass(frozen=True)
class Linear:
    """a + b * layers (parameter counts and model-state bytes are exactly linear in the layer count)."""

    a: float
    b: float

    def __call__(self, layers: int) -> float:
        return self.a + self.b * layers

    @classmethod
    def through(cls, f: Callable[[int], float]) -> "Linear":
        y1, y2 = f(1), f(2)
        return cls(2 * y1 - y2, y2 - y1)


class Estimator:
    """The estimator's model-state bytes per rank for a system at any layer count: the paper's formulas
    (`hf_zero.tools.estimate.formulas.model_state_bytes`) for the peers, hf_zero's plan (`estimate_plan`, plan mode:
    padding, the accumulation dtype, Adam's step, int8 codes + scales of quantized frozen shards) for hf_zero."""

    def __init__(self, shape: Dict[str, int], lora_rank: int) -> None:
        self.shape, self.lora_rank = shape, lora_rank
        self._counts: Dict[str, Tuple[Linear, Linear]] = {}
        self._bytes: Dict[Tuple[str, str, int], Linear] = {}

    def counts(self, mode: str) -> Tuple[Linear, Linear]:
        """(trainable, frozen) elements as functions of the layer count."""
        if mode not in self._counts:
            at = {n: _param_counts(self.shape, mode, self.lora_rank, n) for n in (1, 2)}
            self._counts[mode] = (Linear.through(lambda n: at[n][0]), Linear.through(lambda n: at[n][1]))
        return self._counts[mode]

    def params(self, mode: str, layers: int) -> int:
        trainable, frozen = self.counts(mode)
        return int(trainable(layers) + frozen(layers))

    def state_bytes(self, name: str, mode: str, world: int, layers: int) -> float:
        key = (name, mode, world)
        if key not in self._bytes:
            self._bytes[key] = Linear.through(lambda n: self._exact(name, mode, world, n))
        return self._bytes[key](layers)

    def _exact(self, name: str, mode: str, world: int, layers: int) -> float:
        from hf_zero.tools.estimate.formulas import Recipe, model_state_bytes, recipe

        system_name, dtype = parse_system(name)
        system = SYSTEMS[system_name]
        if system.family == "hf_zero":
            from hf_zero import ZeroConfig
            from hf_zero.integrations.hf_models import meta_model
            from hf_zero.tools.estimate.plan import estimate_plan

            model = apply_lora(meta_model(hf_config(model_config(self.shape, layers))), mode, self.lora_rank)
            return float(estimate_plan(model, world, ZeroConfig(stage=system.stage, **dict(system.options)))
                         ["model_states"])
        trainable, frozen = self.counts(mode)
        if dtype == "bf16":
            r = recipe("bf16") if system.family == "deepspeed" else Recipe(param=2, grad=2, master=0, optim=4)
        else:
            r = recipe("no")  # fp32 parameters, gradients and AdamW states; the parameters are the master
        return model_state_bytes(trainable(layers), world, system.stage, r, frozen(layers))

    def largest(self, name: str, mode: str, world: int, budget: float, limit: int = 1 << 20) -> int:
        """The largest layer count whose model states fit in `budget` bytes per rank (0: not even one layer)."""
        f = Linear.through(lambda n: self.state_bytes(name, mode, world, n))
        if f(1) > budget:
            return 0
        if f.b <= 0:
            return limit
        return int(min(limit, math.floor((budget - f.a) / f.b)))

