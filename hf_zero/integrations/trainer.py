"""ZeroTrainer: the Transformers Trainer on hf_zero; ZeroTrainerMixin / zero_trainer(cls): any Trainer subclass
(TRL's SFTTrainer, DPOTrainer, ...) on hf_zero.

    class MySFT(hf_zero.ZeroTrainerMixin, trl.SFTTrainer): ...      # or
    ZeroSFTTrainer = hf_zero.zero_trainer(trl.SFTTrainer)

The Trainer builds its Accelerator through the module-level name `transformers.trainer.Accelerator`; the
subclass swaps that name for HfZeroAccelerator while the Trainer creates it. Saving writes consolidated
weights (gathered from the shards, so never an empty stage-3 file) plus each rank's optimizer shard in a
`zero_shards/` folder; resuming loads the consolidated weights before sharding (the Trainer's own path) and the
shards after it.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

import torch
import transformers.trainer as hf_trainer
from transformers import Trainer, TrainingArguments

from ..checkpoint import load_checkpoint, save_checkpoint
from .accelerate import HfZeroAccelerator
from .plugin import ZeroPlugin

SHARDS_DIR = "zero_shards"
SCHEDULER_NAME = "scheduler.pt"


class ZeroTrainingArguments(TrainingArguments):
    """TrainingArguments; the ZeRO settings come from `ZeroTrainer(zero_plugin=...)` or hf_zero.yaml."""


class ZeroTrainerMixin:
    """Put it first in the bases of any `transformers.Trainer` subclass: the model and optimizer are sharded with
    ZeRO (stage, offload, buckets from `zero_plugin=` or hf_zero.yaml), and saving, resuming and pushing go
    through the shards. Every stock TrainingArguments option keeps its meaning (gradient_accumulation_steps,
    max_grad_norm, bf16, logging/eval/save steps, save_total_limit, resume_from_checkpoint, push_to_hub).
    """

    def __init__(self, *args: Any, zero_plugin: Optional[ZeroPlugin] = None, **kwargs: Any) -> None:
        self.zero_plugin = zero_plugin
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        original = hf_trainer.Accelerator
        hf_trainer.Accelerator = functools.partial(HfZeroAccelerator, zero_plugin=self.zero_plugin)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = original

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """A model from hf_zero.from_pretrained has its parameters on the meta device until prepare() reads its
        shards: moving it is prepare's job. Other models move as the Trainer moves them."""
        if any(p.is_meta for p in model.parameters()):
            return None
        return super()._move_model_to_device(model, device)

    @property
    def zero_engine(self):
        """The engine behind the sharded model (after training started)."""
        return self.accelerator.zero_engine

    # ------------------------------------------------------------------ weights
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Consolidated weights that from_pretrained loads, gathered from the shards on every rank."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.accelerator.zero_engines:  # not prepared yet (e.g. save before train): plain weights
            return super().save_model(output_dir, _internal_call=_internal_call)
        state_dict = self.accelerator.get_state_dict(self.model)  # collective
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ------------------------------------------------------------------ optimizer shards
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        step = self.state.global_step if self.state is not None else None
        save_checkpoint(self.zero_engine, os.path.join(output_dir, SHARDS_DIR), step=step)
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        shards = os.path.join(checkpoint, SHARDS_DIR)
        if not os.path.isdir(shards):
            raise FileNotFoundError(f"{checkpoint} has no {SHARDS_DIR}/ folder: it was not written by ZeroTrainer, "
                                    f"so there is no optimizer state to resume from")
        load_checkpoint(self.zero_engine, shards)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self) -> None:
        """The best checkpoint's master weights come back from its shards (the model is sharded by now)."""
        best = self.state.best_model_checkpoint
        load_checkpoint(self.zero_engine, os.path.join(best, SHARDS_DIR))


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """The Transformers Trainer on hf_zero (ZeroTrainerMixin over Trainer)."""


@functools.lru_cache(maxsize=None)
def zero_trainer(trainer_class: type) -> type:
    """`trainer_class` (a Trainer subclass, e.g. trl.SFTTrainer) on hf_zero: a subclass with ZeroTrainerMixin first,
    named "Zero" + its name; the same class for the same argument."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"zero_trainer() takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ZeroTrainerMixin):
        return trainer_class
    return type(f"Zero{trainer_class.__name__}", (ZeroTrainerMixin, trainer_class),
                {"__module__": __name__, "__doc__": f"{trainer_class.__name__} on hf_zero."})
