"""Accelerate's private names that hf_zero uses, here and nowhere else in hf_zero.

HfZeroAccelerator is an Accelerator, and Accelerate has no public way for a subclass to do three things it needs:

- see and change what is registered for checkpoints. `prepare` and `register_for_checkpointing` fill the
  Accelerator's lists `_models`, `_optimizers`, `_schedulers`, `_dataloaders`, `_custom_objects`, and
  `register_load_state_pre_hook` its dict `_load_model_state_pre_hook`; save_state / load_state read them. hf_zero
  registers the sharded model there itself (its `prepare_model` returns the model with no wrapper), hides the model
  and optimizer from Accelerate's part of save_state / load_state (the shards hold them), and snapshots the rest
  so that a failed load_state puts it back;
- tell what Accelerate already prepared: it marks those objects `_is_accelerate_prepared`;
- load the registered states from files it reads itself first (so that none runs code): Accelerate's loader
  `accelerate.checkpointing.load_accelerator_state` (in no `__all__`) takes them positionally, and the names of the
  files in a save_state folder (`scheduler_1.bin`, `custom_checkpoint_0.pkl`, `random_states_3.pkl`, ...) are
  Accelerate's conventions, written out in its code only.

tests/test_private_api_accelerate.py checks each of these against the installed Accelerate (what `prepare`,
`register_for_checkpointing`, `register_load_state_pre_hook` and `save_state` do with them), so a rename upstream
fails there, naming the name; docs/architecture.md lists them ("Private APIs still used").
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Dict, Iterator, List, Optional

# the Accelerator's registries: attribute -> what puts objects there (the contract test checks each)
REGISTRIES: Dict[str, str] = {
    "_models": "prepare(model)",
    "_optimizers": "prepare(optimizer)",
    "_schedulers": "prepare(scheduler)",
    "_dataloaders": "prepare(data_loader)",
    "_custom_objects": "register_for_checkpointing(obj)",
}
LOAD_STATE_PRE_HOOKS = "_load_model_state_pre_hook"  # {handle id: hook(models, input_dir)}
PREPARED_MARK = "_is_accelerate_prepared"
LOAD_ACCELERATOR_STATE_PARAMETERS = ("input_dir", "models", "optimizers", "schedulers", "dataloaders",
                                     "process_index", "scaler", "map_location", "load_kwargs")
CUSTOM_STATE_FILE = re.compile(r"^custom_checkpoint_\d+\.pkl$")  # load_state counts them with this pattern


class Registered:
    """What `accelerator` holds for save_state / load_state, read from (and written to) Accelerate's private
    registries. The lists are Accelerate's own, live."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    @property
    def models(self) -> List[Any]:
        return self._accelerator._models

    @property
    def optimizers(self) -> List[Any]:
        return self._accelerator._optimizers

    @property
    def schedulers(self) -> List[Any]:
        return self._accelerator._schedulers

    @property
    def dataloaders(self) -> List[Any]:
        return self._accelerator._dataloaders

    @property
    def custom_objects(self) -> List[Any]:
        return self._accelerator._custom_objects

    @property
    def load_state_pre_hooks(self) -> List[Callable[[List[Any], str], None]]:
        return list(getattr(self._accelerator, LOAD_STATE_PRE_HOOKS).values())

    def add_model(self, model: Any) -> None:
        """Register `model` as `prepare` registers the models it wraps (once)."""
        if model not in self._accelerator._models:
            self._accelerator._models.append(model)

    @contextlib.contextmanager
    def hidden(self, models: bool = False, optimizers: bool = False, schedulers: bool = False) -> Iterator[None]:
        """Inside, Accelerate's own save_state / load_state see none of the named kinds registered; afterwards the
        registries are the lists they were."""
        acc = self._accelerator
        saved = acc._models, acc._optimizers, acc._schedulers
        acc._models = [] if models else acc._models
        acc._optimizers = [] if optimizers else acc._optimizers
        acc._schedulers = [] if schedulers else acc._schedulers
        try:
            yield
        finally:
            acc._models, acc._optimizers, acc._schedulers = saved


def is_prepared(obj: Any) -> bool:
    """Whether Accelerate's `prepare` already prepared `obj` (its own mark)."""
    return bool(getattr(obj, PREPARED_MARK, False))


def load_accelerator_state(input_dir: str, models: List[Any], optimizers: List[Any], schedulers: List[Any],
                           dataloaders: List[Any], process_index: int, scaler: Any, map_location: Any,
                           load_kwargs: Optional[dict], **load_model_func_kwargs: Any) -> Dict[str, Any]:
    """Accelerate's loader of models, optimizers, schedulers, data-loader states, scaler and RNG states from a
    save_state folder; returns the Accelerator attributes to override (`step`)."""
    from accelerate.checkpointing import load_accelerator_state as load

    return load(input_dir, models, optimizers, schedulers, dataloaders, process_index, scaler, map_location,
                load_kwargs, **load_model_func_kwargs)


# ---------------------------------------------------------------------------------- save_state's file names
def numbered(stem: str, i: int, ext: str = ".bin") -> str:
    """Accelerate's file of the i-th registered object: `scheduler.bin`, `scheduler_1.bin`, ..."""
    return f"{stem}{ext}" if i == 0 else f"{stem}_{i}{ext}"


def custom_state_file(i: int) -> str:
    """The file of the i-th object given to register_for_checkpointing."""
    return f"custom_checkpoint_{i}.pkl"


def rng_state_file(process_index: int) -> str:
    """The RNG states (and the step) of one process."""
    from accelerate.utils import RNG_STATE_NAME

    return f"{RNG_STATE_NAME}_{process_index}.pkl"


def saves_sampler(loader: Any) -> bool:
    """Whether save_state writes (and load_state reads) `sampler*.bin` for this data loader: a seedable sampler
    under an iterable-dataset shard."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    try:
        return isinstance(loader.dataset, IterableDatasetShard) and \
            isinstance(loader.get_sampler(), SeedableRandomSampler)
    except AttributeError:
        return False


def saves_loader_state(loader: Any) -> bool:
    """Whether save_state writes (and load_state reads) `dl_state_dict*.bin` for this data loader."""
    return bool(getattr(loader, "use_stateful_dataloader", False))


def loader_state_file(i: int) -> str:
    return numbered("dl_state_dict", i)
