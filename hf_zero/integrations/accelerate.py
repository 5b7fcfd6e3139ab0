"""HfZeroAccelerator: Accelerate's Accelerator with model and optimizer preparation replaced by ZeRO sharding.

A training script changes one import (`from hf_zero import HfZeroAccelerator as Accelerator`) and nothing else:
`prepare` shards the model in place (no wrapper: `unwrap_model` and `save_pretrained` keep seeing the HF model)
and returns the ZeRO optimizer; `backward`, `no_sync`/`accumulate`, `clip_grad_norm_`, `get_state_dict`,
`save_model` and `free_memory` go through the engine. Mixed precision is the engine's (bf16/fp16 compute copies
with fp32 master weights), so Accelerate itself runs with mixed_precision="no" (no autocast, no GradScaler).

A checkpoint folder runs no code: `load_without_code` (checkpoint/pickles.py) reads one pickled file with
torch.load(weights_only=True) (numpy's RNG data types allowed), and `load_state` (its flow in load_state.py) reads
the custom and RNG states through it and passes `weights_only` to Accelerate's own reads (RNG, scheduler, sampler,
data-loader states), replacing no function of torch's or Accelerate's. ZeroTrainer's resume runs the Trainer's
readers with `load_without_code` as their `torch.load` (integrations/trainer.py).

Accelerate's private names (the registries of prepared objects, its loader of them) are used through
_accelerate_private.py only.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object, recursively_apply
from torch import nn

from ..checkpoint import export_pretrained, push_to_hub, read_manifest, save_checkpoint
from ..checkpoint.pickles import UntrustedPickleError, load_without_code  # noqa: F401  (re-exported)
from ..engine import ZeroEngine, ZeroOptimizer, enable_activation_checkpointing, shard_model
from ..engine.exit import close_at_exit
from ..engine.sequence import SequenceGroups
from ._accelerate_private import Registered, is_prepared
from .load_state import load_state as load_state_flow
from .plugin import ZeroPlugin
from .sequence_parallel import enable_long_sequences

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
        # Accelerate reads ParallelismConfig(sp_size > 1) as DeepSpeed's Ulysses (and refuses it on CPU): hf_zero runs
        # the sequence parallelism itself, so the config is taken here and not passed on
        self._accelerate_sp = self._take_sequence_parallelism(kwargs)
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
        self.sequence_groups: SequenceGroups = self._sequence_groups()
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
        config = self.zero_config
        if self.sequence_groups.size > 1 or config.tiled_loss_tokens or config.tiled_mlp_tokens:
            enable_long_sequences(model, self.sequence_groups, config.tiled_loss_tokens, config.tiled_mlp_tokens)
        if self.zero_plugin.activation_checkpointing != "off" or self.zero_plugin.cpu_checkpointing:
            enable_activation_checkpointing(model, self.zero_plugin.activation_checkpointing,
                                            self.zero_plugin.cpu_checkpointing, model_parallel)
        engine = shard_model(model, optimizer, self.zero_config, process_group=data_parallel, device=self.device)
        self.zero_engines.append(engine)
        return engine

    @staticmethod
    def _take_sequence_parallelism(kwargs: Dict[str, Any]) -> int:
        """sp_size of a ParallelismConfig among the Accelerator's arguments (removed from them when > 1), else 1."""
        pc = kwargs.get("parallelism_config")
        if pc is None:
            return 1
        if getattr(pc, "cp_size", 1) > 1:
            raise ValueError(f"ParallelismConfig(cp_size={pc.cp_size}) is FSDP2's ring attention; hf_zero splits "
                             f"sequences with Ulysses: give sp_size instead")
        sp = getattr(pc, "sp_size", 1) or 1
        if sp > 1:
            others = {k: getattr(pc, f"{k}_size") for k in ("dp_replicate", "dp_shard", "tp")
                      if (getattr(pc, f"{k}_size", 1) or 1) > 1}
            if others:
                raise ValueError(f"ParallelismConfig(sp_size={sp}) with {others}: hf_zero takes sp_size alone (ZeRO "
                                 f"partitions over all N ranks, the N / sp replicas are the data parallelism); for "
                                 f"tensor parallelism give ZeroPlugin(model_parallel_group=..., "
                                 f"data_parallel_group=...)")
            kwargs.pop("parallelism_config")
        return sp

    def _sequence_groups(self) -> SequenceGroups:
        """The sp groups of `sequence_parallel_size`, or of Accelerate's `ParallelismConfig(sp_size=...)`."""
        size = self.zero_config.sequence_parallel_size
        if self._accelerate_sp > 1:
            if size not in (1, self._accelerate_sp):
                raise ValueError(f"ParallelismConfig(sp_size={self._accelerate_sp}) and the ZeroPlugin's "
                                 f"sequence_parallel_size={size} disagree: give one of them")
            size = self.zero_config.sequence_parallel_size = self._accelerate_sp
        return SequenceGroups.build(size)

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
        rest (data loaders, the ZeRO optimizer's wrapper, schedulers). The optimizer is sharded in place, so the
        schedulers built on it keep driving it."""
        models = [a for a in args if isinstance(a, nn.Module) and self._engine_of(a) is None]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer) and not is_prepared(a)]
        if len(models) == 1 and len(optimizers) == 1:
            self._shard(models[0], optimizers[0])
        elif len(models) > 1 or len(optimizers) > 1:
            raise ValueError("HfZeroAccelerator.prepare takes one model and its optimizer")
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """A sharded model is returned as is (no DDP wrapper); an unsharded one waits for its optimizer."""
        if self._engine_of(model) is not None:
            Registered(self).add_model(model)
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
        if not is_prepared(optimizer) and not isinstance(optimizer, ZeroOptimizer):
            if self._pending_model is None:
                raise ValueError("prepare the model before (or together with) its optimizer")
            engine = self._shard(self._pending_model, optimizer)
            Registered(self).add_model(self._pending_model)
            self._pending_model = None
            optimizer = engine.optimizer
        return super().prepare_optimizer(optimizer, device_placement=False)

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """Under sequence parallelism each data-parallel replica (its sp ranks together) reads distinct samples and
        its sp ranks the same batch, which the model cuts along the sequence; otherwise Accelerate's own."""
        groups = self.sequence_groups
        if groups.size == 1 or is_prepared(data_loader):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        from accelerate.data_loader import prepare_data_loader

        if self.dispatch_batches:
            raise ValueError("dispatch_batches=True sends rank 0's batches to every rank, and under sequence "
                             "parallelism the sp ranks of a replica must read the same batch: leave dispatch_batches "
                             "unset (or False)")
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=groups.data_parallel_size,
            process_index=groups.data_parallel_rank, split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=False, even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
        Registered(self).dataloaders.append(prepared)
        return prepared

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's, except under sequence parallelism: the sp ranks of a replica hold the same batch (and the same
        whole-sequence loss), so each replica's values are taken once (its sp group's first rank's), then the last
        uneven batch is cut to the dataset's remainder as Accelerate cuts it (the prepared DataLoader counts the
        replicas only). Gathering from every rank would repeat each sample sp times and cut the wrong rows."""
        groups = self.sequence_groups
        if groups.size == 1:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        dp, sp = groups.data_parallel_size, groups.size
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        if tensors:  # rank order: the sp ranks of a replica are consecutive
            data = recursively_apply(lambda t: t.reshape(dp, sp, -1, *t.shape[1:])[:, 0].reshape(-1, *t.shape[1:]),
                                     self.gather(input_data))
        else:
            every = gather_object([input_data])  # one entry per rank
            data = [x for replica in every[::sp] for x in (replica if isinstance(replica, list) else [replica])]
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if tensors:
                return recursively_apply(lambda t: t[:state.remainder], data)
            return data[:state.remainder]
        return data

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
            with Registered(self).hidden(optimizers=True):
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
        load_state_flow(self, input_dir, load_kwargs, trust, **load_model_func_kwargs)

    def free_memory(self, *objects: Any) -> Any:
        for engine in self.zero_engines:
            engine.close()
        self.zero_engines.clear()
        self._pending_model = None
        return super().free_memory(*objects)
