"""HfZeroAccelerator.load_state's flow: a save_state folder (hf_zero's, or DeepSpeed's / FSDP2's) restored all or
nothing, with no code run from its files.

The shards are read and checked on every rank first (`stage_checkpoint`); then Accelerate's part (schedulers, RNG,
samplers, data-loader states, custom objects) runs, and is undone if it failed on any rank; only then does the
engine take the staged shards. Accelerate's part follows Accelerate's own `load_state` for the distributed types
hf_zero runs (`load_accelerate_part`), reading the files Accelerate would unpickle in full through
`load_without_code` first. What it needs of Accelerate's private names comes from `_accelerate_private`.
"""
from __future__ import annotations

import copy
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from accelerate.utils import DistributedType

from ..checkpoint import CheckpointError, resolve_checkpoint, stage_checkpoint
from ..checkpoint.foreign import looks_foreign
from ..checkpoint.hosts import raise_if_any_failed, require_on_every_host
from ..checkpoint.pickles import UntrustedPickleError, load_without_code, untrusted_error
from ._accelerate_private import (CUSTOM_STATE_FILE, Registered, custom_state_file, load_accelerator_state,
                                  loader_state_file, numbered, rng_state_file, saves_loader_state, saves_sampler)

logger = logging.getLogger("hf_zero")

OPT_IN = "load_state(..., trust_pickles=True)"
_MAIN_ONLY = ("Accelerate's save_state writes the scheduler, sampler and custom states on the main process only: on "
              "disks the hosts do not share, build the accelerator with "
              "project_config=ProjectConfiguration(save_on_each_node=True) so that every host's local main process "
              "writes them (or copy the file to the other hosts)")


def load_state(accelerator: Any, input_dir: Optional[str], load_kwargs: Optional[dict], trust: bool,
               **load_model_func_kwargs: Any) -> None:
    """Collective once a model is sharded: `accelerator.load_state` (see its docstring) with `trust` the opt-in to
    full unpickling. Before `prepare`, Accelerate's part alone (the models and optimizers included)."""
    if not accelerator.zero_engines:
        return load_accelerate_part(accelerator, input_dir, load_kwargs, trust, **load_model_func_kwargs)
    if input_dir is None:
        raise ValueError("HfZeroAccelerator.load_state needs input_dir: the folder save_state returned")
    folder = os.path.expanduser(str(input_dir))
    if not os.path.isdir(os.path.join(folder, "zero_shards")) and looks_foreign(folder):
        return _load_foreign(accelerator, folder, load_kwargs, trust, **load_model_func_kwargs)
    files = _files_every_host_needs(Registered(accelerator))
    require_on_every_host(folder, list(files), files, CheckpointError)
    shards = resolve_checkpoint(Path(folder, "zero_shards"))  # a save killed mid-rename left the previous aside
    if not shards.is_dir():
        raise FileNotFoundError(f"{input_dir} has no zero_shards/ folder: it was not written by "
                                f"HfZeroAccelerator.save_state, so it holds no optimizer shards")
    _, staged = stage_checkpoint(accelerator.zero_engine, shards)

    def rest() -> None:
        with Registered(accelerator).hidden(models=True, optimizers=True):
            load_accelerate_part(accelerator, input_dir, load_kwargs, trust, **load_model_func_kwargs)

    _all_or_nothing(accelerator, staged, rest, f"load_state({input_dir})")


def _all_or_nothing(accelerator: Any, staged: Any, rest: Callable[[], None], what: str) -> None:
    """Collective. Run `rest()` (Accelerate's part: schedulers, RNG, samplers, custom objects), undo it if it
    failed on any rank (raised on every rank, not left to hang the others in the next collective), and only
    then give the engine the `staged` shards."""
    registered = Registered(accelerator)
    before = _snapshot(registered)
    error = None
    try:
        rest()
    except Exception as exc:
        error = exc
    try:
        raise_if_any_failed(error, what, CheckpointError)
    except CheckpointError:
        _restore(registered, before)
        raise
    accelerator.zero_engine.load_shard_state(staged)


def _load_foreign(accelerator: Any, folder: str, load_kwargs: Optional[dict], trust: bool,
                  **load_model_func_kwargs: Any) -> None:
    """load_state of a folder DeepSpeed or FSDP2 wrote through Accelerate (or the Trainer): weights, fp32
    master and Adam state resharded onto this run's engine (`stage_checkpoint` reads them with no code run),
    the LR scheduler from the folder's own record (DeepSpeed keeps it in its model states), and Accelerate's
    RNG, sampler and custom states where the folder has them. All or nothing, as for hf_zero's own folders."""
    from accelerate.utils import SCHEDULER_NAME

    manifest, staged = stage_checkpoint(accelerator.zero_engine, folder, trust=trust)  # the source's description
    registered = Registered(accelerator)

    def rest() -> None:
        # Accelerate writes scheduler.bin beside a DeepSpeed checkpoint unless DeepSpeed was handed the
        # scheduler, which then lives in DeepSpeed's model states
        accelerate_wrote = os.path.isfile(os.path.join(folder, f"{SCHEDULER_NAME}.bin"))
        with registered.hidden(models=True, optimizers=True, schedulers=not accelerate_wrote):
            load_accelerate_part(accelerator, folder, load_kwargs, trust, **load_model_func_kwargs)
        scheduler_state = manifest.get("lr_scheduler")
        if scheduler_state is not None and registered.schedulers and not accelerate_wrote:
            registered.schedulers[0].load_state_dict(scheduler_state)
        if manifest.get("step") is not None and not os.path.isfile(os.path.join(folder, rng_state_file(0))):
            accelerator.step = int(manifest["step"]) * max(1, accelerator.gradient_accumulation_steps)

    _all_or_nothing(accelerator, staged, rest, f"load_state({folder})")


def _snapshot(registered: Registered) -> Dict[str, Any]:
    """What Accelerate's load_state changes besides models and optimizers, copied so a failed load can put it
    back: scheduler and custom-object states, data-loader samplers and states, the RNG states."""
    import random

    import numpy as np

    def copied(obj: Any) -> Any:
        return copy.deepcopy(obj.state_dict()) if hasattr(obj, "state_dict") else None

    return {
        "schedulers": [copied(s) for s in registered.schedulers],
        "custom": [copied(o) for o in registered.custom_objects],
        "samplers": [d.get_sampler() if hasattr(d, "get_sampler") else None for d in registered.dataloaders],
        "loaders": [copied(d) if saves_loader_state(d) else None for d in registered.dataloaders],
        "rng": (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None),
    }


def _restore(registered: Registered, saved: Dict[str, Any]) -> None:
    import random

    import numpy as np

    for obj, state in [*zip(registered.schedulers, saved["schedulers"]),
                       *zip(registered.custom_objects, saved["custom"]),
                       *zip(registered.dataloaders, saved["loaders"])]:
        if state is not None:
            obj.load_state_dict(state)
    for loader, sampler in zip(registered.dataloaders, saved["samplers"]):
        if sampler is not None and hasattr(loader, "set_sampler"):
            loader.set_sampler(sampler)
    py, np_state, cpu, cuda = saved["rng"]
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _files_every_host_needs(registered: Registered) -> Dict[str, str]:
    """What load_state reads besides the shards (as Accelerate's load_accelerator_state does), each with the
    setting that writes it on every host."""
    from accelerate.utils import SAMPLER_NAME, SCHEDULER_NAME

    files = {"": "Was the state saved to another path on those hosts?",
             "zero_shards/manifest.json": "Every host writes its own ranks' shards into zero_shards/: those "
                                          "hosts saved elsewhere or lost their copy"}
    for i in range(len(registered.schedulers)):
        files[numbered(SCHEDULER_NAME, i)] = _MAIN_ONLY
    for i, loader in enumerate(registered.dataloaders):
        if saves_sampler(loader):
            files[numbered(SAMPLER_NAME, i)] = _MAIN_ONLY
    for i in range(len(registered.custom_objects)):
        files[custom_state_file(i)] = _MAIN_ONLY
    return files


# ------------------------------------------------------------------------------ Accelerate's own load_state
def load_accelerate_part(accelerator: Any, input_dir: Optional[str], load_kwargs: Optional[dict], trust: bool,
                         **load_model_func_kwargs: Any) -> None:
    """Accelerate's load_state for the distributed types hf_zero runs (models, optimizers, schedulers, data
    loaders, scaler and RNG through Accelerate's `load_accelerator_state`; then the registered custom objects),
    with no code run from the files and no other library's function replaced:

    - the optimizer, scheduler and data-loader states get `weights_only` through `load_kwargs` (True unless
      trusted); Accelerate reads the sampler, scaler, `.bin` weights and RNG files with weights_only=True;
    - the custom states, which Accelerate's `load_custom_state` always unpickles in full, are read here
      (`load_without_code`), before anything changes, and applied last as Accelerate does;
    - this rank's RNG file is read here first too: Accelerate goes on without the RNG state when reading it
      fails, so its refusal would pass unnoticed.
    A weights-only refusal inside Accelerate's part raises UntrustedPickleError naming the file."""
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP,
                                        DistributedType.MEGATRON_LM):
        raise RuntimeError(f"distributed_type {accelerator.distributed_type}: hf_zero's load_state does not load it")
    registered = Registered(accelerator)
    folder = _state_folder(accelerator, input_dir)
    logger.info("hf_zero: loading states from %s", folder)
    found = [f for f in os.listdir(folder) if CUSTOM_STATE_FILE.search(f) is not None]
    if len(found) != len(registered.custom_objects):
        raise RuntimeError(
            f"Number of custom checkpoints in folder {folder} does not match the number of registered objects: "
            f"found {len(found)} checkpoints, {len(registered.custom_objects)} registered objects. Load only "
            f"folders saved with the same registered objects, or keep `custom_checkpoint` out of other files' names")
    custom = [load_without_code(os.path.join(folder, custom_state_file(i)), OPT_IN, trust, "cpu")
              for i in range(len(registered.custom_objects))]
    rng = os.path.join(folder, rng_state_file(accelerator.process_index))
    if not trust and os.path.isfile(rng):
        load_without_code(rng, OPT_IN)
    models, optimizers = list(registered.models), list(registered.optimizers)
    for hook in registered.load_state_pre_hooks:
        hook(models, folder)
    map_location = load_model_func_kwargs.pop("map_location", None)
    if map_location is None:
        map_location = ("on_device" if accelerator.num_processes > 1 and accelerator.multi_device
                        and accelerator.distributed_type != DistributedType.MULTI_XPU else "cpu")
    try:
        overrides = load_accelerator_state(
            folder, models, optimizers, list(registered.schedulers), list(registered.dataloaders),
            accelerator.process_index, accelerator.scaler, map_location,
            {**(load_kwargs or {}), "weights_only": not trust}, **load_model_func_kwargs)
    except pickle.UnpicklingError as exc:
        if trust:
            raise
        raise _refused_file(folder, registered, models, optimizers, accelerator.scaler, exc) from None
    if "step" in overrides:
        accelerator.step = overrides["step"]
    for obj, state in zip(registered.custom_objects, custom):
        obj.load_state_dict(state)


def _state_folder(accelerator: Any, input_dir: Optional[str]) -> str:
    """The folder Accelerate's load_state reads: `input_dir`, else the newest automatically named one."""
    if input_dir is not None:
        folder = os.path.expanduser(str(input_dir))
        if not os.path.isdir(folder):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return folder
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    base = os.path.join(accelerator.project_dir, "checkpoints")
    folders = [os.path.join(base, f) for f in os.listdir(base)]
    folders.sort(key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))
    return folders[-1]


def _refused_file(folder: str, registered: Registered, models: List[Any], optimizers: List[Any], scaler: Any,
                  exc: BaseException) -> UntrustedPickleError:
    """Which file Accelerate's weights-only read refused (torch's error does not say): the first of the files
    `load_accelerator_state` reads, in its order, that `load_without_code` refuses too."""
    from accelerate.utils import MODEL_NAME, OPTIMIZER_NAME, SAFE_MODEL_NAME, SAMPLER_NAME, SCALER_NAME, \
        SCHEDULER_NAME

    names = [numbered(MODEL_NAME, i) for i in range(len(models))
             if not os.path.exists(os.path.join(folder, numbered(SAFE_MODEL_NAME, i, ".safetensors")))]
    names += [numbered(OPTIMIZER_NAME, i) for i in range(len(optimizers))]
    names += [numbered(SCHEDULER_NAME, i) for i in range(len(registered.schedulers))]
    for i, loader in enumerate(registered.dataloaders):
        if saves_sampler(loader):
            names.append(numbered(SAMPLER_NAME, i))
        if saves_loader_state(loader):
            names.append(loader_state_file(i))
    names += [SCALER_NAME] if scaler is not None else []
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                load_without_code(path, OPT_IN)
            except UntrustedPickleError as refused:
                return refused
    return untrusted_error(folder, exc, OPT_IN)
