"""ZeroTrainer: the Transformers Trainer on hf_zero; ZeroTrainerMixin / zero_trainer(cls): any Trainer subclass
(TRL's SFTTrainer, DPOTrainer, ...) on hf_zero.

    class MySFT(hf_zero.ZeroTrainerMixin, trl.SFTTrainer): ...      # or
    ZeroSFTTrainer = hf_zero.zero_trainer(trl.SFTTrainer)

The Trainer builds its Accelerator through the module-level name `transformers.trainer.Accelerator`; the
subclass runs a copy of that method whose globals give the name HfZeroAccelerator (transformers is not changed;
_transformers_private.py holds every such use of the Trainer's internals). Saving writes consolidated weights
(gathered from the shards, so never an empty stage-3 file; on the main process) plus each rank's shard in a
`zero_shards/` folder; resuming restores weights and optimizer state from the shards after sharding (the
consolidated weights are not needed, so a host that has only its shards can resume).

On disks the hosts do not share, the Trainer writes trainer_state.json and scheduler.pt on the main process only
unless `TrainingArguments(save_on_each_node=True)`; a resume checks first that every host has them.

A checkpoint runs no code on resume: the pickled files the Trainer reads (rng_state*.pth; scaler.pt and a
non-hf_zero checkpoint's weights where the stock Trainer reads them) are read by copies of its own methods whose
`torch.load` is hf_zero's `load_without_code` (a function with other globals, so neither torch nor
transformers.trainer changes), and a refusal raises on every rank, naming the file and the opt-in
`train(..., trust_pickles=True)`. trainer_state.json is JSON; training_args.bin is never read.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from transformers import Trainer, TrainingArguments

from ..checkpoint import (CheckpointError, is_checkpoint, load_checkpoint, read_manifest, resolve_checkpoint,
                          save_checkpoint, stage_checkpoint)
from ..checkpoint.foreign import looks_foreign
from ..checkpoint.hosts import all_gather_objects, describe_ranks, host_name, raise_if_any_failed, \
    require_on_every_host
from ..checkpoint.pickles import load_without_code
from ._transformers_private import TorchWithoutCode as _TorchWithoutCode  # noqa: F401  (re-exported)
from ._transformers_private import create_accelerator, reading_without_code, save_checkpoint_deferring_rotation
from ._transformers_private import with_globals as _with_globals  # noqa: F401  (re-exported)
from .accelerate import HfZeroAccelerator
from .plugin import ZeroPlugin
from .trainer_sequence import check_trainer, chunk_loss_scale, pad_to_multiple, watch_fused_head

SHARDS_DIR = "zero_shards"
SCHEDULER_NAME = "scheduler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
_TRUST_OPT_IN = "trainer.train(resume_from_checkpoint=..., trust_pickles=True)"
_MAIN_ONLY = ("The Trainer writes trainer_state.json and scheduler.pt on the main process only: on disks the hosts "
              "do not share, set TrainingArguments(save_on_each_node=True) so that every host's local main process "
              "writes them (or copy them to the other hosts)")
logger = logging.getLogger("hf_zero")


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
        sp = self._sequence_parallel_size()
        if sp > 1:  # batches the model can cut into sp equal chunks; what cannot be right is refused here
            check_trainer(self, sp)
            self.data_collator = pad_to_multiple(self.data_collator, sp)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own method, run with `Accelerator` meaning HfZeroAccelerator: a copy of it whose globals
        say so (the Trainer builds its Accelerator by that module-level name; transformers.trainer is not changed)."""
        create_accelerator(super().create_accelerator_and_postprocess,
                           functools.partial(HfZeroAccelerator, zero_plugin=self.zero_plugin))

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """A model from hf_zero.from_pretrained has its parameters on the meta device until prepare() reads its
        shards: moving it is prepare's job. Other models move as the Trainer moves them."""
        if any(p.is_meta for p in model.parameters()):
            return None
        return super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ sequence parallelism (trainer_sequence.py)
    def _sequence_parallel_size(self) -> int:
        groups = getattr(getattr(self, "accelerator", None), "sequence_groups", None)
        return groups.size if groups is not None else 1

    def compute_loss(self, model: torch.nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The Trainer's (or the subclass's) loss. Under sequence parallelism the model's own loss is right as the
        Trainer scales it; a loss TRL's SFTTrainer sums over the fused head's chunk is multiplied by sp
        (trainer_sequence.py says why)."""
        sp = self._sequence_parallel_size()
        if sp == 1:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        fused: list = []
        stop = watch_fused_head(self, model, sp, fused)
        try:
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        finally:
            stop()
        scale = chunk_loss_scale(self, sp, fused, num_items_in_batch)
        if scale == 1:
            return out
        return (out[0] * scale, out[1]) if return_outputs else out * scale

    def _track_num_input_tokens(self, inputs: Dict[str, Any]) -> None:
        """The Trainer sums the tokens of every rank's batch; the sp ranks of a replica hold the same batch, so the
        sum counts each token sp times."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // \
            self._sequence_parallel_size()

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the world size counts the sp ranks, which read one replica's batch."""
        return super().get_total_train_batch_size(args) // self._sequence_parallel_size()

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
        state_dict = self.accelerator.get_state_dict(self.model)  # collective; {} but on the main process
        if self.args.should_save and self.args.process_index == 0:  # not another host's empty dict (save_on_each_node)
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ------------------------------------------------------------------ optimizer shards
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        step = self.state.global_step if self.state is not None else None
        shards = os.path.join(output_dir, SHARDS_DIR)
        async_save = self.accelerator.zero_plugin.async_save
        saved = save_checkpoint(self.zero_engine, shards, step=step, async_save=async_save)
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        if async_save:
            saved.add_done_callback(self._warn_if_node_local)  # the manifest exists once the save is done
        else:
            self._warn_if_node_local(shards)

    # ------------------------------------------------------------------ background saves (ZeroPlugin(async_save=True))
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint; with async_save its shards are written in the background, so the rotation
        of old checkpoints (save_total_limit) waits until they are complete: deleting the previous checkpoint
        while the new one is unfinished would leave nothing to resume from after a crash."""
        self._finish_pending_save()
        save = super()._save_checkpoint
        if not self.accelerator.zero_plugin.async_save:
            return save(model, trial)

        def defer(rotate: Any) -> None:
            self._deferred_rotation = rotate

        # the rotation runs at the next checkpoint or the end of training, after this one's shards are complete
        if not save_checkpoint_deferring_rotation(save, model, trial, defer):
            save(model, trial)  # a subclass's own _save_checkpoint: rotation cannot be deferred, so wait here
            self._finish_pending_save()

    def _finish_pending_save(self) -> None:
        """Wait for checkpoint shards still being written (CheckpointError if that failed, on every rank), then
        run the rotation of old checkpoints the Trainer asked for meanwhile (only after a successful save)."""
        rotate, self._deferred_rotation = getattr(self, "_deferred_rotation", None), None
        if self.accelerator.zero_engines:
            self.zero_engine.wait_for_save()
        if rotate is not None:
            rotate()

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        self._finish_pending_save()  # push the checkpoint once its shards are there
        return super()._push_from_checkpoint(checkpoint_folder)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """The end of training waits for the last checkpoint's shards (before the Trainer loads the best model or
        deletes checkpoints)."""
        self._finish_pending_save()
        return super()._finalize_training(*args, **kwargs)

    def _warn_if_node_local(self, shards: str) -> None:
        if self.args.save_on_each_node or self.args.process_index != 0 or getattr(self, "_warned_node_local", False):
            return
        disks = read_manifest(shards).get("disks") or [None]
        if len(disks) > 1:
            self._warned_node_local = True
            logger.warning("hf_zero: %s is on %d disks the hosts do not share: every host has its ranks' shards, "
                           "but the Trainer writes trainer_state.json and scheduler.pt (and rotates checkpoints) on "
                           "the main process's host only, so resuming on the other hosts will fail. Set "
                           "TrainingArguments(save_on_each_node=True)", shards, len(disks))

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, trust_pickles: bool = False,
              **kwargs: Any) -> Any:
        """Trainer.train; a resume first checks on every rank that every host has the checkpoint's files (a
        checkpoint on node-local disks saved without save_on_each_node=True has them on one host only), so that
        a missing file raises CheckpointError everywhere instead of hanging the other ranks.

        The checkpoint runs no code: its pickled files are read with torch.load(weights_only=True), and one that
        needs more raises UntrustedPickleError (CheckpointError at world size > 1; on every rank) naming the file.
        `trust_pickles=True` unpickles them in full: only for checkpoints whose writer you trust."""
        self._trust_pickles = trust_pickles
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = self._check_resume(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _without_code(self, read: Any) -> Any:
        """The Trainer's reader `read` (bound) with no code run from the files it loads (its `torch.load` is
        `load_without_code`)."""
        return reading_without_code(read, _TRUST_OPT_IN, getattr(self, "_trust_pickles", False))

    def _read_files(self, what: str, read: Any, *args: Any) -> Any:
        """Collective: `read(*args)`; an error on any rank raises CheckpointError on every rank (the others would
        wait in their next collective)."""
        error, out = None, None
        try:
            out = read(*args)
        except Exception as exc:
            error = exc
        raise_if_any_failed(error, what, CheckpointError)
        return out

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return None
        return self._read_files(f"loading the RNG state of {checkpoint}", self._without_code(super()._load_rng_state),
                                checkpoint)

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        """hf_zero's fp16 loss scale is part of the shards (Accelerate has no GradScaler under hf_zero): a
        scaler.pt (a stock fp16 checkpoint's) is not read."""
        if checkpoint is None or self.accelerator.scaler is None:
            return None
        return self._read_files(f"loading the scaler of {checkpoint}", self._without_code(super()._load_scaler),
                                checkpoint)

    def _check_resume(self, checkpoint: Union[str, bool]) -> Union[str, bool]:
        if checkpoint is True:
            found = _last_complete_checkpoint(self.args.output_dir)
            views = all_gather_objects((host_name(), self.args.process_index,
                                        os.path.basename(found) if found else None))
            by_name: Dict[Optional[str], list] = {}
            for host, rank, name in views:
                by_name.setdefault(name, []).append((host, rank))
            if len(by_name) > 1:
                seen = "; ".join(f"{describe_ranks([r for _, r in who], [h for h, _ in who])}: {name or 'none'}"
                                 for name, who in by_name.items())
                raise CheckpointError(f"resume_from_checkpoint=True finds different last checkpoints in "
                                      f"{self.args.output_dir} on different hosts ({seen}). {_MAIN_ONLY}; or pass "
                                      f"the checkpoint's path")
            if found is None:
                return checkpoint  # the Trainer raises its own error, on every rank alike
            checkpoint = found
        files: Dict[str, str] = {
            "": "Was it saved to another path on those hosts?",
            TRAINER_STATE_NAME: _MAIN_ONLY,
            SCHEDULER_NAME: _MAIN_ONLY,
            f"{SHARDS_DIR}/manifest.json": f"Every host writes its own ranks' shards into {SHARDS_DIR}/: those "
                                          f"hosts saved elsewhere or lost their copy",
        }
        require_on_every_host(str(checkpoint), list(files), files, CheckpointError)
        return checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        """A ZeroTrainer checkpoint's shards restore every weight after sharding: its consolidated weights (on the
        main process's host only) are not read. Other checkpoints load as the Trainer loads them."""
        if is_checkpoint(resolve_checkpoint(Path(resume_from_checkpoint, SHARDS_DIR))) or \
                looks_foreign(resume_from_checkpoint):  # DeepSpeed's or FSDP2's: the weights come with the state
            return None
        return self._without_code(super()._load_from_checkpoint)(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        shards = resolve_checkpoint(Path(checkpoint, SHARDS_DIR))
        foreign = not shards.is_dir() and looks_foreign(checkpoint)
        if foreign:  # a DeepSpeed or FSDP2 Trainer checkpoint: its partitions resharded onto this engine
            shards = Path(checkpoint)
        elif not shards.is_dir():
            raise FileNotFoundError(f"{checkpoint} has no {SHARDS_DIR}/ folder: it was not written by ZeroTrainer, "
                                    f"so there is no optimizer state to resume from")
        # all or nothing: the shards are read and checked on every rank before the scheduler or the engine changes
        manifest, staged = stage_checkpoint(self.zero_engine, shards, trust=getattr(self, "_trust_pickles", False))
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None:  # an error on any rank raises on every rank (the others would wait)
            if foreign and not os.path.isfile(path) and manifest.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(manifest["lr_scheduler"])  # DeepSpeed kept the scheduler
            else:
                self._read_files(f"loading {path}", self._load_scheduler, path)
        self.zero_engine.load_shard_state(staged)

    def _load_scheduler(self, path: str) -> None:
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(load_without_code(path, _TRUST_OPT_IN,
                                                                getattr(self, "_trust_pickles", False)))

    def _load_best_model(self) -> None:
        """The best checkpoint's master weights come back from its shards (the model is sharded by now)."""
        best = self.state.best_model_checkpoint
        load_checkpoint(self.zero_engine, os.path.join(best, SHARDS_DIR))


def _last_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The newest `checkpoint-N` that a save finished: its trainer_state.json (the Trainer writes it last) and its
    shards (a previous copy that a killed save moved aside counts) are there. Newer, incomplete ones (a save that was
    killed) are skipped with a warning; they are left on disk (the Trainer's rotation removes them)."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted((int(m.group(1)), name) for name in os.listdir(output_dir)
                   for m in [re.fullmatch(r"checkpoint-(\d+)", name)] if m and os.path.isdir(Path(output_dir, name)))
    skipped = []
    for _, name in reversed(steps):
        folder = Path(output_dir, name)
        if (folder / TRAINER_STATE_NAME).is_file() and (is_checkpoint(resolve_checkpoint(folder / SHARDS_DIR))
                                                         or looks_foreign(str(folder))):
            if skipped:
                logger.warning("hf_zero: resuming from %s; skipped %s (a save that did not finish)", folder,
                               ", ".join(skipped))
            return str(folder)
        skipped.append(name)
    return None


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
