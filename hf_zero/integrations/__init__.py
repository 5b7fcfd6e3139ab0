"""Integrations with Hugging Face Accelerate and Transformers (they depend on the engine, never the reverse)."""

import os as _os

import torch as _torch

# A distributed launch on a machine without a GPU (torchrun, or `accelerate launch` from a config file, which does
# not pass `use_cpu` to the ranks) must build a gloo world everywhere Accelerate state is created first:
# TrainingArguments, PartialState, a plain Accelerator. Accelerate reads this variable for that.
if int(_os.environ.get("WORLD_SIZE", "1")) > 1 and not _torch.cuda.is_available():
    _os.environ.setdefault("ACCELERATE_USE_CPU", "1")
