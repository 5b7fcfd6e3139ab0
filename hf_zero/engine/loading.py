"""shard_model(..., weights=...): materialise a meta-built model straight into this rank's shards.

Each flat group's initial values are read from the weights files, not copied from the module: at stage 3 only
the rank's owned range [lo, hi) of the group (the slices of each parameter that fall in it), at stages 0-2 the
whole group, one group at a time. The meta parameters are then swapped (`torch.utils.swap_tensors`: the same
Python objects, so the optimizer built on them and tied weights stay intact) for real ones that the flat group
points into. Keys the files lack are initialised the way `from_pretrained` does (the model's `_init_weights` on
a host copy of the owning module, seeded by the parameter's name, so every rank draws the same values) and
reported once; unexpected keys, shapes that differ and a config of another architecture are errors.

A failed load must leave the model as it was (its parameters on meta, its buffers), so that the ranks, which all
raise the error together, can load it again: `check` finds what can fail short of reading (each file's header,
shapes, the initial values of missing keys) before any parameter changes, and `undo` swaps back whatever was
materialised when a read fails later, on this rank or another.
"""
from __future__ import annotations

import logging
import os
import re
import zlib
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .planning import GroupPlan, ShardPlan, Slot
from .state import PersistentBuffer, persistent_buffers
from .weights import PretrainedWeights, TensorEntry, WeightSource, WeightsError, meta_copy

logger = logging.getLogger("hf_zero")

Weights = Union[None, str, os.PathLike, PretrainedWeights]


def resolve_weights(weights: Weights, model: nn.Module) -> Optional[Tuple[PretrainedWeights, str]]:
    """(the weights to load, the name prefix of the module they belong to): the argument, else what
    `hf_zero.from_pretrained` attached to the model or to a module inside it (a PEFT model wraps the base model:
    its parameter names start with "base_model.model.")."""
    if weights is not None:
        return (weights if isinstance(weights, PretrainedWeights) else PretrainedWeights(weights)), ""
    for name, module in model.named_modules():
        record = vars(module).get("hf_zero_weights")
        if isinstance(record, PretrainedWeights):
            return record, name
    return None


class ShardLoader:
    """Reads one flat group's initial values at a time from a WeightSource (see the module docstring)."""

    def __init__(self, model: nn.Module, plan: ShardPlan, record: PretrainedWeights, prefix: str = "") -> None:
        self.model, self.plan, self.record = model, plan, record
        self.prefix = prefix + "." if prefix else ""
        self.source = WeightSource(record.path)
        self.keys = keys = set(self.source.keys())
        base = model.get_submodule(prefix) if prefix else model
        config = getattr(base, "config", None)
        theirs, ours = self.source.config_model_type(), getattr(config, "model_type", None)
        if theirs and ours and theirs != ours:
            raise WeightsError(f"{record.path} holds a {theirs!r} model (its config.json) but the model is "
                               f"{type(base).__name__} ({ours!r}): load the folder saved from this architecture")
        self.key_of: Dict[str, Optional[str]] = {}  # slot name -> the key in the files (any of its aliases)
        for g in plan.groups:
            for s in g.slots:
                self.key_of[s.name] = next((self._key(a) for a in s.aliases if self._key(a) in keys), None)
        # persistent buffer -> the key in the files (any of its names), as for the parameters
        self.buffers: List[Tuple[PersistentBuffer, Optional[str]]] = [
            (b, next((self._key(n) for n in b.names if self._key(n) in keys), None)) for b in persistent_buffers(model)]
        known = {self._key(a) for g in plan.groups for s in g.slots for a in s.aliases}
        known |= {self._key(n) for b, _ in self.buffers for n in b.names}
        ignored = [re.compile(p) for p in record.ignore_unexpected]
        unexpected = sorted(k for k in keys - known if not any(p.search(k) for p in ignored))
        if unexpected:
            raise WeightsError(f"{record.path} holds {len(unexpected)} key(s) that {type(model).__name__} does not "
                               f"have, e.g. {unexpected[:5]}: these weights come from another model (or another "
                               f"version of it)")
        if not any(self.key_of.values()):
            raise WeightsError(f"{record.path} holds none of {type(model).__name__}'s parameters (e.g. "
                               f"{next(iter(self.key_of))!r}): these weights come from another model")
        self.missing = sorted(name for name, key in self.key_of.items() if key is None)
        self._initialised: Dict[str, torch.Tensor] = {}
        self._swapped: List[Tuple[nn.Parameter, nn.Parameter]] = []  # (parameter, its meta original)
        self._replaced_buffers: List[Tuple[nn.Module, str, torch.Tensor]] = []  # (module, name, the buffer before)

    def _key(self, name: str) -> str:
        """A model name as the files spell it (without the wrapper's prefix and renames)."""
        name = name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name
        for old, new in self.record.rename:
            name = name.replace(old, new)
        return name

    # ---------------------------------------------------------------- buffers
    def load_buffers(self) -> None:
        """Persistent buffers come from the files when they hold them; a buffer still on the meta device is an
        error (it was built with the parameters under torch.device('meta'))."""
        for b, key in self.buffers:
            if key is not None:
                e = self.source.entry(key)
                value = self._read(key, e).view(e.shape).to(b.tensor.dtype)
                for module, bname in b.owners:  # every module sharing the buffer gets the one new tensor
                    self._replaced_buffers.append((module, bname, module._buffers[bname]))
                    module._buffers[bname] = value
        for mname, module in self.model.named_modules():
            for bname, buf in module._buffers.items():
                if buf is not None and buf.device.type == "meta":
                    full = f"{mname}.{bname}" if mname else bname
                    raise WeightsError(f"buffer {full} is on the meta device and the weights do not hold it: build "
                                       f"the model inside hf_zero.parameters_on_meta() (parameters on meta, buffers "
                                       f"computed) or with hf_zero.from_pretrained")

    # ---------------------------------------------------------------- parameters
    def _entry(self, slot: Slot, key: str) -> TensorEntry:
        """The file's entry for `slot` (its file's header checked whole), of the slot's shape."""
        e = self.source.entry(key)
        if tuple(e.shape) != tuple(slot.shape):
            raise WeightsError(f"{key}: shape {tuple(e.shape)} in {e.file.name} but {tuple(slot.shape)} in the "
                               f"model: these weights come from another configuration of it")
        return e

    def _read(self, key: str, e: TensorEntry, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """source.read, with any failure (an I/O fault, memory) a WeightsError naming the file and the tensor."""
        try:
            return self.source.read(key, start, end)
        except WeightsError:
            raise
        except Exception as exc:
            raise WeightsError(f"{e.file}: reading tensor {key!r} failed: {type(exc).__name__}: {exc}") from exc

    def check(self, group: GroupPlan, lo: int, hi: int) -> None:
        """What can fail about elements [lo, hi) of the group short of reading them: each file's header, each
        tensor's shape, the initial values of keys the files lack (kept for `values`). Changes no parameter."""
        for s in group.slots:
            if max(lo, s.offset) >= min(hi, s.offset + s.numel):
                continue
            key = self.key_of[s.name]
            if key is None:
                self._initial(s)
            else:
                self._entry(s, key)

    def values(self, group: GroupPlan, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the group's flat buffer (zeros in the padding), in `dtype`."""
        out = torch.zeros(hi - lo, dtype=dtype)
        for s in group.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a >= b:
                continue
            key = self.key_of[s.name]
            if key is None:
                out[a - lo:b - lo].copy_(self._initial(s)[a - s.offset:b - s.offset])
                continue
            e = self._entry(s, key)
            out[a - lo:b - lo].copy_(self._read(key, e, a - s.offset, b - s.offset))
        return out

    def _initial(self, slot: Slot) -> torch.Tensor:
        """A parameter the files lack, initialised as from_pretrained would, the same on every rank."""
        if slot.name not in self._initialised and self.record.init_param is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(slot.name.encode()))
                value = self.record.init_param(self.model, slot.name)
            if value is not None:
                self._initialised[slot.name] = value.detach().reshape(-1).clone()
        if slot.name not in self._initialised:
            mname, _, pname = slot.name.rpartition(".")
            module = self.model.get_submodule(mname) if mname else self.model
            host = meta_copy(module).to_empty(device="cpu", recurse=False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(slot.name.encode()))
                if self.record.init_module is not None:
                    self.record.init_module(host)
                elif hasattr(host, "reset_parameters"):
                    host.reset_parameters()
                else:
                    raise WeightsError(f"{slot.name} is not in {self.record.path} and {type(module).__name__} has "
                                       f"no reset_parameters(): give shard_model a PretrainedWeights(init_module=...)")
            self._initialised[slot.name] = getattr(host, pname).detach().reshape(-1).clone()
        return self._initialised[slot.name]

    def materialise(self, params: List[nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
        """Swap each meta parameter's contents for an empty real tensor (same object, same requires_grad)."""
        for p in params:
            if p.device.type == "meta":
                real = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, real)
                self._swapped.append((p, real))  # `real` now holds the meta original (class, attributes)

    def undo(self) -> List[str]:
        """After a failed load (on any rank): the parameters materialised so far back on meta, as they were
        (class and attributes included), and the buffers replaced from the files back. Returns the names of the
        parameters that could not be swapped back (a reference to them held elsewhere)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        stuck = []
        for p, original in reversed(self._swapped):
            try:
                torch.utils.swap_tensors(p, original)
            except RuntimeError:
                stuck.append(names.get(id(p), "?"))
        self._swapped.clear()
        for module, bname, buf in reversed(self._replaced_buffers):
            module._buffers[bname] = buf
        self._replaced_buffers.clear()
        self.source.close()
        return stuck

    def finish(self, rank: int) -> None:
        """Report what was initialised and read; the model no longer points at its files (it holds its values)."""
        owner = self.model.get_submodule(self.prefix[:-1]) if self.prefix else self.model
        vars(owner).pop("hf_zero_weights", None)
        if self.missing and rank == 0:
            logger.warning("hf_zero: some weights of %s were not initialized from %s and are newly initialized: %s",
                           type(self.model).__name__, self.record.path, self.missing)
        if rank == 0:
            logger.info("hf_zero: read %.1f MiB of weights from %d file(s) on rank 0", self.source.bytes_read / 2**20,
                        len(self.source.files_opened))
        self.source.close()
