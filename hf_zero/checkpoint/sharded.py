"""Sharded training checkpoints: one safetensors file per rank plus a JSON manifest. No pickle anywhere.

Every saved tensor is a range of a group's flat index space (master weights, frozen weights, each optimizer
state), and the manifest records where every parameter sits in that space. Loading at another world size, stage
or bucket size is interval arithmetic: for each range a rank now owns, find the parameter, find where it was
saved, and read just those byte ranges from just the files that hold them (plain reads into fresh tensors; a
safe_open slice would keep the file's pages resident).

Rank 0's file also holds the model's persistent buffers, and the manifest records the model's state-dict layout
(every `model.state_dict()` key in order, tied-weight declarations, config), so `export.export_pretrained` can write
the Hugging Face layout from the files alone, with no process group and no model code.

A save goes to a temporary folder that is renamed into place once every file and the manifest are written; ranks
agree on success before the rename, so a failure on any rank (or a crash) leaves the previous checkpoint whole.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import safetensors.torch as _st  # called as _st.save_file so a test can patch safetensors.torch.save_file
import torch
import torch.distributed as dist
from safetensors import safe_open

from .layout import dtype_name, persistent_buffers, model_config_texts, model_layout

if TYPE_CHECKING:
    from ..engine import ZeroEngine

FORMAT_VERSION = 2  # 2: persistent buffers in rank 0's file, the model's state-dict layout, file sizes
MANIFEST = "manifest.json"
BUFFER_PREFIX = "buffer."
logger = logging.getLogger("hf_zero")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not belong to this model; the message says which."""


def _rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, tuple):
        return list(v)
    return v


# ---------------------------------------------------------------------------------------------- save
def _rank_tensors(engine: "ZeroEngine", buffers: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This rank's ranges: per group the master (trainable) or compute (frozen) shard and each optimizer state;
    on rank 0 also the persistent buffers."""
    rank = engine.comm.rank
    out: Dict[str, torch.Tensor] = {}
    seg_by_group: Dict[int, list] = {}
    for seg in engine.optimizer.segments:
        seg_by_group.setdefault(seg.group.plan.index, []).append(seg)
    for g in engine.groups:
        gi = g.plan.index
        if g.plan.shard_numel == g.plan.padded_numel and rank != 0:
            continue  # not partitioned (stage 0): rank 0 writes it once
        out[f"g{gi}.values"] = (g.master if g.plan.trainable else g.shard).detach().to("cpu").contiguous()
        for seg in seg_by_group.get(gi, []):
            for key, value in engine.optimizer.state.get(seg.tensor, {}).items():
                if not torch.is_tensor(value):
                    continue
                if value.dim() == 0:  # per-parameter scalar (Adam's step): one slot per group slot
                    name = f"g{gi}.scalar.{key}"
                    if name not in out:
                        out[name] = torch.full((len(g.plan.slots),), float("nan"), dtype=torch.float64)
                    out[name][g.plan.slots.index(seg.slot)] = float(value)
                else:
                    name = f"g{gi}.state.{key}"
                    if name not in out:
                        out[name] = torch.zeros(g.plan.shard_numel, dtype=value.dtype)
                    out[name][seg.start:seg.end] = value.detach().to("cpu").reshape(-1)
    if rank == 0:
        for name, b in buffers.items():
            out[BUFFER_PREFIX + name] = b.detach().to("cpu").contiguous()
    return out


def plan_manifest(engine: "ZeroEngine") -> List[Dict[str, Any]]:
    """The flat groups as the manifest records them (also the layout the online export reads)."""
    return [
        {
            "index": g.index, "unit": g.unit, "dtype": dtype_name(g.dtype), "trainable": g.trainable,
            "numel": g.numel, "padded_numel": g.padded_numel, "shard_numel": g.shard_numel,
            "master_dtype": dtype_name(engine.groups[g.index].master.dtype) if g.trainable else None,
            "slots": [
                {"name": s.name, "aliases": list(s.aliases), "shape": list(s.shape),
                 "dtype": dtype_name(s.orig_dtype), "offset": s.offset, "numel": s.numel}
                for s in g.slots
            ],
        }
        for g in engine.plan.groups
    ]


def _manifest(engine: "ZeroEngine", files: Dict[str, str], sizes: Dict[str, int], step: Optional[int],
              layout: Dict[str, Any]) -> Dict[str, Any]:
    opt = engine.optimizer
    name_of = {id(seg.tensor): seg.slot.name for seg in opt.segments}
    groups_hp = []
    for group in opt.param_groups:
        hp = {k: _json_value(v) for k, v in group.items() if k != "params"}
        groups_hp.append(hp)
    return {
        "format": "hf_zero-sharded",
        "format_version": FORMAT_VERSION,
        "world_size": engine.comm.world_size,
        "stage": engine.config.stage,
        "config": engine.config.to_dict(),
        "step": step,
        "groups": plan_manifest(engine),
        "model": layout,
        "optimizer": {
            "class": engine.optimizer.user_optimizer_class.__name__,
            "param_groups": groups_hp,
            # which user group each parameter is optimised in (by name, so the layout may change)
            "param_group_of": {name_of[id(p)]: gi for gi, grp in enumerate(opt.param_groups) for p in grp["params"]},
        },
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "files": files,
        "file_bytes": sizes,
    }


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def save_checkpoint(engine: "ZeroEngine", directory: os.PathLike, step: Optional[int] = None) -> Path:
    """Collective. Write this rank's shards and (rank 0) the manifest, the persistent buffers and the model's
    config into `directory`, atomically: the ranks agree that every file was written before rank 0 renames the
    temporary folder into place, so a failure on any rank raises CheckpointError on every rank and leaves the
    previous checkpoint in `directory` untouched."""
    directory = Path(directory)
    comm = engine.comm
    multi = comm.distributed and comm.world_size > 1
    engine.wait()  # no reduction of the engine's may still be in flight beside the checkpoint's own collectives
    tmp_name = [f"{directory.name}.tmp-{uuid.uuid4().hex[:8]}"]
    if multi:
        dist.broadcast_object_list(tmp_name, src=comm.global_rank(0), group=comm.group)
    tmp = directory.parent / tmp_name[0]
    layout, buffers = model_layout(engine)
    fname = _rank_file(comm.rank, comm.world_size)
    mine: Tuple[Dict[str, str], Dict[str, int], List[str], Optional[str]] = ({}, {}, [], None)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        tensors = _rank_tensors(engine, buffers)
        _st.save_file(tensors, str(tmp / fname), metadata={"format": "hf_zero-sharded"})
        mine = ({fname: _sha256(tmp / fname)}, {fname: (tmp / fname).stat().st_size}, list(tensors), None)
        del tensors
    except Exception as exc:  # every rank must hear about it, or the others would rename a partial checkpoint
        mine = ({}, {}, [], _describe(exc))
    results = [mine]
    if multi:
        results = [None] * comm.world_size  # type: ignore[list-item]
        dist.all_gather_object(results, mine, group=comm.group)
    failures = [f"rank {r}: {err}" for r, (_, _, _, err) in enumerate(results) if err]
    if comm.rank == 0:
        if not failures:
            try:
                files = {k: v for d, _, _, _ in results for k, v in d.items()}
                sizes = {k: v for _, d, _, _ in results for k, v in d.items()}
                manifest = _manifest(engine, files, sizes, step, layout)
                _record_state_keys(manifest, [k for _, _, keys, _ in results for k in keys])
                for name, text in model_config_texts(engine.model, layout["dtype"]).items():
                    (tmp / name).write_bytes(text)
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
                swap_into_place(tmp, directory)
            except Exception as exc:
                failures.append(f"rank 0: {_describe(exc)}")
        if failures:
            shutil.rmtree(tmp, ignore_errors=True)
    status = [failures]
    if multi:
        dist.broadcast_object_list(status, src=comm.global_rank(0), group=comm.group)
    if status[0]:
        raise CheckpointError(f"saving the checkpoint to {directory} failed ({'; '.join(status[0])}); nothing was "
                              f"renamed into place, so {directory} holds the previous checkpoint (if any) unchanged")
    return directory


def _record_state_keys(manifest: Dict[str, Any], names: List[str]) -> None:
    """Per group, the optimizer-state keys any rank saved (so a loading rank opens only the files it needs)."""
    for g in manifest["groups"]:
        g["state_keys"], g["scalar_keys"] = [], []
    for name in names:
        m = re.fullmatch(r"g(\d+)\.(state|scalar)\.(.+)", name)
        if m:
            keys = manifest["groups"][int(m.group(1))][f"{m.group(2)}_keys"]
            if m.group(3) not in keys:
                keys.append(m.group(3))
    for g in manifest["groups"]:
        g["state_keys"].sort()
        g["scalar_keys"].sort()


def swap_into_place(tmp: Path, directory: Path) -> None:
    """Rename `tmp` to `directory`, replacing an existing `directory` (restored if the second rename fails)."""
    old = None
    if directory.exists():
        old = directory.parent / f"{directory.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(directory, old)
    try:
        os.replace(tmp, directory)
    except BaseException:
        if old is not None:
            os.replace(old, directory)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- load
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch.save zip, pickle


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class _RankFile:
    """Reads ranges of a (validated) safetensors file with plain reads into fresh tensors.

    safe_open().get_slice() returns memory backed by the file mapping, so every page read stays in the process's
    RSS while the tensor lives (and the handle is open); plain reads keep host memory to the tensors asked for,
    which the bounded-memory export relies on. The format is an 8-byte little-endian header length, a JSON header
    {name: {dtype, shape, data_offsets}} and the data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.base = 8 + n
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        for k, v in self.entries.items():
            begin, end = v["data_offsets"]
            if v["dtype"] not in _ST_DTYPES or not 0 <= begin <= end <= size - self.base:
                raise CheckpointError(f"{path}: tensor {k} ({v['dtype']}, bytes {begin}..{end}) lies outside the file "
                                      f"or has an unsupported dtype: damaged checkpoint")

    def keys(self) -> List[str]:
        return list(self.entries)

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor `key`."""
        e = self.entries[key]
        dtype = _ST_DTYPES[e["dtype"]]
        item = torch.empty((), dtype=dtype).element_size()
        begin, end = e["data_offsets"]
        if not 0 <= lo <= hi <= (end - begin) // item:
            raise CheckpointError(f"{self.path}: elements {lo}..{hi} of {key} requested, it has {(end - begin) // item}")
        out = torch.empty(hi - lo, dtype=dtype)
        if hi > lo:
            view = memoryview(out.view(torch.uint8).numpy())
            with open(self.path, "rb") as f:
                f.seek(self.base + begin + lo * item)
                if f.readinto(view) != view.nbytes:
                    raise CheckpointError(f"{self.path}: short read of {key}: the file is truncated")
        return out

    def tensor(self, key: str) -> torch.Tensor:
        e = self.entries[key]
        numel = 1
        for d in e["shape"]:
            numel *= d
        return self.read(key, 0, numel).view(e["shape"])


class CheckpointSource:
    """The saved layout: where each parameter's elements live, and reading flat ranges from rank files (each
    rank file is checked once: present, the size and SHA-256 the manifest records, safetensors, not a pickle)."""

    def __init__(self, directory: Path, manifest: Dict[str, Any], verify: bool = True) -> None:
        self.dir, self.m, self.verify = directory, manifest, verify
        self.world = manifest["world_size"]
        self.groups = manifest["groups"]
        self.where: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {}
        for g in self.groups:
            for s in g["slots"]:
                self.where[s["name"]] = (g, s)
        self._handles: Dict[str, Any] = {}

    def _open(self, fname: str) -> "_RankFile":
        if fname not in self._handles:
            self._handles[fname] = _RankFile(self.check_file(fname))
        return self._handles[fname]

    def close(self) -> None:
        """Drop the open rank files (their memory maps)."""
        self._handles.clear()

    def check_file(self, fname: str) -> Path:
        """The rank file's path once it exists, is the file the manifest describes, and is safetensors."""
        path = self.dir / fname
        if not path.is_file():
            raise CheckpointError(f"{self.dir}: rank file {fname} is missing (the checkpoint was saved by "
                                  f"{self.world} ranks; every rank file is needed)")
        with open(path, "rb") as f:
            head = f.read(8)
        if head.startswith(_PICKLE_MAGIC):
            raise CheckpointError(f"{path} is a pickle (torch.save) file, not safetensors: hf_zero checkpoints never "
                                  f"contain pickles and never load one (it could run code)")
        files = self.m.get("files") or {}
        if self.m.get("format_version", 1) >= 2 and fname not in files:
            raise CheckpointError(f"{path}: the manifest does not list this rank file; the folder mixes checkpoints")
        size, expected_size = path.stat().st_size, (self.m.get("file_bytes") or {}).get(fname)
        if expected_size is not None and size != expected_size:
            raise CheckpointError(f"{path} is {size} bytes but the manifest says {expected_size}: the file is "
                                  f"{'truncated' if size < expected_size else 'longer than saved'} (an interrupted "
                                  f"copy or a full disk?)")
        if self.verify and fname in files and _sha256(path) != files[fname]:
            raise CheckpointError(f"{path}: checksum mismatch: the file is damaged or was modified after the save")
        if size < 8 or int.from_bytes(head, "little") + 8 > size:
            raise CheckpointError(f"{path} is not a safetensors file (bad header)")
        try:
            safe_open(str(path), framework="pt")
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
        return path

    def read(self, name: str, kind: str, lo: int, hi: int) -> Optional[torch.Tensor]:
        """Elements [lo, hi) of parameter `name` (kind "values" or "state.<key>"); None if that state is absent."""
        g, s = self.where[name]
        start, end = s["offset"] + lo, s["offset"] + hi
        shard = g["shard_numel"]
        partitioned = shard != g["padded_numel"]
        parts = []
        while start < end:
            r = start // shard if partitioned else 0
            r_lo = r * shard if partitioned else 0
            stop = min(end, r_lo + shard)
            f = self._open(_rank_file(r, self.world))
            key = f"g{g['index']}.{kind}"
            if key not in f.keys():
                if kind == "values":
                    raise CheckpointError(f"{self.dir / _rank_file(r, self.world)} lacks {key}: damaged checkpoint")
                return None
            parts.append(f.read(key, start - r_lo, stop - r_lo))
            start = stop
        if not parts:
            return torch.empty(0)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def buffer(self, name: str) -> torch.Tensor:
        f = self._open(_rank_file(0, self.world))
        key = BUFFER_PREFIX + name
        if key not in f.keys():
            raise CheckpointError(f"{self.dir / _rank_file(0, self.world)} lacks the buffer {name}: damaged checkpoint")
        return f.tensor(key)

    def scalar(self, name: str, key: str) -> Optional[float]:
        g, s = self.where[name]
        slot_index = g["slots"].index(s)
        partitioned = g["shard_numel"] != g["padded_numel"]
        first = s["offset"] // g["shard_numel"] if partitioned else 0
        ranks = [first] + [r for r in range(self.world) if r != first] if partitioned else [0]
        for r in ranks:
            f = self._open(_rank_file(r, self.world))
            k = f"g{g['index']}.scalar.{key}"
            if k in f.keys():
                v = float(f.read(k, slot_index, slot_index + 1)[0])
                if v == v:  # not NaN: this rank held a segment of the parameter
                    return v
        return None


def _check_model(engine: "ZeroEngine", src: CheckpointSource, directory: Path) -> None:
    mine = {s.name: s for g in engine.plan.groups for s in g.slots}
    saved = {s["name"]: s for g in src.groups for s in g["slots"]}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    shapes = [f"{n}: saved {saved[n]['shape']} vs model {list(mine[n].shape)}"
              for n in sorted(set(mine) & set(saved)) if list(mine[n].shape) != saved[n]["shape"]]
    saved_model = src.m.get("model")
    if saved_model is not None:  # format 2: persistent buffers too
        _, buffers = persistent_buffers(engine.model)
        mine_b = {names[0]: b for b, names in buffers.values()}
        saved_b = {b["name"]: b for b in saved_model["buffers"]}
        missing += [f"buffer {n}" for n in sorted(set(mine_b) - set(saved_b))]
        unexpected += [f"buffer {n}" for n in sorted(set(saved_b) - set(mine_b))]
        shapes += [f"buffer {n}: saved {saved_b[n]['shape']} vs model {list(mine_b[n].shape)}"
                   for n in sorted(set(mine_b) & set(saved_b)) if list(mine_b[n].shape) != saved_b[n]["shape"]]
    if missing or unexpected or shapes:
        what = saved_model["class"] if saved_model else "another model"
        raise CheckpointError(
            f"{directory} was saved from another model ({what}; this one is {type(engine.model).__name__}): "
            + "; ".join(filter(None, [
                f"missing parameters {missing[:5]}{'...' if len(missing) > 5 else ''}" if missing else "",
                f"unexpected parameters {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}" if unexpected else "",
                f"shape mismatches {shapes[:5]}" if shapes else "",
            ]))
        )
    cls = engine.optimizer.user_optimizer_class.__name__
    if src.m["optimizer"]["class"] != cls:
        raise CheckpointError(f"{directory} holds {src.m['optimizer']['class']} state but the optimizer is {cls}")


def read_manifest(directory: os.PathLike) -> Dict[str, Any]:
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        olds = sorted(directory.parent.glob(f"{directory.name}.old-*")) if directory.parent.is_dir() else []
        hint = f" ({olds[-1]} holds the checkpoint it replaced: a save was interrupted mid-rename)" if olds else ""
        raise CheckpointError(f"{directory} does not exist{hint}")
    if not path.is_file():
        raise CheckpointError(f"{directory} is not an hf_zero checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "hf_zero-sharded" \
            or manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r} "
                              f"v{manifest.get('format_version')}" if isinstance(manifest, dict) else
                              f"{path}: not an hf_zero manifest")
    return manifest


@torch.no_grad()
def load_checkpoint(engine: "ZeroEngine", directory: os.PathLike, verify: bool = True) -> Dict[str, Any]:
    """Collective. Restore weights, persistent buffers, optimizer state and loss scale into `engine`, whatever
    world size or stage the checkpoint was saved at. Returns the manifest. `verify` checks each rank file read
    against the manifest's SHA-256 (sizes are always checked)."""
    directory = Path(directory)
    src = CheckpointSource(directory, read_manifest(directory), verify=verify)
    _check_model(engine, src, directory)
    rank = engine.comm.rank
    engine.zero_grad()
    # Weights: every group's owned range, parameter by parameter.
    for g in engine.groups:
        dst = g.master if g.plan.trainable else g.shard
        lo, hi = g.plan.owned_range(rank)
        for slot in g.plan.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                vals = src.read(slot.name, "values", a - slot.offset, b - slot.offset)
                dst[a - lo:b - lo].copy_(vals)
        g.write_master_to_shard()
    if src.m.get("model") is not None:
        for b in src.m["model"]["buffers"]:
            engine.model.get_buffer(b["name"]).copy_(src.buffer(b["name"]))
    # Optimizer state, segment by segment.
    opt = engine.optimizer
    state_keys = {g["index"]: _keys(src, g, "state") for g in src.groups}
    scalar_keys = {g["index"]: _keys(src, g, "scalar") for g in src.groups}
    for seg in opt.segments:
        g, slot = seg.group, seg.slot
        base = g.lo + seg.start - slot.offset
        state: Dict[str, Any] = {}
        sg, _ = src.where[slot.name]
        for key in state_keys[sg["index"]]:
            v = src.read(slot.name, f"state.{key}", base, base + (seg.end - seg.start))
            if v is not None:
                state[key] = v.to(device=seg.tensor.device, dtype=seg.tensor.dtype if v.is_floating_point() else v.dtype)
        for key in scalar_keys[sg["index"]]:
            v = src.scalar(slot.name, key)
            if v is not None:
                state[key] = torch.tensor(v, dtype=torch.float32)
        if state:
            opt.state[seg.tensor] = state
        else:
            opt.state.pop(seg.tensor, None)
    saved_groups = src.m["optimizer"]["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise CheckpointError(f"{directory}: {len(saved_groups)} optimizer parameter groups saved, the optimizer "
                              f"has {len(opt.param_groups)}")
    for group, hp in zip(opt.param_groups, saved_groups):
        for k, v in hp.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    if engine.scaler is not None and src.m.get("loss_scaler"):
        engine.scaler.load_state_dict(src.m["loss_scaler"])
    # Stages 1/2 hold full parameters: refresh them from the restored shards.
    if engine.config.stage in (1, 2) and engine.comm.world_size > 1:
        for g in engine.groups:
            engine.comm.all_gather(g.full, g.shard, f"load {g.plan.index}", async_op=False)
    return src.m


def _keys(src: CheckpointSource, g: Dict[str, Any], kind: str) -> List[str]:
    """The optimizer-state keys saved for group `g`, from every rank file that holds a part of it (a rank whose
    range holds no optimised parameter wrote none)."""
    if f"{kind}_keys" in g:  # format 2 records them
        return list(g[f"{kind}_keys"])
    prefix = f"g{g['index']}.{kind}."
    partitioned = g["shard_numel"] != g["padded_numel"]
    keys = set()
    for r in range(src.world if partitioned else 1):
        f = src._open(_rank_file(r, src.world))
        keys.update(k[len(prefix):] for k in f.keys() if k.startswith(prefix))
    return sorted(keys)
