"""ZeRO-R activation checkpointing: hf_zero's checkpoint function installed into any HF model's layers.

P_a partitions each checkpoint across the model-parallel group; with no such group there is nothing to
partition, which is said once in the log rather than pretended. CPU checkpointing (P_a+cpu) lands with the
offload work; until then asking for it is an error, not a silent no-op.
"""
from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger("hf_zero")


def enable_activation_checkpointing(model: nn.Module, mode: str = "on", cpu: bool = False,
                                    model_parallel_group=None) -> None:
    """Turn on the model's own activation checkpointing (non-reentrant) for mode "on" / "partitioned"."""
    if cpu:
        raise ValueError("cpu_checkpointing is not available yet in this version of hf_zero; set it false")
    if mode == "off":
        return
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(model).__name__} has no gradient_checkpointing_enable(); use a Transformers model")
    if mode == "partitioned" and model_parallel_group is None:
        logger.warning("hf_zero: activation_checkpointing='partitioned' needs a model-parallel group and there is "
                       "none (pure data parallelism): running plain activation checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
