"""What the bench knows of a system and what its formulas take: `SystemSpec` (how to build the system's trainer on
one rank, and how the paper counts it), `Counts` (the model's and the run's numbers the formulas take) and `Split`
(elements or bytes per kind, intra- and inter-host). It sits below both the formulas (formulas.py: the per-host
formulas read a spec) and the registry (systems.py: SYSTEMS is made of specs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from .base import Settings, Trainer, WorkerContext


@dataclass(frozen=True)
class Counts:
    """What the formulas take from the model and the run."""

    psi: float  # trainable elements (tied weights once)
    frozen: float  # frozen elements
    resident: float  # elements hf_zero's stage 3 keeps gathered from forward to backward: the root and the last block
    world: int  # N


Split = Dict[str, Dict[str, float]]  # {"intra": {kind: elements}, "inter": {kind: elements}}


@dataclass
class SystemSpec:
    """A benchmarked system: how to build its trainer on one rank, and how the paper counts it."""

    build: Callable[[Any, "WorkerContext"], Trainer]
    state_stage: int  # model_state_bytes() stage
    recipe: Callable[[Settings], Any]  # -> hf_zero.tools.estimate.formulas.Recipe
    comm_formula: Callable[[Counts, Settings], Dict[str, float]]  # -> elements per kind and step
    hf_zero: bool = False
    note: str = ""
    # Returns None when the system can run with these settings, else why not (the row is then "skipped"): an
    # optional peer that is not installed, a hierarchical option without a usable K.
    unavailable: Optional[Callable[[Settings], Optional[str]]] = None
    jit_extensions: bool = False  # may JIT-compile torch extensions: give it a temporary TORCH_EXTENSIONS_DIR
    option: str = "none"  # hf_zero's hierarchical option ("hsdp", "hpz") over groups of --ranks-per-host ranks
    collectives: str = "auto"  # hf_zero's ZeroConfig.collectives: "chunked" / "flat" force one form
    in_all: bool = True  # part of `--systems all`
    # hf_zero's further ZeroConfig options (the ZeRO++ systems: quantized_weights / quantized_gradients); a
    # DeepSpeed system's extra zero_optimization keys (its ZeRO++ ones)
    options: Optional[Dict[str, Any]] = None
