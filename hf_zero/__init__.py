"""hf_zero: the Zero Redundancy Optimizer (stages 1-3 and ZeRO-R) on torch.distributed, for Hugging Face."""
from .config import ZeroConfig, ZeroConfigError
from .engine import ZeroEngine, shard_model
from .optimizer import ZeroOptimizer

__all__ = ["ZeroConfig", "ZeroConfigError", "ZeroEngine", "ZeroOptimizer", "shard_model"]
__version__ = "0.1.0"
