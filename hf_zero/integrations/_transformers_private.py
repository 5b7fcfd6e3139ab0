"""Transformers' private names that hf_zero uses, here and nowhere else in hf_zero (but one: the engine, which
imports no Transformers, installs its checkpoint function as each layer's `_gradient_checkpointing_func`).

ZeroTrainerMixin changes the Trainer through the methods a subclass overrides, most of them private
(`TRAINER_METHODS`: each with the parameters the Trainer calls it with). Where the Trainer offers no method or
argument to override, and only there, it runs one of the Trainer's own methods as a copy of its function whose
module-level names give one name hf_zero's object (`with_globals`: neither the function nor transformers.trainer
changes):

- `Accelerator` in `create_accelerator_and_postprocess`: the Trainer builds its accelerator by that name. Nothing
  chooses the class: `TrainingArguments.accelerator_config` and `_build_accelerator_args` (5.25; not in 5.1)
  shape only its arguments, and rewriting the method would drop what each release adds to it;
- `torch` in the readers `_load_rng_state`, `_load_scaler`, `_load_from_checkpoint`: they read a file with
  `torch.load` and apply it in the same method (the RNG states of every device kind, the scaler, the weights), so
  `torch.load` is hf_zero's `load_without_code`: a refusal names the file, and `trust_pickles=True` can unpickle;
- `rotate_checkpoints` in `_save_checkpoint`, where `save_checkpoint_deferring_rotation` can defer it: a background
  save deletes no older checkpoint before its own is complete. Transformers 5.1 called the overridable
  `_rotate_checkpoints` method instead, and has no `_finalize_training`, where the deferred rotation must be done
  at the end: there (and under a subclass's own `_save_checkpoint`, e.g. TRL's) the save is waited for instead.

ZeroTrainerMixin also makes the Trainer's `gather_function` attribute (set in `create_accelerator_and_postprocess`,
called by `evaluation_loop`) a property, so that under sequence parallelism evaluation gathers each replica's values
once (tests/test_sequence_parallel_trainer.py checks the loop still calls it).

tests/test_private_api_transformers.py checks every one of them against the installed Transformers, so a rename
upstream fails there; docs/architecture.md lists them ("Private APIs still used").
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import transformers.trainer as hf_trainer
from transformers import Trainer

from ..checkpoint.pickles import load_without_code

# Trainer methods ZeroTrainerMixin overrides or calls on super(): name -> the parameters (after self) the Trainer's
# own method has, None where the override takes *args, **kwargs
TRAINER_METHODS: Dict[str, Optional[Tuple[str, ...]]] = {
    "create_accelerator_and_postprocess": (),
    "_move_model_to_device": ("model", "device"),
    "create_scheduler": ("num_training_steps", "optimizer"),
    "save_model": ("output_dir", "_internal_call"),
    "_save": ("output_dir", "state_dict"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_save_checkpoint": ("model", "trial"),
    "_push_from_checkpoint": ("checkpoint_folder",),
    "_finalize_training": None,
    "train": None,
    "_load_rng_state": ("checkpoint",),
    "_load_scaler": ("checkpoint",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_best_model": (),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "_track_num_input_tokens": ("inputs",),
    "get_total_train_batch_size": ("args",),
}
# the Trainer's methods that read files through the module's `torch`
READERS = ("_load_rng_state", "_load_scaler", "_load_from_checkpoint")


def rotation_deferrable() -> bool:
    """Whether the Trainer's own `_save_checkpoint` rotates checkpoints through the module-level
    `rotate_checkpoints` and ends training in `_finalize_training`, where the deferred rotation is done (both in
    Transformers 5.25, neither in 5.1)."""
    return callable(vars(hf_trainer).get("rotate_checkpoints")) and hasattr(Trainer, "_finalize_training")


def create_accelerator(method: Callable[[], None], factory: Callable[..., Any]) -> None:
    """Run the Trainer's `create_accelerator_and_postprocess` (`method`, bound) with `factory(**kwargs)` built where
    it builds `Accelerator(**kwargs)`."""
    with_globals(method, Accelerator=factory)()


def reading_without_code(method: Callable[..., Any], opt_in: str, trust: bool) -> Callable[..., Any]:
    """The Trainer's reader `method` (bound; one of READERS) with `torch.load` meaning `load_without_code`."""
    return with_globals(method, torch=TorchWithoutCode(opt_in, trust))


def save_checkpoint_deferring_rotation(save: Callable[[Any, Any], None], model: Any, trial: Any,
                                       defer: Callable[[Callable[[], None]], None]) -> bool:
    """Run the Trainer's own `_save_checkpoint` (`save`, bound) with its rotation of older checkpoints handed to
    `defer` (a call that does it) instead of done; False, with nothing run, where that cannot be done: `save` is
    a subclass's own method, or the Trainer rotates otherwise (`rotation_deferrable`)."""
    if getattr(save, "__func__", None) is not Trainer._save_checkpoint or not rotation_deferrable():
        return False
    rotate = vars(hf_trainer)["rotate_checkpoints"]

    def rotate_later(*args: Any, **kwargs: Any) -> None:
        defer(functools.partial(rotate, *args, **kwargs))

    with_globals(save, rotate_checkpoints=rotate_later)(model, trial)
    return True


class TorchWithoutCode:
    """`torch` as hf_zero's copies of the Trainer's checkpoint readers see it: every attribute is torch's, but
    `load` reads one file with no code run from it (`load_without_code`), whatever its caller asked for."""

    def __init__(self, opt_in: str, trust: bool) -> None:
        self._opt_in, self._trust = opt_in, trust

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def load(self, f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
        return load_without_code(f, self._opt_in, self._trust, map_location)


def with_globals(method: Any, **names: Any) -> Any:
    """`method` (bound) as a copy of its function whose module-level `names` mean something else for this call,
    without assigning to any module: the function and its module's globals stay as they are."""
    func = method.__func__
    copy = types.FunctionType(func.__code__, {**func.__globals__, **names}, func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__  # on hf_zero's new function object; the original is untouched
    return types.MethodType(copy, method.__self__)
