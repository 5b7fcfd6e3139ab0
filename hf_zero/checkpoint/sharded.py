"""Sharded training checkpoints: one safetensors file per rank plus a JSON manifest. No pickle anywhere.

Every saved tensor is a range of a group's flat index space (master weights, frozen weights, each optimizer
state), and the manifest records where every parameter sits in that space. Loading at another world size, stage
or bucket size is interval arithmetic: for each range a rank now owns, find the parameter, find where it was
saved, and read just those slices (`safe_open(...).get_slice`) from just the files that hold them.

A save goes to a temporary folder that is renamed into place once every file and the manifest are written, so a
crash mid-save leaves the previous checkpoint whole.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

if TYPE_CHECKING:
    from ..engine import ZeroEngine

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, tuple):
        return list(v)
    return v


# ---------------------------------------------------------------------------------------------- save
def _rank_tensors(engine: "ZeroEngine") -> Dict[str, torch.Tensor]:
    """This rank's ranges: per group the master (trainable) or compute (frozen) shard and each optimizer state."""
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
    return out


def _manifest(engine: "ZeroEngine", files: Dict[str, str], step: Optional[int]) -> Dict[str, Any]:
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
        "groups": [
            {
                "index": g.index, "unit": g.unit, "dtype": _dtype_name(g.dtype), "trainable": g.trainable,
                "numel": g.numel, "padded_numel": g.padded_numel, "shard_numel": g.shard_numel,
                "master_dtype": _dtype_name(engine.groups[g.index].master.dtype) if g.trainable else None,
                "slots": [
                    {"name": s.name, "aliases": list(s.aliases), "shape": list(s.shape),
                     "dtype": _dtype_name(s.orig_dtype), "offset": s.offset, "numel": s.numel}
                    for s in g.slots
                ],
            }
            for g in engine.plan.groups
        ],
        "optimizer": {
            "class": engine.optimizer.user_optimizer_class.__name__,
            "param_groups": groups_hp,
            # which user group each parameter is optimised in (by name, so the layout may change)
            "param_group_of": {name_of[id(p)]: gi for gi, grp in enumerate(opt.param_groups) for p in grp["params"]},
        },
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "files": files,
    }


def save_checkpoint(engine: "ZeroEngine", directory: os.PathLike, step: Optional[int] = None) -> Path:
    """Collective. Write this rank's shards and (rank 0) the manifest into `directory`, atomically."""
    directory = Path(directory)
    comm = engine.comm
    engine.reducer.finalize() if engine.reducer.inflight else None
    tmp_name = [f"{directory.name}.tmp-{uuid.uuid4().hex[:8]}"]
    if comm.distributed and comm.world_size > 1:
        dist.broadcast_object_list(tmp_name, src=_global(comm, 0), group=comm.group)
    tmp = directory.parent / tmp_name[0]
    tmp.mkdir(parents=True, exist_ok=True)
    fname = _rank_file(comm.rank, comm.world_size)
    save_file(_rank_tensors(engine), str(tmp / fname), metadata={"format": "hf_zero-sharded"})
    digest = {fname: _sha256(tmp / fname)}
    digests: List[Dict[str, str]] = [digest]
    if comm.distributed and comm.world_size > 1:
        digests = [None] * comm.world_size  # type: ignore[list-item]
        dist.all_gather_object(digests, digest, group=comm.group)
    if comm.rank == 0:
        files = {k: v for d in digests for k, v in d.items()}
        manifest = _manifest(engine, files, step)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        old = None
        if directory.exists():
            old = directory.parent / f"{directory.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old)
    if comm.distributed and comm.world_size > 1:
        dist.barrier(group=comm.group)
    return directory


def _global(comm, rank: int) -> int:
    return dist.get_global_rank(comm.group, rank) if comm.group is not None else rank


# ---------------------------------------------------------------------------------------------- load
class _Source:
    """The saved layout: where each parameter's elements live, and reading flat ranges from rank files."""

    def __init__(self, directory: Path, manifest: Dict[str, Any]) -> None:
        self.dir, self.m = directory, manifest
        self.world = manifest["world_size"]
        self.groups = manifest["groups"]
        self.where: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {}
        for g in self.groups:
            for s in g["slots"]:
                self.where[s["name"]] = (g, s)
        self._handles: Dict[str, Any] = {}
        self._verified: set = set()

    def _open(self, fname: str):
        if fname not in self._handles:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"{self.dir}: rank file {fname} is missing (the checkpoint was saved by "
                                      f"{self.world} ranks; every rank file is needed)")
            expected = self.m["files"].get(fname)
            if expected is not None and fname not in self._verified:
                if _sha256(path) != expected:
                    raise CheckpointError(f"{path}: checksum mismatch: the file is truncated or was modified after "
                                          f"the save")
                self._verified.add(fname)
            try:
                self._handles[fname] = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); hf_zero checkpoints "
                                      f"never contain pickles") from None
        return self._handles[fname]

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
                return None
            parts.append(f.get_slice(key)[start - r_lo:stop - r_lo])
            start = stop
        return torch.cat(parts) if len(parts) > 1 else parts[0]

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
                v = float(f.get_slice(k)[slot_index:slot_index + 1][0])
                if v == v:  # not NaN: this rank held a segment of the parameter
                    return v
        return None


def _check_model(engine: "ZeroEngine", src: _Source, directory: Path) -> None:
    mine = {s.name: s for g in engine.plan.groups for s in g.slots}
    saved = {s["name"]: s for g in src.groups for s in g["slots"]}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    shapes = [f"{n}: saved {saved[n]['shape']} vs model {list(mine[n].shape)}"
              for n in sorted(set(mine) & set(saved)) if list(mine[n].shape) != saved[n]["shape"]]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{directory} was saved from another model: "
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
    if not path.is_file():
        raise CheckpointError(f"{directory} is not an hf_zero checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if manifest.get("format") != "hf_zero-sharded" or manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r} "
                              f"v{manifest.get('format_version')}")
    return manifest


@torch.no_grad()
def load_checkpoint(engine: "ZeroEngine", directory: os.PathLike) -> Dict[str, Any]:
    """Collective. Restore weights, optimizer state and loss scale into `engine`, whatever world size or stage
    the checkpoint was saved at. Returns the manifest."""
    directory = Path(directory)
    src = _Source(directory, read_manifest(directory))
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
    # Optimizer state, segment by segment.
    opt = engine.optimizer
    for seg in opt.segments:
        g, slot = seg.group, seg.slot
        base = g.lo + seg.start - slot.offset
        state: Dict[str, Any] = {}
        sg, _ = src.where[slot.name]
        for key in _saved_state_keys(src, sg):
            v = src.read(slot.name, f"state.{key}", base, base + (seg.end - seg.start))
            if v is not None:
                state[key] = v.to(device=seg.tensor.device, dtype=seg.tensor.dtype if v.is_floating_point() else v.dtype)
        for key in _saved_scalar_keys(src, sg):
            v = src.scalar(slot.name, key)
            if v is not None:
                state[key] = torch.tensor(v, dtype=torch.float32)
        if state:
            opt.state[seg.tensor] = state
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


def _saved_state_keys(src: _Source, g: Dict[str, Any]) -> List[str]:
    return _keys(src, g, "state")


def _saved_scalar_keys(src: _Source, g: Dict[str, Any]) -> List[str]:
    return _keys(src, g, "scalar")


def _keys(src: _Source, g: Dict[str, Any], kind: str) -> List[str]:
    prefix = f"g{g['index']}.{kind}."
    f = src._open(_rank_file(0, src.world))
    return sorted(k[len(prefix):] for k in f.keys() if k.startswith(prefix))
