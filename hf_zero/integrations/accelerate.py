"""HfZeroAccelerator: Accelerate's Accelerator with model and optimizer preparation replaced by ZeRO sharding.

A training script changes one import (`from hf_zero import HfZeroAccelerator as Accelerator`) and nothing else:
`prepare` shards the model in place (no wrapper: `unwrap_model` and `save_pretrained` keep seeing the HF model)
and returns the ZeRO optimizer; `backward`, `no_sync`/`accumulate`, `clip_grad_norm_`, `get_state_dict`,
`save_model` and `free_memory` go through the engine. Mixed precision is the engine's (bf16/fp16 compute copies
with fp32 master weights), so Accelerate itself runs with mixed_precision="no" (no autocast, no GradScaler).

A checkpoint folder runs no code: `load_without_code` (checkpoint/pickles.py) reads one pickled file with
torch.load(weights_only=True) (numpy's RNG data types allowed), and `load_state` here reads the custom and RNG states through it and passes
`weights_only` to Accelerate's own reads (RNG, scheduler, sampler, data-loader states), replacing no function of
torch's or Accelerate's. ZeroTrainer's resume runs the Trainer's readers with `load_without_code` as their
`torch.load` (integrations/trainer.py).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from ..checkpoint import (CheckpointError, export_pretrained, push_to_hub, read_manifest, resolve_checkpoint,
                          save_checkpoint, stage_checkpoint)
from ..checkpoint.foreign import looks_foreign
from ..checkpoint.hosts import raise_if_any_failed, require_on_every_host
from ..checkpoint.pickles import UntrustedPickleError, load_without_code, untrusted_error
from ..engine import ZeroEngine, ZeroOptimizer, enable_activation_checkpointing, shard_model
from ..engine.exit import close_at_exit
from .plugin import ZeroPlugin

logger = logging.getLogger("hf_zero")


def _launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _import_before_the_group(module: str) -> None:
    """Import `module` (if installed) before the process group exists. Accelerate imports DeepSpeed where it is
    installed (`unwrap_model`, during `prepare`), and `deepspeed.comm.torch` binds `group=GroupMember.WORLD` as a
    default when imported: after init_process_group it would hold the world group, and gloo's threads, into the
    interpreter's finalization (DeepSpeed's bug, engine/exit.py). Imported now, those defaults bind None."""
    import importlib
    import importlib.util
    import sys

    import torch.distributed as dist

    if module in sys.modules or (dist.is_available() and dist.is_initialized()):
        return  # too late (or already done): nothing hf_zero can do without rewriting DeepSpeed's defaults
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return
        importlib.import_module(module)
    except Exception as exc:  # a broken DeepSpeed install: Accelerate will say so itself if it needs it
        logger.debug("hf_zero: importing %s before the process group failed (%s)", module, exc)


# Imported with hf_zero's integrations, which scripts import before TrainingArguments or an Accelerator creates the
# process group: then DeepSpeed's group defaults bind None (the Trainer creates the group before any
# HfZeroAccelerator exists, so __init__'s own call comes too late there).
_import_before_the_group("deepspeed.comm.torch")


class HfZeroAccelerator(Accelerator):
    """Accelerator whose `prepare` shards model and optimizer with ZeRO.

    Args:
        zero_plugin: the ZeRO settings; default: read `hf_zero.yaml` ($HF_ZERO_CONFIG_FILE, else beside
            Accelerate's default config; defaults when there is none).
        **kwargs: everything Accelerator takes (gradient_accumulation_steps, mixed_precision, log_with, ...).
    """

    def __init__(self, *args: Any, zero_plugin: Optional[ZeroPlugin] = None, **kwargs: Any) -> None:
        self.zero_plugin = zero_plugin if zero_plugin is not None else ZeroPlugin.from_env()
        mixed_precision = kwargs.pop("mixed_precision", None) or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        mixed_precision = str(mixed_precision).lower()
        if mixed_precision not in ("no", "fp32", "bf16", "fp16"):
            raise ValueError(f"mixed_precision={mixed_precision!r}: hf_zero supports 'no', 'bf16' and 'fp16'")
        for backend in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
            if os.environ.get(backend, "false").lower() in ("1", "true"):
                raise RuntimeError(
                    f"{backend} is set: the Accelerate config selects DeepSpeed/FSDP, which hf_zero replaces. Write "
                    f"the config with `hf-zero config` (distributed_type MULTI_GPU, or MULTI_GPU with use_cpu on CPU)"
                )
        # A distributed launch on a machine with no GPU must become a gloo world, not N one-process runs.
        if _launched_world_size() > 1 and not torch.cuda.is_available():
            kwargs.setdefault("cpu", True)
        _import_before_the_group("deepspeed.comm.torch")
        super().__init__(*args, mixed_precision="no", **kwargs)
        if self.num_processes != _launched_world_size():
            raise RuntimeError(
                f"WORLD_SIZE={_launched_world_size()} processes were launched but Accelerate built a state with "
                f"{self.num_processes}: Accelerate state was created before hf_zero was imported (TrainingArguments, "
                f"PartialState, a plain Accelerator). Import hf_zero first, or launch with ACCELERATE_USE_CPU=1 "
                f"(`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N`, or torchrun)"
            )
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            raise RuntimeError(f"distributed_type {self.distributed_type} conflicts with hf_zero; use MULTI_GPU/CPU")
        self.zero_config = self.zero_plugin.to_zero_config(mixed_precision)
        # gloo's worker threads abort the process ("terminate called without an active exception") when the
        # interpreter exits with the process group alive, as scripts and the Trainer leave it: close it at exit,
        # with or without a prepared model (engine/exit.py; each engine is waited for first).
        close_at_exit()
        self.zero_engines: List[ZeroEngine] = []
        self._pending_model: Optional[nn.Module] = None
        if self.is_main_process:
            logger.info("hf_zero: %s, mixed precision %s, %d processes (%s)", self.zero_plugin, mixed_precision,
                        self.num_processes, self.distributed_type)

    # ---------------------------------------------------------------- engine lookup
    @property
    def zero_engine(self) -> ZeroEngine:
        """The engine of the (single) prepared model."""
        if not self.zero_engines:
            raise RuntimeError("no model has been prepared with an optimizer yet: call accelerator.prepare(model, "
                               "optimizer, ...) first")
        return self.zero_engines[0]

    def _engine_of(self, model: nn.Module) -> Optional[ZeroEngine]:
        model = self.unwrap_model(model)
        return next((e for e in self.zero_engines if e.model is model), None)

    def _shard(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> ZeroEngine:
        if self.zero_engines:
            raise RuntimeError("HfZeroAccelerator shards one model per Accelerator (as DeepSpeed does)")
        model_parallel, data_parallel = self._parallel_groups(model)
        if self.zero_plugin.activation_checkpointing != "off" or self.zero_plugin.cpu_checkpointing:
            enable_activation_checkpointing(model, self.zero_plugin.activation_checkpointing,
                                            self.zero_plugin.cpu_checkpointing, model_parallel)
        engine = shard_model(model, optimizer, self.zero_config, process_group=data_parallel, device=self.device)
        self.zero_engines.append(engine)
        return engine

    def _parallel_groups(self, model: nn.Module) -> "tuple[Optional[Any], Optional[Any]]":
        """(model-parallel group for P_a, data-parallel group ZeRO shards over): the plugin's, else the "tp" and
        "dp" dimensions of Accelerate's device mesh when it has a tensor-parallel dimension, else (None, world)."""
        mp, dp = self.zero_plugin.model_parallel_group, self.zero_plugin.data_parallel_group
        mesh = getattr(self.state, "device_mesh", None)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mp is None and "tp" in names and mesh["tp"].size() > 1:
            from torch.distributed.tensor import DTensor

            if any(isinstance(p, DTensor) for p in model.parameters()):
                raise ValueError("hf_zero shards plain tensors, and this model's parameters are DTensors (tensor "
                                 "parallelism applied by Accelerate/Transformers). Split the layers yourself "
                                 "(column/row-parallel) and pass ZeroPlugin(model_parallel_group=..., "
                                 "data_parallel_group=...)")
            mp = mesh["tp"].get_group()
            if dp is None:
                try:  # "dp" is a mesh dimension or the flattened data-parallel dimensions Accelerate makes
                    dp = mesh["dp"].get_group()
                except KeyError:
                    raise ValueError(f"Accelerate's device mesh {names} has a 'tp' dimension but no 'dp' one: pass "
                                     f"ZeroPlugin(data_parallel_group=...) for ZeRO to shard over") from None
        return mp, dp

    # ---------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: Optional[List[bool]] = None) -> Any:
        """Shard the model with its optimizer first (whatever the argument order), then let Accelerate prepare the
        rest (data loaders, the ZeRO optimizer's wrapper, schedulers re-pointed at the ZeRO optimizer)."""
        models = [a for a in args if isinstance(a, nn.Module) and self._engine_of(a) is None]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)
                      and not getattr(a, "_is_accelerate_prepared", False)]
        replaced: Dict[int, Any] = {}
        if len(models) == 1 and len(optimizers) == 1:
            engine = self._shard(models[0], optimizers[0])
            replaced[id(optimizers[0])] = engine.optimizer
            self._repoint_schedulers(args, optimizers[0], engine.optimizer)
        elif len(models) > 1 or len(optimizers) > 1:
            raise ValueError("HfZeroAccelerator.prepare takes one model and its optimizer")
        new_args = [replaced.get(id(a), a) for a in args]
        return super().prepare(*new_args, device_placement=device_placement)

    @staticmethod
    def _repoint_schedulers(args: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        for a in args:
            if isinstance(a, torch.optim.lr_scheduler.LRScheduler) and a.optimizer is old:
                a.optimizer = new

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """A sharded model is returned as is (no DDP wrapper); an unsharded one waits for its optimizer."""
        if self._engine_of(model) is not None:
            if model not in self._models:
                self._models.append(model)
            return model
        if evaluation_mode:
            if any(p.is_meta for p in model.parameters()):
                raise ValueError("this model's parameters are still on the meta device (hf_zero.from_pretrained): "
                                 "prepare(model, optimizer) reads its weights into shards; evaluate after that (with "
                                 "the Trainer: eval_on_start=True evaluates right after preparing)")
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        self._pending_model = model
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None):
        if not getattr(optimizer, "_is_accelerate_prepared", False) and not isinstance(optimizer, ZeroOptimizer):
            if self._pending_model is None:
                raise ValueError("prepare the model before (or together with) its optimizer")
            engine = self._shard(self._pending_model, optimizer)
            self._models.append(self._pending_model)
            self._pending_model = None
            optimizer = engine.optimizer
        return super().prepare_optimizer(optimizer, device_placement=False)

    # ---------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss / gradient_accumulation_steps, with the fp16 loss scale; gradients go to the engine's hooks."""
        loss = loss / self.gradient_accumulation_steps
        if self.zero_engines:
            self.zero_engine.backward(loss)
        else:
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Stage 0/1: accumulate locally; stages 2/3 still reduce-scatter each micro-batch (bounded memory)."""
        engine = self._engine_of(model)
        with engine.no_sync() if engine is not None else contextlib.nullcontext():
            yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip over every rank's shard and return the global norm (max_norm=inf only measures)."""
        if not self.zero_engines:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return self.zero_engine.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        raise NotImplementedError("clip_grad_value_ on sharded gradients is not supported; use clip_grad_norm_")

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """The engine unscales fp16 gradients itself before the norm and the step."""
        return None

    # ---------------------------------------------------------------- weights
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> Dict[str, torch.Tensor]:
        """Collective: the full weights (fp32 masters) on the main process, {} elsewhere."""
        engine = self._engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return engine.full_state_dict()

    def push_to_hub(self, model: nn.Module, repo_id: str, tokenizer: Any = None, private: bool = False,
                    commit_message: str = "Upload model trained with hf_zero", token: Optional[str] = None,
                    max_shard_size: str = "5GB", dtype: Any = None) -> Optional[str]:
        """Collective: export the consolidated weights (gathered from the shards) and push them with the
        huggingface_hub client from the main process. Returns the repo URL on the main process."""
        import tempfile

        engine = self._engine_of(model)
        if engine is None:
            raise ValueError("push_to_hub needs a model prepared by this HfZeroAccelerator")
        with tempfile.TemporaryDirectory(prefix="hf_zero_push_") as tmp:
            path = export_pretrained(engine, os.path.join(tmp, "export"), tokenizer=tokenizer,
                                     max_shard_size=max_shard_size, dtype=dtype, progress=self.is_main_process)
            url = None
            if self.is_main_process:
                url = push_to_hub(path, repo_id, token=token, private=private, commit_message=commit_message)
            self.wait_for_everyone()
        return url

    # ---------------------------------------------------------------- training state
    @contextlib.contextmanager
    def _without(self, models: bool, optimizers: bool) -> Iterator[None]:
        saved = self._models, self._optimizers
        self._models = [] if models else self._models
        self._optimizers = [] if optimizers else self._optimizers
        try:
            yield
        finally:
            self._models, self._optimizers = saved

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   async_save: Optional[bool] = None, **save_model_func_kwargs: Any) -> str:
        """Accelerate's save_state (consolidated weights, schedulers, RNG, data loaders) plus every rank's optimizer
        and master-weight shard in `zero_shards/` (Accelerate alone would keep only the main process's).

        On disks the hosts do not share, every host gets its ranks' shards (see `save_checkpoint`); Accelerate
        writes the scheduler, sampler and custom states on the main process only unless the accelerator has
        `project_config=ProjectConfiguration(save_on_each_node=True)` (then every host's local main process does),
        and resuming on another host needs them. The consolidated weights stay on the main process's host.

        `async_save` (default: the ZeroPlugin's `async_save`): `zero_shards/` is written in the background
        (`save_checkpoint(async_save=True)`) and the call returns once each rank's shard is in host memory;
        Accelerate's own files are written before it returns, as without. `zero_shards/` appears, complete, when
        the save finishes; the next save_state, a load_state, `accelerator.wait_for_save()` and the end of the
        process wait for it (the first of them raises its error)."""
        if not self.zero_engines:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        if async_save is None:
            async_save = self.zero_plugin.async_save
        # a save in flight finishes first: Accelerate's save_state may rotate (delete) old checkpoint folders
        self.zero_engine.wait_for_save()
        handle = self.register_save_state_pre_hook(self._weights_on_main_process_only)
        try:
            with self._without(models=False, optimizers=True):
                output_dir = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        finally:
            handle.remove()
        shards = os.path.join(output_dir, "zero_shards")
        saved = save_checkpoint(self.zero_engine, shards, step=self.step // max(1, self.gradient_accumulation_steps),
                                async_save=async_save)
        if async_save:
            saved.add_done_callback(self._warn_if_node_local)  # the manifest exists once the save is done
        else:
            self._warn_if_node_local(shards)
        return output_dir

    def wait_for_save(self) -> None:
        """Wait for a `save_state(async_save=True)` still writing its shards; CheckpointError if it failed."""
        for engine in self.zero_engines:
            engine.wait_for_save()

    def _weights_on_main_process_only(self, models: List[nn.Module], weights: List[Dict[str, Any]],
                                      output_dir: str) -> None:
        # get_state_dict gathers the full weights on the main process and gives {} elsewhere: under
        # save_on_each_node another host's local main process would write that empty dict as model.safetensors
        # (on a shared disk, over the main process's file)
        if not self.is_main_process:
            weights.clear()
        # Accelerate drops tied duplicates (which safetensors refuses) only from an OrderedDict, what
        # model.state_dict() returns
        weights[:] = [w if isinstance(w, OrderedDict) else OrderedDict(w) for w in weights]

    def _warn_if_node_local(self, shards: str) -> None:
        if self.project_configuration.save_on_each_node or not self.is_local_main_process:
            return
        disks = read_manifest(shards).get("disks") or [None]
        if len(disks) > 1:
            logger.warning(
                "hf_zero: %s is on %d disks the hosts do not share: every host has its ranks' shards, but Accelerate "
                "wrote the scheduler, sampler and custom states on the main process's host only, so load_state on the "
                "other hosts will fail. Build the accelerator with "
                "project_config=ProjectConfiguration(save_on_each_node=True)", shards, len(disks))

    def _state_files(self) -> Dict[str, str]:
        """What load_state reads besides the shards (as Accelerate's load_accelerator_state does), each with the
        setting that writes it on every host."""
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
        from accelerate.utils import SAMPLER_NAME, SCHEDULER_NAME

        main_only = ("Accelerate's save_state writes the scheduler, sampler and custom states on the main process "
                     "only: on disks the hosts do not share, build the accelerator with "
                     "project_config=ProjectConfiguration(save_on_each_node=True) so that every host's local main "
                     "process writes them (or copy the file to the other hosts)")
        files = {"": "Was the state saved to another path on those hosts?",
                 "zero_shards/manifest.json": "Every host writes its own ranks' shards into zero_shards/: those "
                                              "hosts saved elsewhere or lost their copy"}
        for i in range(len(self._schedulers)):
            files[f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin"] = main_only
        for i, loader in enumerate(self._dataloaders):
            try:
                seeded = isinstance(loader.dataset, IterableDatasetShard) and \
                    isinstance(loader.get_sampler(), SeedableRandomSampler)
            except AttributeError:
                seeded = False
            if seeded:
                files[f"{SAMPLER_NAME}.bin" if i == 0 else f"{SAMPLER_NAME}_{i}.bin"] = main_only
        for i in range(len(self._custom_objects)):
            files[f"custom_checkpoint_{i}.pkl"] = main_only
        return files

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                   trust_pickles: bool = False, **load_model_func_kwargs: Any) -> None:
        """Restore a save_state folder: the shards restore weights and optimizer state at any world size; Accelerate
        restores schedulers, RNG, data loaders and registered custom objects.

        Collective. A file that some hosts have and others lack (a state saved to node-local disks without
        `ProjectConfiguration(save_on_each_node=True)`) raises CheckpointError on every rank, naming the file, the
        hosts and the setting, as does a failure of Accelerate's own loading on any rank.

        The folder runs no code: every pickled file read here (`random_states_{i}.pkl`, `scheduler*.bin`,
        `sampler*.bin`, `dl_state_dict*.bin`, `custom_checkpoint_{i}.pkl`; before `prepare` also Accelerate's model
        and optimizer `.bin` files) is loaded with `torch.load(weights_only=True)`: tensors, plain Python data and
        numpy's RNG arrays. Stock Accelerate unpickles `custom_checkpoint_{i}.pkl` in full, which runs whatever a
        planted file holds. A file that needs more (a custom state holding other Python objects) raises
        UntrustedPickleError (a CheckpointError; on every rank), naming the file. `trust_pickles=True` (or
        `load_kwargs={"weights_only": False}`) is the opt-in: it unpickles in full, as stock Accelerate does; use
        it only for folders whose writer you trust, or allow just the needed classes with
        `torch.serialization.add_safe_globals`."""
        trust = trust_pickles or (load_kwargs or {}).get("weights_only") is False
        if not self.zero_engines:
            return self._load_accelerate_state(input_dir, load_kwargs, trust, **load_model_func_kwargs)
        if input_dir is None:
            raise ValueError("HfZeroAccelerator.load_state needs input_dir: the folder save_state returned")
        folder = os.path.expanduser(str(input_dir))
        if not os.path.isdir(os.path.join(folder, "zero_shards")) and looks_foreign(folder):
            return self._load_foreign_state(folder, load_kwargs, trust, **load_model_func_kwargs)
        files = self._state_files()
        require_on_every_host(folder, list(files), files, CheckpointError)
        shards = resolve_checkpoint(Path(folder, "zero_shards"))  # a save killed mid-rename left the previous aside
        if not shards.is_dir():
            raise FileNotFoundError(f"{input_dir} has no zero_shards/ folder: it was not written by "
                                    f"HfZeroAccelerator.save_state, so it holds no optimizer shards")
        # All or nothing: the shards are read and checked on every rank first; Accelerate's part (schedulers, RNG,
        # samplers, custom objects) is undone if it fails on any rank; only then does the engine change.
        _, staged = stage_checkpoint(self.zero_engine, shards)

        def rest() -> None:
            with self._without(models=True, optimizers=True):
                self._load_accelerate_state(input_dir, load_kwargs, trust, **load_model_func_kwargs)

        self._apply(staged, rest, f"load_state({input_dir})")

    def _apply(self, staged: Any, rest: Callable[[], None], what: str) -> None:
        """Collective. Run `rest()` (Accelerate's part: schedulers, RNG, samplers, custom objects), undo it if it
        failed on any rank (raised on every rank, not left to hang the others in the next collective), and only
        then give the engine the `staged` shards."""
        before = self._restorable_state()
        error = None
        try:
            rest()
        except Exception as exc:
            error = exc
        try:
            raise_if_any_failed(error, what, CheckpointError)
        except CheckpointError:
            self._restore_state(before)
            raise
        self.zero_engine.load_shard_state(staged)

    def _load_foreign_state(self, folder: str, load_kwargs: Optional[dict], trust: bool,
                            **load_model_func_kwargs: Any) -> None:
        """load_state of a folder DeepSpeed or FSDP2 wrote through Accelerate (or the Trainer): weights, fp32
        master and Adam state resharded onto this run's engine (`stage_checkpoint` reads them with no code run),
        the LR scheduler from the folder's own record (DeepSpeed keeps it in its model states), and Accelerate's
        RNG, sampler and custom states where the folder has them. All or nothing, as for hf_zero's own folders."""
        from accelerate.utils import SCHEDULER_NAME

        manifest, staged = stage_checkpoint(self.zero_engine, folder, trust=trust)  # the source's description

        def rest() -> None:
            # Accelerate writes scheduler.bin beside a DeepSpeed checkpoint unless DeepSpeed was handed the
            # scheduler, which then lives in DeepSpeed's model states
            accelerate_wrote = os.path.isfile(os.path.join(folder, f"{SCHEDULER_NAME}.bin"))
            saved_schedulers = self._schedulers
            self._schedulers = saved_schedulers if accelerate_wrote else []
            try:
                with self._without(models=True, optimizers=True):
                    self._load_accelerate_state(folder, load_kwargs, trust, **load_model_func_kwargs)
            finally:
                self._schedulers = saved_schedulers
            scheduler_state = manifest.get("lr_scheduler")
            if scheduler_state is not None and self._schedulers and not accelerate_wrote:
                self._schedulers[0].load_state_dict(scheduler_state)
            if manifest.get("step") is not None and not os.path.isfile(os.path.join(folder, "random_states_0.pkl")):
                self.step = int(manifest["step"]) * max(1, self.gradient_accumulation_steps)

        self._apply(staged, rest, f"load_state({folder})")

    def _restorable_state(self) -> Dict[str, Any]:
        """What Accelerate's load_state changes besides models and optimizers, copied so a failed load can put it
        back: scheduler and custom-object states, data-loader samplers and states, the RNG states."""
        import random

        import numpy as np

        def copied(obj: Any) -> Any:
            return copy.deepcopy(obj.state_dict()) if hasattr(obj, "state_dict") else None

        return {
            "schedulers": [copied(s) for s in self._schedulers],
            "custom": [copied(o) for o in self._custom_objects],
            "samplers": [d.get_sampler() if hasattr(d, "get_sampler") else None for d in self._dataloaders],
            "loaders": [copied(d) if getattr(d, "use_stateful_dataloader", False) else None
                        for d in self._dataloaders],
            "rng": (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None),
        }

    def _restore_state(self, saved: Dict[str, Any]) -> None:
        import random

        import numpy as np

        for obj, state in [*zip(self._schedulers, saved["schedulers"]), *zip(self._custom_objects, saved["custom"]),
                           *zip(self._dataloaders, saved["loaders"])]:
            if state is not None:
                obj.load_state_dict(state)
        for loader, sampler in zip(self._dataloaders, saved["samplers"]):
            if sampler is not None and hasattr(loader, "set_sampler"):
                loader.set_sampler(sampler)
        py, np_state, cpu, cuda = saved["rng"]
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    def _load_accelerate_state(self, input_dir: Optional[str], load_kwargs: Optional[dict], trust: bool,
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
        from accelerate.checkpointing import load_accelerator_state
        from accelerate.utils import RNG_STATE_NAME

        opt_in = "load_state(..., trust_pickles=True)"
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
            raise RuntimeError(f"distributed_type {self.distributed_type}: hf_zero's load_state does not load it")
        folder = self._state_folder(input_dir)
        logger.info("hf_zero: loading states from %s", folder)
        found = [f for f in os.listdir(folder) if re.search(r"^custom_checkpoint_\d+\.pkl$", f) is not None]
        if len(found) != len(self._custom_objects):
            raise RuntimeError(
                f"Number of custom checkpoints in folder {folder} does not match the number of registered objects: "
                f"found {len(found)} checkpoints, {len(self._custom_objects)} registered objects. Load only folders "
                f"saved with the same registered objects, or keep `custom_checkpoint` out of other files' names")
        custom = [load_without_code(os.path.join(folder, f"custom_checkpoint_{i}.pkl"), opt_in, trust, "cpu")
                  for i in range(len(self._custom_objects))]
        rng = os.path.join(folder, f"{RNG_STATE_NAME}_{self.process_index}.pkl")
        if not trust and os.path.isfile(rng):
            load_without_code(rng, opt_in)
        models, optimizers = list(self._models), list(self._optimizers)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, folder)
        map_location = load_model_func_kwargs.pop("map_location", None)
        if map_location is None:
            map_location = ("on_device" if self.num_processes > 1 and self.multi_device
                            and self.distributed_type != DistributedType.MULTI_XPU else "cpu")
        try:
            overrides = load_accelerator_state(
                folder, models, optimizers, list(self._schedulers), list(self._dataloaders), self.process_index,
                self.scaler, map_location, {**(load_kwargs or {}), "weights_only": not trust},
                **load_model_func_kwargs)
        except pickle.UnpicklingError as exc:
            if trust:
                raise
            raise self._refused_file(folder, models, optimizers, exc, opt_in) from None
        if "step" in overrides:
            self.step = overrides["step"]
        for obj, state in zip(self._custom_objects, custom):
            obj.load_state_dict(state)

    def _state_folder(self, input_dir: Optional[str]) -> str:
        """The folder Accelerate's load_state reads: `input_dir`, else the newest automatically named one."""
        if input_dir is not None:
            folder = os.path.expanduser(str(input_dir))
            if not os.path.isdir(folder):
                raise ValueError(f"Tried to find {input_dir} but folder does not exist")
            return folder
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        base = os.path.join(self.project_dir, "checkpoints")
        folders = [os.path.join(base, f) for f in os.listdir(base)]
        folders.sort(key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))
        return folders[-1]

    def _refused_file(self, folder: str, models: List[nn.Module], optimizers: List[Any], exc: BaseException,
                      opt_in: str) -> UntrustedPickleError:
        """Which file Accelerate's weights-only read refused (torch's error does not say): the first of the files
        `load_accelerator_state` reads, in its order, that `load_without_code` refuses too."""
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
        from accelerate.utils import MODEL_NAME, OPTIMIZER_NAME, SAFE_MODEL_NAME, SAMPLER_NAME, SCALER_NAME, \
            SCHEDULER_NAME

        def nth(stem: str, i: int, ext: str = ".bin") -> str:  # Accelerate's names: model.bin, model_1.bin, ...
            return f"{stem}{ext}" if i == 0 else f"{stem}_{i}{ext}"

        names = [nth(MODEL_NAME, i) for i in range(len(models))
                 if not os.path.exists(os.path.join(folder, nth(SAFE_MODEL_NAME, i, ".safetensors")))]
        names += [nth(OPTIMIZER_NAME, i) for i in range(len(optimizers))]
        names += [nth(SCHEDULER_NAME, i) for i in range(len(self._schedulers))]
        for i, loader in enumerate(self._dataloaders):
            if isinstance(loader.dataset, IterableDatasetShard) and \
                    isinstance(getattr(loader, "get_sampler", lambda: None)(), SeedableRandomSampler):
                names.append(nth(SAMPLER_NAME, i))
            if getattr(loader, "use_stateful_dataloader", False):
                names.append(nth("dl_state_dict", i))
        names += [SCALER_NAME] if self.scaler is not None else []
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                try:
                    load_without_code(path, opt_in)
                except UntrustedPickleError as refused:
                    return refused
        return untrusted_error(folder, exc, opt_in)

    def free_memory(self, *objects: Any) -> Any:
        for engine in self.zero_engines:
            engine.close()
        self.zero_engines.clear()
        self._pending_model = None
        return super().free_memory(*objects)
