"""A torch.distributed.checkpoint (DCP) folder as a `ForeignSource`: FSDP2's sharded state, Accelerate's FSDP2
`save_state`, torchtitan and plain `dcp.save` of `get_state_dict`.

What DCP writes (torch 2.13), as keys of the metadata (FQN = the parameter's name in the model):

- `dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)})`: "model.<FQN>" per
  parameter and persistent buffer (a tied weight under each of its names), "optim.state.<FQN>.<exp_avg|exp_avg_sq|
  step>" (tensors; FSDP2's are DTensor shards, recorded as chunks), "optim.param_groups.<i>.<lr|betas|...|params>"
  (bytes: each value torch.save'd).
- Accelerate's FSDP2 `save_state` (SHARDED_STATE_DICT): `<output_dir>/pytorch_model_fsdp_0/` with
  {"model": ...} and `<output_dir>/optimizer_0/` with {"optimizer": ...}: keys "model.<FQN>",
  "optimizer.state.<FQN>.<key>", "optimizer.param_groups.<i>.<hp>".
- torchtitan: model keys at the top level ("<FQN>"), "optimizer.state.<FQN>.<key>" and, its optimizer state
  being flattened, "optimizer.param_groups.<FQN>.<hp>" per parameter.

Nothing here runs code from the folder: the metadata is read by `read_dcp_metadata` (DCP's own reader would
pickle.load it), tensors by DCP's reader (torch.load with weights_only=True on each chunk), and the few bytes
entries read (hyper-parameters, the optimizer's parameter lists) by `load_without_code`; DCP's planner would
torch.load them with weights_only=False, so they never go through it.

A parameter's tensors are read whole, one parameter at a time (the last one read is kept, for the next range of
it): memory is bounded by the largest parameter, not the checkpoint.
"""
from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .foreign import TRUST, ForeignCheckpoint, inspect_foreign, read_dcp_metadata
from .foreign_source import ADAM_STATE, HYPER_PARAMETERS, ForeignSource, ParamInfo, json_value
from .pickles import UntrustedPickleError, refusal_reason, load_without_code
from .source import CheckpointError

__all__ = ["ACCELERATE_MODEL_DIR", "ACCELERATE_OPTIMIZER_DIR", "DcpSource", "inspect_fsdp2_output",
           "parameter_names"]

ACCELERATE_MODEL_DIR = "pytorch_model_fsdp_0"  # Accelerate's FSDP_MODEL_NAME + "_0"
ACCELERATE_OPTIMIZER_DIR = "optimizer_0"  # OPTIMIZER_NAME + "_0"
_OPTIM_PREFIXES = ("optim.", "optimizer.")
_NOT_MODEL = ("optim.", "optimizer.", "lr_scheduler", "dataloader", "train_state")  # torchtitan's other states
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def parameter_names(model: nn.Module) -> Dict[str, List[str]]:
    """The model's parameters by their first name, each with all its names (ties): the `parameters` hint of
    `DcpSource`, which tells a frozen parameter from a buffer (DCP records no difference)."""
    out: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return {names[0]: names for names in out.values()}


def _ranks(files: Sequence[str]) -> int:
    ranks = {m.group(1) for f in files if (m := _DATA_FILE.match(os.path.basename(f)))}
    return max(len(ranks) or len(files), 1)


def inspect_fsdp2_output(folder: str, trust: bool = False) -> Optional[ForeignCheckpoint]:
    """Accelerate's FSDP2 `save_state` folder (`pytorch_model_fsdp_0/`, `optimizer_0/`: two DCP folders) as one
    checkpoint of kind "dcp" whose files are named relative to `folder`; None if `folder` is not one."""
    if not os.path.isfile(os.path.join(folder, ACCELERATE_MODEL_DIR, ".metadata")):
        return None
    files: List[str] = []
    for sub in (ACCELERATE_MODEL_DIR, ACCELERATE_OPTIMIZER_DIR):
        if os.path.isdir(os.path.join(folder, sub)):
            found = inspect_foreign(os.path.join(folder, sub), trust)
            if found is None:
                raise CheckpointError(f"{folder}/{sub} has no .metadata: copy the whole checkpoint folder")
            files += [f"{sub}/{f}" for f in found.files]
    return ForeignCheckpoint("dcp", folder, _ranks(files), files=files)


class _Part:
    """One DCP folder of the checkpoint (Accelerate's layout has two): its metadata and DCP's reader over it."""

    def __init__(self, root: str, sub: str, trust: bool) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.sub, self.folder = sub, os.path.join(root, sub) if sub else root
        self.meta = read_dcp_metadata(self.folder, trust)
        meta = self.meta

        class _Reader(FileSystemReader):  # DCP's reader, given the metadata read without code
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return meta

        self.reader = _Reader(self.folder)
        where = os.path.join(self.folder, ".metadata")
        if not isinstance(getattr(meta, "state_dict_metadata", None), dict) or \
                not isinstance(getattr(meta, "storage_data", None), dict):
            raise CheckpointError(f"{where}: not DCP metadata (no state_dict_metadata / storage_data)")
        for info in meta.storage_data.values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
                raise CheckpointError(f"{where} names the data file {name!r}, not a file name inside {self.folder}: "
                                      f"a damaged or hostile checkpoint; refusing to read it")

    def file(self, relative_path: str) -> str:
        """The file's name relative to the checkpoint's root (what files_for lists and open_file takes)."""
        return f"{self.sub}/{relative_path}" if self.sub else relative_path


class DcpSource(ForeignSource):
    """Reads a DCP checkpoint (`found` from `inspect_foreign` or `inspect_fsdp2_output`) per parameter, at any world
    size. `parameters` (`parameter_names(model)`) names the model's parameters with their aliases: DCP records
    parameters and buffers alike, so without it a parameter with no optimizer state counts as a buffer unless
    FSDP2 sharded it, and a tie is found by comparing the tensors."""

    kind = "dcp"

    def __init__(self, found: ForeignCheckpoint, trust: bool = False,
                 parameters: Optional[Mapping[str, Sequence[str]]] = None) -> None:
        self.folder, self.trust = found.folder, trust
        subs = [""] if os.path.isfile(os.path.join(self.folder, ".metadata")) else \
            [s for s in (ACCELERATE_MODEL_DIR, ACCELERATE_OPTIMIZER_DIR) if os.path.isdir(os.path.join(self.folder, s))]
        if not subs:
            raise CheckpointError(f"{self.folder}: no DCP .metadata (nor Accelerate's {ACCELERATE_MODEL_DIR}/)")
        self.accelerate = subs != [""]
        self.parts = [_Part(self.folder, s, trust) for s in subs]
        self._entries: Dict[str, Tuple[_Part, Any]] = {}  # key -> (part, its metadata entry)
        self._chunks: Dict[str, List[str]] = {}  # key -> the files of its chunks
        self._needed: Dict[str, int] = {}  # file -> bytes its entries need
        self._checked: Dict[str, str] = {}
        self._cache: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)
        self._stored: Dict[str, List[Any]] = {}  # key -> its storage records (_StorageInfo)
        for part in self.parts:
            try:
                self._index(part)
            except (TypeError, AttributeError, ValueError) as exc:  # a metadata of the right classes, wrong shape
                raise CheckpointError(f"{part.folder}/.metadata: not a DCP checkpoint's metadata "
                                      f"({type(exc).__name__}: {exc})") from None
        files = sorted(self._needed)
        self.ranks = _ranks(files)
        params, groups, state_keys, scalar_keys, buffers = self._layout(parameters)
        step = None
        for p in params:
            if p.trainable and "step" in scalar_keys:
                s = self._state_scalar(p.name, "step")
                if s is not None:
                    step = int(s)
                    break
        sharded = self.accelerate or any(len(c) > 1 for c in self._chunks.values())
        what = "FSDP2 (DCP) checkpoint" if sharded else "torch.distributed.checkpoint (DCP) checkpoint"
        self.summary = f"{what}, {self.ranks} rank{'s' if self.ranks != 1 else ''}" + \
            (f", step {step}" if step is not None else "")
        super().__init__(self.folder, f"{'an' if sharded else 'a'} {what}", self.ranks, step, params, groups, state_keys, scalar_keys,
                         buffers)

    def describe(self) -> str:
        """"FSDP2 (DCP) checkpoint, 2 ranks, step 3"."""
        return self.summary

    # ------------------------------------------------------------------------------------------ metadata
    def _index(self, part: _Part) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for key, md in part.meta.state_dict_metadata.items():
            if key in self._entries:
                raise CheckpointError(f"{self.folder}: {key} is in two DCP folders: mixed checkpoints")
            self._entries[key] = (part, md)
        for index, info in part.meta.storage_data.items():
            fname = part.file(info.relative_path)
            if int(info.offset) < 0 or int(info.length) < 0:
                raise ValueError(f"{index.fqn} stored at offset {info.offset}, length {info.length}")
            self._needed[fname] = max(self._needed.get(fname, 0), int(info.offset) + int(info.length))
            self._stored.setdefault(index.fqn, []).append(info)
            entry = self._entries.get(index.fqn)
            if entry is None:
                raise CheckpointError(f"{part.folder}/.metadata: data of {index.fqn!r} is recorded, the key is not")
            md = entry[1]
            if isinstance(md, TensorStorageMetadata):
                if not any(list(c.offsets) == list(index.offset or ()) for c in md.chunks):
                    raise CheckpointError(f"{part.folder}/.metadata: {index.fqn} has data at {list(index.offset)} "
                                          f"but no such chunk: damaged metadata")
            self._chunks.setdefault(index.fqn, []).append(fname)

    def _is_tensor(self, key: str) -> bool:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return key in self._entries and isinstance(self._entries[key][1], TensorStorageMetadata)

    def _size(self, key: str) -> List[int]:
        return [int(d) for d in self._entries[key][1].size]

    def _layout(self, parameters: Optional[Mapping[str, Sequence[str]]]):
        keys = list(self._entries)
        optim = next((p for p in _OPTIM_PREFIXES if any(k.startswith(p + "state.") or
                                                        k.startswith(p + "param_groups.") for k in keys)), None)
        state: Dict[str, Dict[str, str]] = {}  # FQN -> state key -> checkpoint key
        nested: Dict[int, Dict[str, str]] = {}  # group index -> hyper-parameter -> key
        flat: Dict[str, Dict[str, str]] = {}  # FQN -> hyper-parameter -> key (flattened optimizer state)
        if optim is not None:
            for k in keys:
                if k.startswith(optim + "state."):
                    fqn, _, sk = k[len(optim) + 6:].rpartition(".")
                    state.setdefault(fqn, {})[sk] = k
                elif k.startswith(optim + "param_groups."):
                    where, _, hp = k[len(optim) + 13:].rpartition(".")
                    if where.isdigit():
                        nested.setdefault(int(where), {})[hp] = k
                    else:
                        flat.setdefault(where, {})[hp] = k
        group_of: Dict[str, int] = {}
        for gi in sorted(nested):
            if "params" in nested[gi]:
                for fqn in self._bytes(nested[gi]["params"]) or []:
                    group_of.setdefault(str(fqn), gi)
        trained = list(dict.fromkeys([*state, *group_of, *flat]))
        tensor_keys = [k for k in keys if self._is_tensor(k) and not (optim and k.startswith(optim))]
        if any("model." + f in self._entries for f in trained):
            prefix = "model."
        elif any(f in self._entries for f in trained):
            prefix = ""
        else:
            prefix = "model." if tensor_keys and all(k.startswith("model.") for k in tensor_keys) else ""
        self._model_prefix, self._state = prefix, state
        model = [k[len(prefix):] for k in tensor_keys if k.startswith(prefix) and
                 (prefix or not k.startswith(_NOT_MODEL))]
        if not model:
            raise CheckpointError(f"{self.folder}: a DCP checkpoint without model weights (keys: {keys[:5]}...)")
        missing = [f for f in trained if f not in model]
        if missing:
            raise CheckpointError(f"{self.folder}: optimizer state for {missing[:5]}, which the checkpoint's model "
                                  f"weights lack: damaged, or the model was saved elsewhere")
        # parameters, their aliases, buffers
        params: List[ParamInfo] = []
        taken: Set[str] = set()
        if parameters is not None:
            for first, names in parameters.items():
                names = list(dict.fromkeys([first, *names]))
                present = [n for n in names if n in model]
                if not present:
                    continue
                name = next((n for n in present if n in trained), present[0])
                params.append(self._param(name, [n for n in names if n != name], name in trained))
                taken.update(names)
        else:
            order = {n: i for i, n in enumerate(model)}
            for name in sorted(trained, key=order.__getitem__):  # the model's order, not the optimizer's
                params.append(self._param(name, [], True))
                taken.add(name)
            for name in (n for n in model if n not in taken):
                tie = self._tie(name, params)
                if tie is not None:
                    tie.aliases.append(name)
                    taken.add(name)
                elif len(self._chunks.get(prefix + name, ())) > 1:  # FSDP2 shards parameters, not buffers
                    params.append(self._param(name, [], False))
                    taken.add(name)
            params.sort(key=lambda p: order[p.name])
        buffers = [{"name": n, "aliases": [n], "shape": self._size(prefix + n),
                    "dtype": str(self._entries[prefix + n][1].properties.dtype).replace("torch.", "")}
                   for n in model if n not in taken]
        # parameter groups
        if nested:
            groups = [{hp: json_value(self._value(k)) for hp, k in nested[gi].items() if hp in HYPER_PARAMETERS}
                      for gi in sorted(nested)]
            index = {gi: i for i, gi in enumerate(sorted(nested))}
            for p in params:
                p.group = index.get(group_of.get(p.name, min(nested)), 0)
        elif flat:
            groups, seen = [], {}
            for p in params:
                if p.name not in flat:
                    continue
                hp = {h: json_value(self._value(k)) for h, k in flat[p.name].items() if h in HYPER_PARAMETERS}
                sig = repr(sorted(hp.items()))
                if sig not in seen:
                    seen[sig] = len(groups)
                    groups.append(hp)
                p.group = seen[sig]
        else:
            groups = [{}]
        kinds = {sk for f in state for sk, k in state[f].items() if self._is_tensor(k) and
                 self._size(k) == self._size(prefix + f)}
        state_keys = [k for k in ADAM_STATE if k in kinds] + sorted(kinds - set(ADAM_STATE))
        scalar_keys = ["step"] if any("step" in s for s in state.values()) else []
        return params, groups, state_keys, scalar_keys, buffers

    def _param(self, name: str, aliases: List[str], trainable: bool) -> ParamInfo:
        key = self._model_prefix + name
        stored = self._entries[key][1].properties.dtype
        # a trained parameter reads as its master: fp32, or its own wider dtype (an fp64 model stays fp64)
        dtype = str(torch.promote_types(stored, torch.float32) if trainable else stored).replace("torch.", "")
        return ParamInfo(name, self._size(key), dtype, trainable, 0, aliases)

    def _tie(self, name: str, params: List[ParamInfo]) -> Optional[ParamInfo]:
        """The trained parameter `name` is another name of (same shape, dtype and values), if any."""
        key = self._model_prefix + name
        md = self._entries[key][1]
        if not md.properties.dtype.is_floating_point:
            return None
        for p in params:
            other = self._entries[self._model_prefix + p.name][1]
            if p.trainable and p.shape == self._size(key) and other.properties.dtype == md.properties.dtype:
                mine = self._tensor(key).clone()
                if torch.equal(mine, self._tensor(self._model_prefix + p.name)):
                    return p
        return None

    # ------------------------------------------------------------------------------------------ files
    def files_for(self, name: str, lo: int, hi: int) -> List[str]:
        """Every file of the parameter's weights and optimizer state: a range is read from the whole tensor."""
        p = self.by_name[name]
        keys = [self._model_prefix + p.name] + (list(self._state.get(p.name, {}).values()) if p.trainable else [])
        return sorted({f for key in keys for f in self._chunks.get(key, ())})

    def buffers_file(self) -> str:
        """One file holding a buffer (`_stage` opens it before reading); "" when there are no buffers."""
        for b in self.m["model"]["buffers"]:
            chunks = self._chunks.get(self._model_prefix + b["name"])
            if chunks:
                return chunks[0]
        return ""

    def open_file(self, fname: str) -> Optional[str]:
        """The file's path once it is there, inside the folder, and as long as the metadata's offsets need."""
        if not fname:
            return None
        if fname in self._checked:
            return self._checked[fname]
        path = os.path.join(self.folder, fname)
        if fname not in self._needed:
            raise CheckpointError(f"{path}: not a data file of this checkpoint's metadata")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: the DCP checkpoint's metadata records data in it; copy the "
                                  f"whole checkpoint folder")
        real = os.path.realpath(path)
        if os.path.commonpath([real, os.path.realpath(self.folder)]) != os.path.realpath(self.folder):
            raise CheckpointError(f"{path} is a symlink to {real}, outside the checkpoint folder: refusing to read it")
        size, needed = os.path.getsize(path), self._needed[fname]
        if size < needed:
            raise CheckpointError(f"{path} is {size} bytes but the DCP metadata records data up to byte {needed}: "
                                  f"the file is truncated (an interrupted copy or a full disk?)")
        self._checked[fname] = path
        return path

    def close(self) -> None:
        self._cache = (None, None)

    # ------------------------------------------------------------------------------------------ reads
    def _files_of(self, key: str) -> List[str]:
        return sorted(set(self._chunks.get(key, ())))

    def _tensor(self, key: str) -> torch.Tensor:
        """The whole tensor `key`, read by DCP's reader (the last one read is kept)."""
        if self._cache[0] == key:
            return self._cache[1]
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        self._cache = (None, None)  # at most one parameter's tensor held
        files = self._files_of(key)
        for fname in files:
            self.open_file(fname)
        part, md = self._entries[key]
        self._check_chunks(key, md)
        state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
        try:
            with warnings.catch_warnings():  # no_dist is meant: each rank reads its own parameters
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, storage_reader=part.reader, planner=DefaultLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as caught:  # DCP wraps a reader's error (a BaseException)
            failures = list(caught.failures.values()) if isinstance(caught, CheckpointException) else []
            exc = failures[0][0] if failures else caught
            where = ", ".join(os.path.join(self.folder, f) for f in files)
            text = str(exc)
            if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in text:
                raise UntrustedPickleError(  # DCP writes a tensor as weights-only data: trusting would not help
                    f"{where}: refused to unpickle {key} ({refusal_reason(exc)}): DCP never writes a tensor that needs "
                    f"more than torch.load(weights_only=True); a damaged or hostile data file") from None
            raise CheckpointError(f"{where}: reading {key} failed ({type(exc).__name__}: "
                                  f"{text.strip().splitlines()[0] if text.strip() else ''}): damaged data file?") \
                from None
        self._cache = (key, state[key])
        return state[key]

    def _check_chunks(self, key: str, md: Any) -> None:
        """The chunks tile the tensor and their data is at least their size, before any memory is taken for it
        (DCP would leave a gap's elements as torch.empty found them)."""
        size = [int(d) for d in md.size]
        numel = 1
        for d in size:
            numel *= d
        stored = sum(int(i.length) for i in self._stored.get(key, ()))
        where = f"{os.path.join(self.folder, self._entries[key][0].sub, '.metadata')}"
        if numel * md.properties.dtype.itemsize > stored:
            raise CheckpointError(f"{where}: {key} is {size} ({md.properties.dtype}) but its data files hold "
                                  f"{stored} bytes of it: damaged metadata")
        covered, total = torch.zeros(size, dtype=torch.int8), 0
        for c in md.chunks:
            offsets, sizes = [int(o) for o in c.offsets], [int(n) for n in c.sizes]
            if len(offsets) != len(size) or any(o < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
                raise CheckpointError(f"{where}: a chunk of {key} at {offsets} of {sizes} lies outside its {size}")
            covered[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = 1
            total += covered[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].numel()
        if total != numel or not bool(covered.all()):  # every element, none twice
            raise CheckpointError(f"{where}: the chunks of {key} do not cover it exactly once: damaged metadata")

    def _bytes(self, key: str) -> Any:
        """A bytes entry (a torch.save'd value), read with no code run from it."""
        part, _ = self._entries[key]
        infos = self._stored.get(key)
        if not infos:
            raise CheckpointError(f"{part.folder}/.metadata records {key} but no data for it: damaged metadata")
        info = infos[0]
        fname = part.file(info.relative_path)
        path = self.open_file(fname)
        with open(path, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        stream: Any = io.BytesIO(data)
        if info.transform_descriptors:  # zstd, as DCP's own reader undoes it
            stream = part.reader.transforms.transform_load_stream(None, info.transform_descriptors, stream)
            stream = io.BytesIO(stream.read())
        stream.name = f"{path} ({key})"
        try:
            return load_without_code(stream, TRUST, self.trust, map_location="cpu")
        except UntrustedPickleError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: {key} is not readable ({type(exc).__name__}); damaged data file?") \
                from None

    def _value(self, key: str) -> Any:
        return self._tensor(key).clone() if self._is_tensor(key) else self._bytes(key)

    def _state_scalar(self, fqn: str, key: str) -> Optional[float]:
        k = self._state.get(fqn, {}).get(key)
        if k is None:
            return None
        value = self._value(k)
        return float(value) if value is not None else None

    def _read(self, p: ParamInfo, kind: str, lo: int, hi: int) -> Optional[torch.Tensor]:
        if kind == "values":
            key = self._model_prefix + p.name
        else:
            key = self._state.get(p.name, {}).get(kind.split(".", 1)[1])
            if key is None:
                return None
        out = self._tensor(key).reshape(-1)[lo:hi]
        return out.to(torch.promote_types(out.dtype, torch.float32), copy=True) if p.trainable else out.clone()

    def _scalar(self, p: ParamInfo, key: str) -> Optional[float]:
        return self._state_scalar(p.name, key)

    def _buffer(self, name: str) -> torch.Tensor:
        b = next((b for b in self.m["model"]["buffers"] if name in b["aliases"]), None)
        if b is None:
            raise CheckpointError(f"{self.folder}: no buffer {name} in the checkpoint")
        return self._tensor(self._model_prefix + b["name"]).clone()
