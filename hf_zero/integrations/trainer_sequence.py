"""The Trainer under sequence parallelism (ZeroPlugin(sequence_parallel_size=sp)): what ZeroTrainerMixin needs
beyond the model's own whole-sequence loss (integrations/sequence_parallel.py).

The Trainer's loss arithmetic needs no change for the model's own loss. With N = dp x sp ranks, S_d the summed
token losses and T_d the targets of replica d's accumulated micro-batches, T = sum of T_d:
- average_tokens_across_devices on: every sp rank counts the whole batch it holds (the model cuts it later), so the
  gathered num_items_in_batch is sp x T; the model returns S_d / (sp T) and the Trainer multiplies by N, where
  DDP's would be S_d / T times dp. The two sp cancel: the logged loss (the mean over the N ranks) is sum S_d / T,
  and the gradient (sp x each rank's share, engine/sequence/loss.py, averaged over N by the engine) is its gradient.
- off: num_items_in_batch is T_d, the model returns S_d / T_d, the Trainer and the engine average over the ranks:
  the mean over d of S_d / T_d, DDP's.
Dividing num_items_in_batch by sp (as the Trainer does for DeepSpeed's sp_size) would make both sp x too big here.

A loss a subclass computes itself from the model's outputs sees this rank's chunk only: TRL's SFTTrainer sums the
per-token log-probabilities of its fused LM head (`model(..., fused_lm_head=True)`, TRL 1.x). That sum is this
rank's share (value and gradient, not sp x), so the same arithmetic leaves it sp x too small: `chunk_loss_scale`
multiplies it by sp. Objectives of whole sequences (DPO's, GRPO's log-probability sums) cannot be made from one
chunk: refused (`watch_fused_head`).

Evaluation: the losses (labels, inputs) the Trainer's evaluation loop gathers are alike on the sp ranks of a
replica, and Accelerate's gather_for_metrics, which cuts the last uneven batch to the dataset's remainder, assumes
every rank read distinct rows: HfZeroAccelerator.gather_for_metrics (which the Trainer gathers with) takes each
replica's once. Predictions are this rank's chunk of the logits: compute_metrics is refused.
"""
from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, List

from torch import nn

logger = logging.getLogger("hf_zero")

FUSED_HEAD_KWARG = "fused_lm_head"  # TRL's: the forward returns per-token log-probabilities, the caller makes the loss


def check_trainer(trainer: Any, sp: int) -> None:
    """Refuse, with the fix, what cannot be right under sequence parallelism. Raises ValueError."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and getattr(pc, "sp_size", 1) > 1:
        raise ValueError("ParallelismConfig(sp_size=...) makes the Trainer take DeepSpeed's ALST paths (its loss "
                         "reduction, its dataloader adapter) that hf_zero does not run: give the size as "
                         f"ZeroPlugin(sequence_parallel_size={pc.sp_size}) (or hf_zero.yaml's sequence_parallel_size) "
                         "and no parallelism_config in the TrainingArguments")
    why = ("receives the logits of this rank's chunk of the sequence beside the whole sequence's labels (under "
           f"sequence_parallel_size={sp} the model cuts its inputs), so it cannot compute the whole sequence's loss; "
           "the model's own loss does")
    if getattr(trainer, "compute_metrics", None) is not None:
        raise ValueError(f"compute_metrics would get this rank's chunk of the logits (under "
                         f"sequence_parallel_size={sp} the model returns the logits of its chunk of the sequence): "
                         f"leave compute_metrics unset (the evaluation loss is the whole sequence's)")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError(f"compute_loss_func {why}: leave compute_loss_func unset")
    if getattr(trainer.args, "label_smoothing_factor", 0) != 0:
        raise ValueError(f"label smoothing {why}: set label_smoothing_factor=0")


def pad_to_multiple(collator: Any, sp: int) -> Any:
    """`collator`, or a copy of it padding every batch to a multiple of `sp` (the model cuts the sequence into sp
    equal chunks): collators with a `pad_to_multiple_of` (Transformers', TRL's) label the padding -100 and mask it
    or give it its own positions, so the loss and every real token's attention are unchanged. The caller's object
    is not changed. A collator without an int or None `pad_to_multiple_of` is returned as it is (a length that does
    not divide raises at the first forward, naming the fix)."""
    have = getattr(collator, "pad_to_multiple_of", "absent")
    if have is not None and not isinstance(have, int):  # no such attribute, or one this does not read
        return collator
    want = sp if not have else have * sp // math.gcd(have, sp)
    if want == have:
        return collator
    padded = copy.copy(collator)
    padded.pad_to_multiple_of = want
    logger.info("hf_zero: sequence_parallel_size=%d: the %s pads batches to a multiple of %d (was %s)", sp,
                type(collator).__name__, want, have)
    return padded


def watch_fused_head(trainer: Any, model: nn.Module, sp: int, forwards: List[bool]) -> Callable[[], None]:
    """Append True to `forwards` for every forward of `model` that asks for TRL's fused head, until the returned
    function is called (a forward pre-hook, removed by it: the model is not changed otherwise). Such a forward of a
    trainer other than TRL's SFTTrainer raises NotImplementedError before it runs."""
    def note(module: nn.Module, args: Any, kwargs: Any) -> None:
        if not kwargs.get(FUSED_HEAD_KWARG):
            return
        if not _is_sft_trainer(trainer):
            raise NotImplementedError(
                f"{type(trainer).__name__} computes its loss from per-token log-probabilities (TRL's fused LM head), "
                f"and under sequence_parallel_size={sp} each rank holds one chunk of every sequence: an objective of "
                f"whole sequences (preference, policy-gradient) cannot be made from a chunk. hf_zero's sequence "
                f"parallelism runs the Trainer's own loss and TRL's SFTTrainer")
        forwards.append(True)

    return model.register_forward_pre_hook(note, with_kwargs=True).remove


def chunk_loss_scale(trainer: Any, sp: int, forwards: List[bool], num_items_in_batch: Any) -> int:
    """What `compute_loss`'s result is multiplied by: 1 for the model's own (whole-sequence) loss; sp for the sum
    of per-token terms TRL's SFTTrainer makes from the fused head's chunk (`forwards`: one entry per forward that
    asked for the head). Raises NotImplementedError where that sum is not divided by the whole batch's count."""
    if not forwards:
        return 1
    if num_items_in_batch is None:
        raise NotImplementedError(
            f"{type(trainer).__name__} divides by this rank's chunk's targets when the Trainer gives no "
            f"num_items_in_batch (TRL's SFTTrainer evaluates so), which is not the whole sequence's average under "
            f"sequence_parallel_size={sp}: evaluate with sequence_parallel_size=1, or train with labels in the "
            f"batches and a model whose forward takes loss keyword arguments (then the Trainer counts the targets)")
    return sp


def _is_sft_trainer(trainer: Any) -> bool:
    try:
        from trl import SFTTrainer
    except ImportError:
        return False
    return isinstance(trainer, SFTTrainer)
