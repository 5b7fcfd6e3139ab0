"""Sharded training checkpoints: one safetensors file per partition plus a JSON manifest. No pickle anywhere.

Every saved tensor is a range of a group's flat index space (master weights, frozen weights, each optimizer
state), and the manifest records where every parameter sits in that space. Loading at another world size, stage
or bucket size is interval arithmetic: for each range a rank now owns, find the parameter, find where it was
saved, and read just those byte ranges from just the files that hold them (plain reads into fresh tensors; a
safe_open slice would keep the file's pages resident).

Files are named by partition (`rank{p}-of-{P}`: P is the number of ways the flat groups are split, the world size
at stages 1-3, K under HSDP's shard_group_size=K, 1 at stage 0). `buffers.safetensors` holds the model's persistent
buffers, and the manifest records the model's state-dict layout (every `model.state_dict()` key in order,
tied-weight declarations, config), so `export.export_pretrained` can write the Hugging Face layout from the files
alone, with no process group and no model code. Reading the files back (the manifest, checked rank files, flat
ranges) is source.py.

A save works whether or not the hosts share the disk under `directory` (see hosts.py): the ranks find out which of
them see each other's files, and each disk gets a complete folder for the ranks on it: the partition files they
hold (one writer per disk and partition), the manifest (the same everywhere, listing every file), the config
files and the buffers. Everything goes to a temporary folder; the ranks agree that every file on every disk was
written before any folder is renamed into place, and agree again after the renames (undoing them if one disk
failed), so a failure on any rank raises on every rank and leaves the previous checkpoint whole on every disk.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import safetensors.torch as _st  # called as _st.save_file so a test can patch safetensors.torch.save_file
import torch

from . import background, hosts
from .background import SaveHandle
from ..engine.state import group_layout, partition, persistent_buffers
from .foreign_source import ForeignSource
from .layout import model_config_texts, model_layout
from .from_dcp import parameter_names
from .open_foreign import open_foreign
from .publish import check_target, clean_leftovers, fsync_path, fsync_tree, is_checkpoint, remove, resolve, swap, unswap
from .source import (BUFFERS_FILE, FORMAT_VERSION, MANIFEST, CheckpointError, CheckpointSource, rank_file,
                     read_manifest, save_identity, sha256)

if TYPE_CHECKING:
    from ..engine import ZeroEngine
    from ..engine.comm import Comm
    from ..engine.state import ShardState

DISK_CHECKS = 3  # how often the ranks compare which markers they see before giving up (file system delays)
logger = logging.getLogger("hf_zero")



def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, tuple):
        return list(v)
    return v


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _where(comm: "Comm") -> Tuple[str, int]:
    """(host name, global rank) of this rank."""
    return hosts.host_name(), comm.global_rank(comm.rank)


def _whoami(comm: "Comm") -> str:
    return "host {}, rank {}".format(*_where(comm))


def _exchange(comm: "Comm", obj: Any) -> List[Any]:
    """Collective over the engine's group: every rank's `obj` in rank order."""
    return comm.control.exchange(obj)


# ---------------------------------------------------------------------------------------------- save
def _partition_tensors(state: "ShardState", groups: List[Dict[str, Any]], copy: bool = False,
                       reuse: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """This rank's partition: per group the master (trainable) or compute (frozen) range and each optimizer
    state over it; per-parameter scalars (Adam's step) as one slot per group slot (NaN where the partition holds
    none of the parameter).

    `copy`: every tensor is a host copy the engine's later steps cannot change (an asynchronous save writes it
    after the training goes on); copies from a GPU go to pinned memory without blocking, and one stream sync
    per device waits for them. `reuse`: an earlier call's tensors, written over where the names, shapes and dtypes
    match (fresh host memory costs a page fault per page, pinned memory a pinning: most of a copy's time). Without
    `copy` a CPU master range is returned as the engine's own tensor."""
    out: Dict[str, torch.Tensor] = {}
    devices = set()
    covered: Dict[str, List[Tuple[int, int]]] = {}

    def host(name: str, numel: int, dtype: torch.dtype, src: torch.Tensor) -> torch.Tensor:
        pinned = copy and src.is_cuda
        if pinned:
            devices.add(src.device)
        old = (reuse or {}).get(name)
        if old is not None and old.dtype == dtype and old.shape == (numel,):
            return old
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def fill(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.detach().reshape(-1), non_blocking=copy and src.is_cuda)

    for g in state.groups:
        name = f"g{g.index}.values"
        if copy:
            out[name] = t = host(name, g.values.numel(), g.values.dtype, g.values)
            fill(t, g.values)
        else:
            out[name] = g.values.detach().to("cpu").contiguous()
    for seg in state.segments:
        slots = [s["name"] for s in groups[seg.group]["slots"]]
        for key, value in seg.state.items():
            if value.dim() == 0:
                name = f"g{seg.group}.scalar.{key}"
                if name not in out:
                    out[name] = torch.full((len(slots),), float("nan"), dtype=torch.float64)
                out[name][slots.index(seg.slot)] = float(value)
            else:
                name = f"g{seg.group}.state.{key}"
                if name not in out:
                    out[name] = host(name, groups[seg.group]["shard_numel"], value.dtype, value)
                fill(out[name][seg.start:seg.end], value)
                covered.setdefault(name, []).append((seg.start, seg.end))
    for name, spans in covered.items():  # zeros where no segment is (padding): one write per element in all
        at = 0
        for a, b in sorted(spans) + [(out[name].numel(), out[name].numel())]:
            if a > at:
                out[name][at:a].zero_()
            at = max(at, b)
    for device in devices:  # the copies above were queued on the device's stream: done before training goes on
        torch.cuda.current_stream(device).synchronize()
    return out


def _buffer_bytes(buffers: Dict[str, torch.Tensor]) -> bytes:
    """buffers.safetensors' content (copies: two buffers may share storage, which safetensors refuses)."""
    tensors = {name: b.detach().to("cpu", copy=True).contiguous() for name, b in buffers.items()}
    return _st.save(tensors, metadata={"format": "hf_zero-sharded"})


def _manifest(engine: "ZeroEngine", state: "ShardState", step: Optional[int], layout: Dict[str, Any],
              partitions: int, save_id: Optional[str]) -> Dict[str, Any]:
    return {
        "format": "hf_zero-sharded",
        "format_version": FORMAT_VERSION,
        "save_id": save_id,
        "world_size": engine.comm.world_size,
        "partitions": partitions,
        "stage": engine.config.stage,
        "config": engine.config.to_dict(),
        "step": step,
        "groups": group_layout(engine),
        "model": layout,
        "optimizer": {
            "class": state.optimizer_class,
            "param_groups": [{k: _json_value(v) for k, v in hp.items()} for hp in state.param_groups],
            # which user group each parameter is optimised in (by name, so the layout may change)
            "param_group_of": state.param_group_of,
        },
        "loss_scaler": state.loss_scaler,
        "buffers_file": BUFFERS_FILE,
    }


def _record_files(manifest: Dict[str, Any], ranks: List[Tuple[str, int, int]], shards: List[Any],
                  disks: List[List[int]], buffers: bytes) -> None:
    """Every file of every disk: its SHA-256 and size, who wrote it, and the disks. Copies of one partition on
    several disks (replicas on node-local disks) are written by different ranks and should be equal; the
    manifest keeps each distinct checksum so that every copy verifies."""
    files: Dict[str, str] = {}
    sizes: Dict[str, int] = {}
    copies: Dict[str, List[str]] = {}
    writers: Dict[str, List[List[Any]]] = {}
    for rank, shard in enumerate(shards):
        if shard is None:
            continue
        fname, sha, size, _ = shard
        files.setdefault(fname, sha)
        sizes.setdefault(fname, size)
        if sha != files[fname] and sha not in copies.setdefault(fname, []):
            copies[fname].append(sha)
        writers.setdefault(fname, []).append([ranks[rank][0], ranks[rank][1]])
    files[BUFFERS_FILE] = hashlib.sha256(buffers).hexdigest()
    sizes[BUFFERS_FILE] = len(buffers)
    writers[BUFFERS_FILE] = [[ranks[d[0]][0], ranks[d[0]][1]] for d in disks]
    manifest["files"] = dict(sorted(files.items()))
    manifest["file_bytes"] = dict(sorted(sizes.items()))
    manifest["file_copies_sha256"] = {k: v for k, v in sorted(copies.items()) if v}
    manifest["writers"] = dict(sorted(writers.items()))
    manifest["disks"] = [{"ranks": [ranks[r][1] for r in d], "hosts": sorted({ranks[r][0] for r in d})}
                         for d in disks]
    _record_state_keys(manifest, [k for s in shards if s is not None for k in s[3]])


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


@dataclasses.dataclass
class _Snapshot:
    """What one rank's save writes, taken from the engine when save_checkpoint is called: the partition file's
    tensors and, on rank 0, the manifest (its save_id and files filled in later), the config files and the
    buffers' file. `error`: what taking it raised (reported to every rank at the save's first agreement)."""

    partition: int
    partitions: int
    tensors: Optional[Dict[str, torch.Tensor]] = None
    meta: Optional[Tuple[Dict[str, Any], Dict[str, bytes], bytes]] = None
    error: Optional[BaseException] = None


def _snapshot(engine: "ZeroEngine", step: Optional[int], copy: bool,
              reuse: Optional[Dict[str, torch.Tensor]] = None) -> _Snapshot:
    """This rank's part of a save, from the engine. `copy`: host copies that outlive the call (an asynchronous
    save), written into `reuse` where they fit; otherwise the CPU master ranges stay the engine's own tensors
    until the save writes them."""
    part, parts = partition(engine)
    snap = _Snapshot(part, parts)
    try:
        state = engine.shard_state()
        groups = group_layout(engine)
        snap.tensors = _partition_tensors(state, groups, copy, reuse)
        if engine.comm.rank == 0:  # built once, so every disk gets the same bytes
            layout, buffers = model_layout(engine)
            buf = _buffer_bytes(buffers)
            manifest = _manifest(engine, state, step, layout, parts, None)
            snap.meta = (manifest, model_config_texts(engine.model, layout["dtype"]), buf)
    except Exception as exc:
        snap.tensors, snap.error = None, exc
    return snap


class _Save:
    """One rank's part of a save_checkpoint call. Each step runs locally and ends in an exchange of every rank's
    result (so a failure anywhere stops the save everywhere, before any rename):

    0. check that `directory` is missing, empty, or a previous checkpoint (else nothing is touched);
    1. make the temporary folder and drop this rank's marker in it;
    2. look up every rank's marker: the ranks on this rank's disk; every rank learns every disk;
    3. the lowest rank per (disk, partition) writes the partition file;
    4. rank 0 builds the manifest (from every file's checksum), config files and buffers once, for every disk;
    5. each disk's lowest rank (its leader) writes them;
    6. the leaders fsync and rename their temporary folder into place (publish.py), and undo it if another disk's
       rename failed; after a successful save they remove what crashed saves of the same path left behind.
    """

    def __init__(self, snapshot: _Snapshot, comm: "Comm", directory: Path, overwrite: bool) -> None:
        # touches no engine: an asynchronous save runs it on a thread of its own while the training goes on
        self.snap, self.dir, self.overwrite = snapshot, directory, overwrite
        self.comm = comm
        self.me = _whoami(comm)
        self.partition, self.partitions = snapshot.partition, snapshot.partitions
        self.save_id = comm.control.share(uuid.uuid4().hex[:12])
        # the same name on every disk; each rank makes it beside its own `directory` (paths may differ per host)
        self.tmp = directory.parent / f"{directory.name}.tmp-{self.save_id}"
        self.leader = False
        self.payload: Optional[Tuple[str, Dict[str, bytes], bytes]] = None

    def run(self) -> Path:
        self._round("checking the path", self._check)
        ranks = self._round("creating the temporary folder", self._mark)
        disks = self._find_disks()
        mine = next(d for d in disks if self.comm.rank in d)
        self.leader = mine[0] == self.comm.rank
        writes = self.comm.rank in hosts.partition_writers(disks, [p for _, _, p in ranks])
        shards = self._round("writing the partition files", lambda: self._write_partition(writes))
        self._round("building the manifest", lambda: self._build(ranks, shards, disks))
        payload = self._share(self.payload) if len(disks) > 1 else self.payload
        self._round("writing the manifest, config and buffers", lambda: self._write_meta(payload))
        self._rename()
        return self.dir

    # ---------------------------------------------------------------- steps
    def _round(self, what: str, fn: Callable[[], Any]) -> List[Any]:
        """Run `fn` here and exchange every rank's result; a failure on any rank aborts the save on all."""
        try:
            mine: Tuple[Optional[str], Any] = (None, fn())
        except Exception as exc:
            mine = (f"{self.me}: {_describe(exc)}", None)
        results = _exchange(self.comm, mine)
        errors = [e for e, _ in results if e]
        if errors:
            self._abort(what, errors)
        return [v for _, v in results]

    def _abort(self, what: str, errors: List[str]) -> None:
        # every rank passed the exchange, so nobody writes into the folder any more
        shutil.rmtree(self.tmp, ignore_errors=True)
        shown = "; ".join(errors[:4]) + (f"; and {len(errors) - 4} more" if len(errors) > 4 else "")
        raise CheckpointError(f"saving the checkpoint to {self.dir} failed while {what} ({shown}); nothing was "
                              f"renamed into place, so {self.dir} holds the previous checkpoint (if any) unchanged "
                              f"on every host")

    def _check(self) -> None:
        if self.snap.error is not None:
            raise self.snap.error
        check_target(self.dir, is_checkpoint, "checkpoint", self.overwrite)

    def _mark(self) -> Tuple[str, int, int]:
        self.tmp.mkdir(parents=True, exist_ok=True)
        hosts.mark(self.tmp, self.comm.rank)
        return hosts.host_name(), self.comm.global_rank(self.comm.rank), self.partition

    def _find_disks(self) -> List[List[int]]:
        for attempt in range(DISK_CHECKS):
            views = self._round("finding which ranks share a disk",
                                lambda: hosts.ranks_seen(self.tmp, self.comm.world_size))
            disks = hosts.disk_groups(views)
            if disks is not None:
                return disks
            time.sleep(1.0 + attempt)  # the same on every rank: they all saw the same views
        self._abort("finding which ranks share a disk", [
            f"the ranks see different sets of each other's files in {self.tmp.name} (rank: the ranks it sees "
            f"{dict(list(enumerate(views))[:8])}): the file system shows one host's new files to another late or not at all; "
            f"save to a folder every rank sees alike (a shared file system with close-to-open consistency, or a "
            f"disk of each host's own)"])
        raise AssertionError("unreachable")

    def _write_partition(self, writes: bool) -> Optional[Tuple[str, str, int, List[str]]]:
        if self.leader:  # every rank has looked the markers up (the previous exchange)
            shutil.rmtree(self.tmp / hosts.MARKERS)
        if not writes:
            return None
        fname = rank_file(self.partition, self.partitions)
        path = self.tmp / fname
        tensors, self.snap.tensors = self.snap.tensors, None  # freed once written
        _st.save_file(tensors, str(path), metadata={"format": "hf_zero-sharded"})
        fsync_path(path)
        keys = list(tensors)
        del tensors
        return fname, sha256(path), path.stat().st_size, keys

    def _build(self, ranks, shards, disks) -> None:
        """Rank 0: the manifest, config files and buffers every disk gets (built once, so they are identical)."""
        if self.comm.rank != 0:
            return
        manifest, configs, buf = self.snap.meta
        manifest["save_id"] = self.save_id
        _record_files(manifest, ranks, shards, disks, buf)
        self.payload = (json.dumps(manifest, indent=1), configs, buf)

    def _share(self, payload: Any) -> Any:
        """Rank 0's payload on every rank (a broadcast: an all-gather would pad every rank's part to its size)."""
        return self.comm.control.share(payload)

    def _write_meta(self, payload: Optional[Tuple[str, Dict[str, bytes], bytes]]) -> None:
        if not self.leader:
            return
        text, configs, buf = payload
        (self.tmp / BUFFERS_FILE).write_bytes(buf)
        for name, data in configs.items():
            (self.tmp / name).write_bytes(data)
        (self.tmp / MANIFEST).write_text(text)  # last: a folder with a manifest has every file
        fsync_tree(self.tmp)  # every byte on the disk before the rename publishes the folder

    def _rename(self) -> None:
        old, swapped, error = None, False, None
        if self.leader:
            try:
                old, swapped = swap(self.tmp, self.dir), True
            except Exception as exc:
                error = f"{self.me}: renaming {self.tmp} to {self.dir}: {_describe(exc)}"
        errors = [e for e in _exchange(self.comm, error) if e]
        if not errors:
            if self.leader:
                remove(old)
                clean_leftovers(self.dir)  # crashed saves' folders: the new checkpoint makes them useless
            return
        if swapped:  # another disk failed: put this one's previous checkpoint back too
            try:
                unswap(self.tmp, self.dir, old)
            except Exception as exc:
                errors.append(f"{self.me}: restoring the previous checkpoint failed ({_describe(exc)}); it is in "
                              f"{old}")
        elif self.leader:
            shutil.rmtree(self.tmp, ignore_errors=True)
        raise CheckpointError(f"saving the checkpoint to {self.dir} failed while renaming it into place "
                              f"({'; '.join(errors[:4])}); the renames were undone, so {self.dir} holds the previous "
                              f"checkpoint (if any) on every host")


def save_checkpoint(engine: "ZeroEngine", directory: os.PathLike, step: Optional[int] = None,
                    overwrite: bool = False, async_save: bool = False) -> Union[Path, SaveHandle]:
    """Collective. Write the engine's training state to `directory`: a file per partition, `manifest.json`,
    `buffers.safetensors` and the model's config files. Returns `directory` (a Path), or with `async_save=True` a
    `SaveHandle`.

    `directory` may be on a disk every rank shares or on each host's own disk (the same path on every host, or
    even a different path per rank): the ranks find out which of them share a disk, and every disk gets the
    partition files of the ranks on it (each written once per disk), the manifest, the config files and the
    buffers. Atomic: the ranks agree that every file was written before any temporary folder is renamed into
    place, so a failure on any rank raises CheckpointError on every rank and leaves the previous checkpoint in
    `directory` untouched on every disk. A process killed at any instant leaves `directory` loadable: the previous
    checkpoint or the new one (see publish.py; `load_checkpoint` finds a previous one an interrupted rename moved
    aside).

    `directory` must be missing, an empty folder or a previous checkpoint; a regular file or a folder of other
    files raises CheckpointError and is left untouched, unless `overwrite=True`.

    `async_save=True`: the call returns once this rank's state is copied to host memory (pinned, from a GPU);
    the files, the agreement and the rename happen on a background thread (background.py) while training goes
    on, and write exactly the files a synchronous save of that state writes. The next save, a load,
    `engine.wait_for_save()`, `engine.close()` or the handle's `result()` wait for it, and the first of them
    raises its CheckpointError if it failed (at process exit it is logged). The first asynchronous save of an
    engine also makes the gloo group such saves talk over (collective)."""
    directory = Path(directory)
    background.wait_for_save(engine)  # one save at a time; a failed one is reported before anything else
    engine.wait()  # no reduction of the engine's may still be in flight beside the checkpoint's own collectives
    if not async_save:
        return _Save(_snapshot(engine, step, copy=False), engine.comm, directory, overwrite).run()
    comm = background.comm_for(engine)
    snap = _snapshot(engine, step, copy=True, reuse=background.host_buffers(engine))
    background.keep_host_buffers(engine, snap.tensors)
    return background.start(engine, directory, lambda: _Save(snap, comm, directory, overwrite).run())


# ---------------------------------------------------------------------------------------------- load
def _check_model(engine: "ZeroEngine", template: "ShardState", src: CheckpointSource, directory: Path) -> None:
    mine = {s["name"]: s for g in group_layout(engine) for s in g["slots"]}
    saved = {s["name"]: s for g in src.groups for s in g["slots"]}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    shapes = [f"{n}: saved {saved[n]['shape']} vs model {mine[n]['shape']}"
              for n in sorted(set(mine) & set(saved)) if mine[n]["shape"] != saved[n]["shape"]]
    saved_model = src.m.get("model")
    if saved_model is not None:  # format 2: persistent buffers too
        mine_b = {b.names[0]: b.tensor for b in persistent_buffers(engine.model)}
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
    cls = template.optimizer_class
    saved_opt = src.m["optimizer"]
    allowed = saved_opt.get("classes") or [saved_opt["class"]]  # a foreign format names the optimizers it fits
    if cls not in allowed:
        raise CheckpointError(f"{directory} holds {' or '.join(map(str, allowed))} state "
                              f"{saved_opt.get('state_keys') or ''}but the optimizer is {cls}".replace("[]", ""))



def _check_param_groups(template: "ShardState", src: CheckpointSource, directory: Path) -> None:
    saved = src.m["optimizer"]["param_groups"]
    if len(saved) != len(template.param_groups):
        raise CheckpointError(f"{directory}: {len(saved)} optimizer parameter groups saved, the optimizer has "
                              f"{len(template.param_groups)}")


def _needed_files(template: "ShardState", groups: List[Dict[str, Any]], src: CheckpointSource) -> List[str]:
    """The files this rank reads: those holding its owned ranges, and the buffers' file."""
    needed = set()
    for g in template.groups:
        for slot in groups[g.index]["slots"]:
            a, b = max(g.lo, slot["offset"]), min(g.hi, slot["offset"] + slot["numel"])
            if a < b:
                needed.update(src.files_for(slot["name"], a - slot["offset"], b - slot["offset"]))
    if (src.m.get("model") or {}).get("buffers"):
        needed.add(src.buffers_file())
    return sorted(needed)


def _stage(engine: "ZeroEngine", src: CheckpointSource, directory: Path) -> "ShardState":
    """Every read of this rank into fresh tensors in the engine's shard layout; no collective, and nothing of the
    engine changes (a missing, damaged or foreign file raises here)."""
    template = engine.shard_state()
    _check_model(engine, template, src, directory)
    _check_param_groups(template, src, directory)
    groups = group_layout(engine)
    for fname in _needed_files(template, groups, src):
        src.open_file(fname)
    state_keys = {g["index"]: _keys(src, g, "state") for g in src.groups}
    scalar_keys = {g["index"]: _keys(src, g, "scalar") for g in src.groups}
    shards = []
    for g in template.groups:  # every group's owned range, parameter by parameter (padding stays zero)
        values = torch.zeros(g.hi - g.lo, dtype=g.values.dtype)
        for slot in groups[g.index]["slots"]:
            a, b = max(g.lo, slot["offset"]), min(g.hi, slot["offset"] + slot["numel"])
            if a < b:
                values[a - g.lo:b - g.lo].copy_(src.read(slot["name"], "values", a - slot["offset"],
                                                         b - slot["offset"]))
        shards.append(dataclasses.replace(g, values=values))
    segments = []
    for seg in template.segments:  # optimizer state, segment by segment
        lo, hi = seg.param_lo, seg.param_lo + (seg.end - seg.start)  # the segment's range inside the parameter
        sg, _ = src.where[seg.slot]
        state: Dict[str, torch.Tensor] = {}
        for key in state_keys[sg["index"]]:
            v = src.read(seg.slot, f"state.{key}", lo, hi)
            if v is not None:
                state[key] = v
        for key in scalar_keys[sg["index"]]:
            v = src.scalar(seg.slot, key, lo, hi)
            if v is not None:
                state[key] = torch.tensor(v, dtype=torch.float32)
        segments.append(dataclasses.replace(seg, state=state))
    saved_model = src.m.get("model")
    buffers = {b["name"]: src.buffer(b["name"]) for b in saved_model["buffers"]} if saved_model is not None else {}
    param_groups = [dict(hp) for hp in src.m["optimizer"]["param_groups"]]
    if isinstance(src, ForeignSource):  # another system's groups: only the hyper-parameters this optimizer has
        param_groups = [{k: v for k, v in hp.items() if k in mine} for hp, mine in zip(param_groups,
                                                                                       template.param_groups)]
    return dataclasses.replace(template, groups=shards, segments=segments, buffers=buffers,
                               param_groups=param_groups,
                               loss_scaler=src.m.get("loss_scaler") if template.loss_scaler is not None else None)


def _agree_on_load(engine: "ZeroEngine", directory: Path, error: Optional[str],
                   manifest: Optional[Dict[str, Any]]) -> Optional[str]:
    """Collective: the ranks' errors, or (all read fine) whether they all read the same save; None if all is
    well. Hosts with disks of their own each read their own folder, which may hold another save."""
    me = _where(engine.comm)
    ident = (save_identity(manifest), manifest.get("step")) if manifest is not None else None
    views = _exchange(engine.comm, (error, ident, me))
    errors = [e for e, _, _ in views if e]
    if errors:
        shown = "; ".join(errors[:4]) + (f"; and {len(errors) - 4} more" if len(errors) > 4 else "")
        return f"loading the checkpoint {directory} failed on {len(errors)} of {len(views)} ranks: {shown}"
    saves: Dict[Any, List[Tuple[str, int]]] = {}
    for _, ident, who in views:
        saves.setdefault(ident, []).append(who)
    if len(saves) > 1:
        seen = "; ".join(f"{hosts.describe_ranks([r for _, r in who], [h for h, _ in who])} read step {i[1]} "
                         f"(save {i[0]})" for i, who in saves.items())
        return (f"the ranks read different checkpoints at {directory}: {seen}. A host's disk holds an older or "
                f"another run's checkpoint at that path: copy the same checkpoint to every host")
    return None


def describe_source(src: Union[CheckpointSource, "ForeignSource"]) -> str:
    """What a checkpoint is, for a person: "a DeepSpeed ZeRO-3 checkpoint, 4 ranks, step 120"."""
    m = src.m
    what = src.description if isinstance(src, ForeignSource) else f"an hf_zero stage-{m.get('stage')} checkpoint"
    world = m.get("world_size")
    step = f", step {m['step']}" if m.get("step") is not None else ""
    return f"{what}, {world} rank{'s' if world != 1 else ''}{step}"


def describe_run(engine: "ZeroEngine") -> str:
    world = engine.comm.world_size
    return f"stage {engine.config.stage}, {world} rank{'s' if world != 1 else ''}"


def stage_checkpoint(engine: "ZeroEngine", directory: os.PathLike, verify: bool = True,
                     trust: bool = False) -> Tuple[Dict[str, Any], "ShardState"]:
    """Collective. Read and check everything this rank needs from the checkpoint in `directory` into a staged
    `ShardState` (fresh tensors; the engine does not change), and agree with the other ranks: an error on any rank
    raises CheckpointError on every rank. Returns (manifest, staged); `engine.load_shard_state(staged)` applies it.
    Lets a caller that restores more (schedulers, RNG) check everything before changing anything.

    `directory` may also hold a checkpoint another system wrote: DeepSpeed ZeRO (stages 1-3) or
    torch.distributed.checkpoint (FSDP2), at any world size (checkpoint/open_foreign.py). Its pickles are read
    with no code run from them; `trust=True` unpickles them in full. The manifest returned is then the source's
    description (`"format"` names the system)."""
    background.wait_for_save(engine)  # the folder may be the one a background save is writing
    comm = engine.comm
    directory = resolve(directory)  # a save killed between its two renames left the previous one aside
    error, failure, manifest, staged = None, None, None, None
    src: Optional[Union[CheckpointSource, ForeignSource]] = None
    try:
        # the model's names tell a DCP folder's frozen parameters from its buffers
        src = open_foreign(str(directory), trust, parameter_names(engine.model)) \
            if not (directory / MANIFEST).exists() else None
        if src is not None:
            manifest = src.m
            if comm.rank == 0:
                logger.info("hf_zero: found %s -> this run: %s", describe_source(src), describe_run(engine))
        else:
            manifest = read_manifest(directory)
            src = CheckpointSource(directory, manifest, verify=verify, reader=_where(comm))
        staged = _stage(engine, src, directory)
    except Exception as exc:  # any error goes through the agreement: the other ranks must not wait for this one
        failure = exc
        text = str(exc)
        error = text if text.startswith(_whoami(comm)) else f"{_whoami(comm)}: {_describe(exc)}"
    finally:
        if src is not None:
            src.close()
    if comm.world_size == 1:
        if failure is not None:
            raise failure
        return manifest, staged
    agreed = _agree_on_load(engine, directory, error, manifest)
    if agreed is not None:
        raise CheckpointError(agreed) from failure
    return manifest, staged


@torch.no_grad()
def load_checkpoint(engine: "ZeroEngine", directory: os.PathLike, verify: bool = True) -> Dict[str, Any]:
    """Collective. Restore weights, persistent buffers, optimizer state and loss scale into `engine`, whatever
    world size or stage the checkpoint was saved at. Returns the manifest. `verify` checks each file read
    against the manifest's SHA-256 (sizes are always checked).

    All or nothing: every rank reads and checks what it needs from its own `directory` into staged tensors first,
    with no collective; then the ranks agree, so a rank that lacks a file (a checkpoint saved to node-local disks,
    resumed on other hosts) or holds a damaged one raises CheckpointError on every rank, naming the host, the rank
    and the file, instead of leaving the others waiting; only when every rank read everything does any rank change
    its engine (`engine.load_shard_state`). A failed load leaves every rank's engine as it was.

    `directory` missing while a complete `NAME.old-*` lies beside it (a save killed between its two renames)
    loads that previous checkpoint."""
    manifest, staged = stage_checkpoint(engine, directory, verify)
    engine.load_shard_state(staged)
    return manifest


def _keys(src: CheckpointSource, g: Dict[str, Any], kind: str) -> List[str]:
    """The optimizer-state keys saved for group `g`, from every rank file that holds a part of it (a rank whose
    range holds no optimised parameter wrote none)."""
    if f"{kind}_keys" in g:  # format 2 records them
        return list(g[f"{kind}_keys"])
    prefix = f"g{g['index']}.{kind}."
    partitioned = g["shard_numel"] != g["padded_numel"]
    keys = set()
    for r in range(src.partitions if partitioned else 1):
        f = src.open_file(rank_file(r, src.partitions))
        keys.update(k[len(prefix):] for k in f.keys() if k.startswith(prefix))
    return sorted(keys)
