"""The engine: ZeRO itself, on torch only (no Accelerate, no Transformers).

planning -> buffers, comm -> reducer, gatherer -> optimizer (the step) -> engine (shard_model); activations is
ZeRO-R's checkpoint function beside them. See docs/architecture.md for the path of a gradient and of a stage-3
parameter through these files.
"""
from .activations import checkpoint_function, enable_activation_checkpointing, zero_checkpoint
from .comm import CollectiveMismatchError, Comm
from .engine import ZeroEngine, shard_model
from .optimizer import ZeroOptimizer, check_elementwise
from .partitioned import ParameterNotGatheredError, PartitionedParameter
from .planning import ShardPlan, find_unit_modules, plan_model
from .scaler import LossScaler
from .weights import PretrainedWeights, WeightSource, WeightsError, parameters_on_meta

__all__ = ["CollectiveMismatchError", "Comm", "LossScaler", "ParameterNotGatheredError", "PartitionedParameter",
           "PretrainedWeights", "ShardPlan", "WeightSource", "WeightsError", "ZeroEngine", "ZeroOptimizer",
           "check_elementwise", "checkpoint_function", "enable_activation_checkpointing", "find_unit_modules",
           "parameters_on_meta", "plan_model", "shard_model", "zero_checkpoint"]
