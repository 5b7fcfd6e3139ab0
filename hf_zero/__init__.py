"""hf_zero: the Zero Redundancy Optimizer (stages 1-3 and ZeRO-R) on torch.distributed, for Hugging Face."""
from .config import ZeroConfig, ZeroConfigError
from .engine import (ParameterNotGatheredError, PretrainedWeights, WeightsError, ZeroEngine, ZeroOptimizer,
                     parameters_on_meta, shard_model)

__all__ = ["ZeroConfig", "ZeroConfigError", "ZeroEngine", "ZeroOptimizer", "shard_model", "HfZeroAccelerator", "ZeroPlugin",
           "ZeroTrainer", "ZeroTrainingArguments", "ZeroTrainerMixin", "zero_trainer", "from_pretrained", "parameters_on_meta", "PretrainedWeights",
           "WeightsError", "ParameterNotGatheredError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The integrations import Accelerate / Transformers: load them only when asked for.
    if name in ("HfZeroAccelerator",):
        from .integrations.accelerate import HfZeroAccelerator

        return HfZeroAccelerator
    if name in ("ZeroPlugin",):
        from .integrations.plugin import ZeroPlugin

        return ZeroPlugin
    if name == "from_pretrained":
        from .integrations.pretrained import from_pretrained

        return from_pretrained
    if name in ("ZeroTrainer", "ZeroTrainingArguments", "ZeroTrainerMixin", "zero_trainer"):
        from .integrations import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
