"""Reading a sharded checkpoint: the manifest, the rank files (checked against it, never a pickle), and flat
ranges of each saved tensor (`CheckpointSource`). Save and load through an engine: sharded.py."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors import safe_open

from ..engine.weights import TensorEntry, read_safetensors_header

# 3: files named by partition, one writer per (disk, partition), buffers.safetensors, save_id, writers, disks
# 2: persistent buffers in rank 0's file, the model's state-dict layout, file sizes
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
BUFFERS_FILE = "buffers.safetensors"
BUFFER_PREFIX = "buffer."  # format 2: the buffers' keys in rank 0's file


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not belong to this model; the message says which."""


# the manifest's fields keyed by file name (besides "buffers_file", which is one)
FILE_NAME_FIELDS = ("files", "file_bytes", "file_copies_sha256", "writers")


def _name_problem(name: Any) -> Optional[str]:
    """Why `name` is not a plain file name inside a folder, or None if it is one."""
    if not isinstance(name, str):
        return f"a {type(name).__name__}, not a file name"
    if name in ("", ".", ".."):
        return "not a file name"
    if "/" in name or "\\" in name:
        return "a path, not a file name"
    if "\0" in name:
        return "a name with a NUL character"
    return None


def check_file_names(manifest: Dict[str, Any], where: Union[str, os.PathLike]) -> None:
    """Every file name `manifest` holds (`buffers_file`, the keys of FILE_NAME_FIELDS) must be a plain name inside
    the checkpoint folder: no path separator, no `..`, not absolute, not empty. A manifest is read before any of
    its files: one that names a file elsewhere must not get it read. CheckpointError naming the field and the
    value otherwise; `where` (the manifest's path) starts the message."""
    names: List[Tuple[str, Any]] = []
    if "buffers_file" in manifest:
        names.append(("buffers_file", manifest["buffers_file"]))
    for field in FILE_NAME_FIELDS:
        value = manifest.get(field)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: manifest field {field!r} is a {type(value).__name__}, not an object "
                                  f"keyed by file name: damaged manifest")
        names.extend((field, name) for name in value)
    for field, name in names:
        problem = _name_problem(name)
        if problem is not None:
            raise CheckpointError(f"{where}: manifest field {field!r} names {name!r}, {problem}: a checkpoint's "
                                  f"files are plain names inside its folder (a damaged or hostile manifest); "
                                  f"refusing to read it")
    for field in ("world_size", "partitions"):  # the rank files' names are built from these
        if field in manifest and not (type(manifest[field]) is int and manifest[field] >= 1):
            raise CheckpointError(f"{where}: manifest field {field!r} is {manifest[field]!r:.40}, not a positive "
                                  f"integer: damaged manifest")


def rank_file(partition: int, partitions: int) -> str:
    return f"rank{partition:05d}-of-{partitions:05d}.safetensors"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch.save zip, pickle


class _RankFile:
    """Reads ranges of a safetensors file with plain reads into fresh tensors.

    safe_open().get_slice() returns memory backed by the file mapping, so every page read stays in the process's
    RSS while the tensor lives (and the handle is open); plain reads keep host memory to the tensors asked for,
    which the bounded-memory export relies on. The header is checked as the pretrained-weights reader checks it
    (engine/weights.py: offsets inside the file, sizes that match shape and dtype, no overlaps), so a damaged
    file is a CheckpointError naming the file and the tensor, never values read from elsewhere."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: Dict[str, TensorEntry] = read_safetensors_header(path, CheckpointError)

    def keys(self) -> List[str]:
        return list(self.entries)

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor `key`."""
        e = self.entries[key]
        if not 0 <= lo <= hi <= e.numel:
            raise CheckpointError(f"{self.path}: elements {lo}..{hi} of {key} requested, it has {e.numel}")
        out = torch.empty(hi - lo, dtype=e.dtype)
        if hi > lo:
            view = memoryview(out.view(torch.uint8).numpy())
            with open(self.path, "rb") as f:
                f.seek(e.begin + lo * e.dtype.itemsize)
                if f.readinto(view) != view.nbytes:
                    raise CheckpointError(f"{self.path}: short read of {key}: the file is truncated")
        return out

    def tensor(self, key: str) -> torch.Tensor:
        e = self.entries[key]
        return self.read(key, 0, e.numel).view(e.shape)


class CheckpointSource:
    """The saved layout: where each parameter's elements live, and reading flat ranges from the partition files
    (each file is checked once: present, the size and SHA-256 the manifest records, safetensors, not a pickle).

    `directories`: the checkpoint folder, or several (one per host of a save to node-local disks): each file is
    read from the first folder that holds it. `reader` (host name, global rank) marks a resume: a missing file's
    message then names that rank and says what to do about it."""

    def __init__(self, directories: Union[Path, Sequence[Path]], manifest: Dict[str, Any], verify: bool = True,
                 reader: Optional[Tuple[str, int]] = None) -> None:
        self.dirs = [Path(directories)] if isinstance(directories, (str, os.PathLike)) else \
            [Path(d) for d in directories]
        self.dir = self.dirs[0]
        check_file_names(manifest, self.dir / MANIFEST)  # read_manifest did; a manifest from elsewhere too
        self.m, self.verify, self.reader = manifest, verify, reader
        self.version = manifest.get("format_version", 1)
        self.world = manifest["world_size"]
        self.partitions = manifest.get("partitions", self.world)  # before format 3: one file per rank
        self.groups = manifest["groups"]
        self.where: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {}
        for g in self.groups:
            for s in g["slots"]:
                self.where[s["name"]] = (g, s)
        self._handles: Dict[str, Any] = {}

    def file_names(self) -> List[str]:
        """Every file a full read needs: the partition files (and, from format 3, the buffers file)."""
        names = [rank_file(p, self.partitions) for p in range(self.partitions)]
        return names + ([self.buffers_file()] if self.version >= 3 else [])

    def buffers_file(self) -> str:
        return self.m.get("buffers_file", BUFFERS_FILE) if self.version >= 3 else rank_file(0, self.partitions)

    def locate(self, fname: str) -> Optional[Path]:
        """The first folder's copy of `fname`, None if no folder has it. A symlink that leads out of its folder is
        a CheckpointError: the checkpoint's files are the ones in it (the manifest only names them)."""
        for d in self.dirs:
            path = d / fname
            if path.is_file():
                real, folder = path.resolve(), d.resolve()
                if not real.is_relative_to(folder):
                    raise CheckpointError(f"{path} is a symlink to {real}, outside the checkpoint folder {folder}: "
                                          f"refusing to read it (copy the file into the folder if it is meant to "
                                          f"be there)")
                return path
        return None

    def open_file(self, fname: str) -> "_RankFile":
        """The checked file, opened once."""
        if fname not in self._handles:
            self._handles[fname] = _RankFile(self.check_file(fname))
        return self._handles[fname]

    def close(self) -> None:
        """Drop the open files."""
        self._handles.clear()

    def _missing(self, fname: str) -> CheckpointError:
        where = " or ".join(str(d) for d in self.dirs)
        saved = f"the checkpoint was saved by {self.world} ranks" + (
            f" in {self.partitions} partitions" if self.partitions != self.world else "")
        writers = (self.m.get("writers") or {}).get(fname)
        wrote = "; it was written by " + ", ".join(f"rank {r} on host {h}" for h, r in writers[:4]) if writers else ""
        if self.reader is not None:
            host, rank = self.reader
            return CheckpointError(
                f"host {host}, rank {rank} cannot resume: {fname} is missing from {where} ({saved}{wrote}). On "
                f"disks the hosts do not share, each host keeps only the files of its own ranks: resume with the "
                f"same processes on the same hosts, or copy {fname} from the host that wrote it into {self.dir} "
                f"on host {host}; to export the weights instead, gather the hosts' folders with `hf-zero "
                f"consolidate HOST_A_DIR HOST_B_DIR ... OUT_DIR`")
        return CheckpointError(
            f"{where}: rank file {fname} is missing ({saved}; every rank file is needed{wrote}). If the hosts saved "
            f"to disks of their own, pass every host's folder: `hf-zero consolidate HOST_A_DIR HOST_B_DIR ... "
            f"OUT_DIR` (export_pretrained([dir_a, dir_b], out_dir))")

    def check_file(self, fname: str) -> Path:
        """The file's path once it exists, is the file the manifest describes, and is safetensors."""
        path = self.locate(fname)
        if path is None:
            raise self._missing(fname)
        with open(path, "rb") as f:
            head = f.read(8)
        if head.startswith(_PICKLE_MAGIC):
            raise CheckpointError(f"{path} is a pickle (torch.save) file, not safetensors: hf_zero checkpoints never "
                                  f"contain pickles and never load one (it could run code)")
        files = self.m.get("files") or {}
        if self.version >= 2 and fname not in files:
            raise CheckpointError(f"{path}: the manifest does not list this rank file; the folder mixes checkpoints")
        size, expected_size = path.stat().st_size, (self.m.get("file_bytes") or {}).get(fname)
        if expected_size is not None and size != expected_size:
            raise CheckpointError(f"{path} is {size} bytes but the manifest says {expected_size}: the file is "
                                  f"{'truncated' if size < expected_size else 'longer than saved'} (an interrupted "
                                  f"copy or a full disk?)")
        if self.verify and fname in files:
            allowed = [files[fname], *(self.m.get("file_copies_sha256") or {}).get(fname, [])]
            if sha256(path) not in allowed:
                raise CheckpointError(f"{path}: checksum mismatch: the file is damaged or was modified after the "
                                      f"save")
        if size < 8 or int.from_bytes(head, "little") + 8 > size:
            raise CheckpointError(f"{path} is not a safetensors file (bad header)")
        try:
            safe_open(str(path), framework="pt")
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
        return path

    def _pieces(self, name: str, lo: int, hi: int) -> List[Tuple[str, int, int]]:
        """(file, start, end) in that file's flat range, for elements [lo, hi) of parameter `name`."""
        g, s = self.where[name]
        start, end = s["offset"] + lo, s["offset"] + hi
        shard = g["shard_numel"]
        partitioned = shard != g["padded_numel"]
        out = []
        while start < end:
            p = start // shard if partitioned else 0
            p_lo = p * shard if partitioned else 0
            stop = min(end, p_lo + shard) if partitioned else end
            out.append((rank_file(p, self.partitions), start - p_lo, stop - p_lo))
            start = stop
        return out

    def files_for(self, name: str, lo: int, hi: int) -> List[str]:
        """The files that hold elements [lo, hi) of parameter `name`."""
        return [f for f, _, _ in self._pieces(name, lo, hi)]

    def read(self, name: str, kind: str, lo: int, hi: int) -> Optional[torch.Tensor]:
        """Elements [lo, hi) of parameter `name` (kind "values" or "state.<key>"); None if that state is absent."""
        g, _ = self.where[name]
        key = f"g{g['index']}.{kind}"
        parts = []
        for fname, a, b in self._pieces(name, lo, hi):
            f = self.open_file(fname)
            if key not in f.keys():
                if kind == "values":
                    raise CheckpointError(f"{f.path} lacks {key}: damaged checkpoint")
                return None
            parts.append(f.read(key, a, b))
        if not parts:
            return torch.empty(0)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def buffer(self, name: str) -> torch.Tensor:
        f = self.open_file(self.buffers_file())
        key = name if self.version >= 3 else BUFFER_PREFIX + name
        if key not in f.keys():
            raise CheckpointError(f"{f.path} lacks the buffer {name}: damaged checkpoint")
        return f.tensor(key)

    def scalar(self, name: str, key: str, lo: int = 0, hi: Optional[int] = None) -> Optional[float]:
        """The per-parameter scalar `key` (Adam's step) of parameter `name`, from the files that hold its
        elements [lo, hi) first (the ones this rank reads anyway, so on node-local disks they are on this host),
        then from any other file present."""
        g, s = self.where[name]
        hi = s["numel"] if hi is None else hi
        slot_index = g["slots"].index(s)
        partitioned = g["shard_numel"] != g["padded_numel"]
        own = list(dict.fromkeys(self.files_for(name, lo, hi)))
        rest = [rank_file(p, self.partitions) for p in range(self.partitions)] if partitioned else \
            [rank_file(0, self.partitions)]
        k = f"g{g['index']}.scalar.{key}"
        for fname in own + [f for f in rest if f not in own and self.locate(f) is not None]:
            f = self.open_file(fname)
            if k in f.keys():
                v = float(f.read(k, slot_index, slot_index + 1)[0])
                if v == v:  # not NaN: this file's partition held a segment of the parameter
                    return v
        return None



def read_manifest(directory: os.PathLike) -> Dict[str, Any]:
    """The manifest of the checkpoint in `directory` (CheckpointError if there is none, or not one this version
    reads)."""
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
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested deeper than the parser goes
        raise CheckpointError(f"{path} is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "hf_zero-sharded" \
            or manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r} "
                              f"v{manifest.get('format_version')}" if isinstance(manifest, dict) else
                              f"{path}: not an hf_zero manifest")
    check_file_names(manifest, path)
    return manifest


def save_identity(manifest: Dict[str, Any]) -> str:
    """What tells two saves apart: the save id (format 3), else a digest of the whole manifest."""
    return manifest.get("save_id") or hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def read_manifests(directories: Sequence[os.PathLike]) -> Dict[str, Any]:
    """The manifest of a checkpoint given as several folders (one per host's disk): every folder must hold the
    same save."""
    manifests = [(Path(d), read_manifest(d)) for d in directories]
    first_dir, first = manifests[0]
    for d, m in manifests[1:]:
        if save_identity(m) != save_identity(first):
            raise CheckpointError(f"{first_dir} and {d} hold different checkpoints (step {first.get('step')}, save "
                                  f"{save_identity(first)} vs step {m.get('step')}, save {save_identity(m)}): pass "
                                  f"the folders of one save")
    return first
