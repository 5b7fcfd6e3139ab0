"""Labels on the engine's phases for torch.profiler: what a step spent in gathering, reducing, stepping, releasing.

`phase("reduce")` is a `torch.profiler.record_function("hf_zero.reduce")` while a profiler runs and a shared no-op
otherwise: a record_function costs about 8 us even with no profiler, which on the per-group paths of a small model
is a measurable part of a step, so the check comes first. The labels (each is one range in a trace):

- `hf_zero.gather` (stage 3: a unit's all-gathers issued), `hf_zero.gather.wait` (waited for),
  `hf_zero.release` (a unit's full parameters freed);
- `hf_zero.reduce` (a group's gradients launched: all-reduce / reduce-scatter), `hf_zero.reduce.wait` (the end of
  a backward waiting for its reductions);
- `hf_zero.step` (the whole optimizer step), inside it `hf_zero.step.prepare` (finalise, average, unscale),
  `hf_zero.step.update` (the user's optimizer over the shards), `hf_zero.step.all_gather` (stages 1/2: the updated
  parameters gathered); `hf_zero.clip` (clip_grad_norm_).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.autograd import profiler

_IDLE = contextlib.nullcontext()


def phase(name: str) -> ContextManager[None]:
    """A profiler range named `hf_zero.<name>` while torch.profiler (or autograd's profiler) is on; else a no-op."""
    if profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"hf_zero.{name}")
    return _IDLE
