"""`hf-zero convert SRC DST`: a checkpoint another system wrote, turned into an hf_zero sharded checkpoint offline.

The output is hf_zero's own format (format 3, unchanged): one unpartitioned group per parameter in a single
partition file, which `load_checkpoint` / `load_state` reshards at any world size and stage like any other. The
partition file is written as a stream: the safetensors header is computed from the shapes first, then every
tensor is read from the source and written in turn, so at most one parameter's values or state is in memory
(the source files are memory-mapped). Written to a temporary folder, fsynced and renamed into place: `DST` holds
the whole checkpoint or is left as it was.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from tqdm.auto import tqdm

from .foreign_source import ForeignSource
from .open_foreign import open_foreign
from .publish import check_target, fsync_tree, is_checkpoint, swap_into_place
from .source import BUFFERS_FILE, FORMAT_VERSION, MANIFEST, CheckpointError, rank_file

__all__ = ["convert_checkpoint"]

_ST_DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16"}


def _plan(src: ForeignSource) -> List[Tuple[str, Any, torch.dtype, int]]:
    """(key, how to read it, dtype, elements) of every tensor of the partition file, in file order."""
    out = []
    for g in src.groups:
        i, name, numel = g["index"], g["slots"][0]["name"], g["numel"]
        out.append((f"g{i}.values", (name, "values"), torch.float32, numel))
        for key in g["state_keys"]:
            out.append((f"g{i}.state.{key}", (name, f"state.{key}"), torch.float32, numel))
        for key in g["scalar_keys"]:
            out.append((f"g{i}.scalar.{key}", (name, key), torch.float64, 1))
    return out


def _tensor(src: ForeignSource, how: Tuple[str, str], dtype: torch.dtype, numel: int) -> torch.Tensor:
    name, kind = how
    if kind == "values" or kind.startswith("state."):
        t = src.read(name, kind, 0, numel)
        if t is None:
            raise CheckpointError(f"{src.dir}: {name} has no {kind}: the folder lacks that optimizer state")
        return t.to(dtype).reshape(-1)
    v = src.scalar(name, kind)
    return torch.tensor([float("nan") if v is None else v], dtype=dtype)


def _write_partition(src: ForeignSource, path: Path, progress: bool) -> Tuple[str, int]:
    """The partition file, streamed; returns its SHA-256 and size."""
    plan = _plan(src)
    header: Dict[str, Any] = {"__metadata__": {"format": "hf_zero-sharded"}}
    offset = 0
    for key, _, dtype, numel in plan:
        size = numel * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPE[dtype], "shape": [numel], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(text)), text):
            f.write(chunk)
            h.update(chunk)
        for key, how, dtype, numel in tqdm(plan, desc="hf-zero convert", unit="tensor", disable=not progress):
            data = _tensor(src, how, dtype, numel).contiguous().view(torch.uint8).numpy().tobytes()
            f.write(data)
            h.update(data)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest(), path.stat().st_size


def _buffers(src: ForeignSource) -> bytes:
    import safetensors.torch as st

    tensors = {b["name"]: src.buffer(b["name"]).detach().to("cpu", copy=True).contiguous()
               for b in src.m["model"]["buffers"]}
    return st.save(tensors, metadata={"format": "hf_zero-sharded"})


def _manifest(src: ForeignSource, fname: str, sha: str, size: int, buffers: bytes) -> Dict[str, Any]:
    m = src.m
    classes = m["optimizer"]["classes"] or ["AdamW"]
    model = {k: v for k, v in m["model"].items() if k != "description"}
    return {
        "format": "hf_zero-sharded", "format_version": FORMAT_VERSION, "save_id": uuid.uuid4().hex,
        "world_size": 1, "partitions": 1, "stage": 0, "config": {}, "step": m.get("step"),
        "groups": src.groups, "model": model,
        "optimizer": {"class": classes[-1], "param_groups": m["optimizer"]["param_groups"],
                      "param_group_of": m["optimizer"]["param_group_of"]},
        "loss_scaler": m.get("loss_scaler"), "buffers_file": BUFFERS_FILE,
        "converted_from": {"format": src.kind, "description": src.description, "world_size": m["world_size"],
                           "folder": str(src.dir)},
        "files": {fname: sha, BUFFERS_FILE: hashlib.sha256(buffers).hexdigest()},
        "file_bytes": {fname: size, BUFFERS_FILE: len(buffers)},
    }


def convert_checkpoint(src_dir: os.PathLike, dst_dir: os.PathLike, trust: bool = False, overwrite: bool = False,
                       progress: bool = True) -> Path:
    """Turn the DeepSpeed ZeRO or DCP (FSDP2) checkpoint in `src_dir` into an hf_zero sharded checkpoint in
    `dst_dir`: weights (the fp32 master), Adam's moments and step, the optimizer's hyper-parameters, the
    buffers, and the model's config.json when the folder or the one above it has one. No process group, no model
    code, no code run from the folder (`trust=True` unpickles its files in full). `dst_dir` must be missing, empty
    or an earlier hf_zero checkpoint (replaced atomically) unless `overwrite=True`."""
    src_dir, dst = Path(src_dir), Path(dst_dir)
    src = open_foreign(str(src_dir), trust)
    if src is None:
        raise CheckpointError(f"{src_dir} holds neither a DeepSpeed ZeRO checkpoint (a `latest` file or "
                              f"global_stepN/ with *_optim_states.pt) nor a torch.distributed.checkpoint folder "
                              f"(.metadata); hf_zero's own checkpoints need no conversion")
    check_target(dst, is_checkpoint, "checkpoint", overwrite)
    tmp = dst.parent / f"{dst.name}.tmp-{uuid.uuid4().hex[:8]}"  # a crash leaves what clean_leftovers removes
    tmp.mkdir(parents=True)
    try:
        fname = rank_file(0, 1)
        sha, size = _write_partition(src, tmp / fname, progress)
        buffers = _buffers(src)
        (tmp / BUFFERS_FILE).write_bytes(buffers)
        for name, data in src.configs.items():
            (tmp / name).write_bytes(data)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(src, fname, sha, size, buffers), indent=1))
        fsync_tree(tmp)
        swap_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        src.close()
    return dst
