"""An hf_zero sharded checkpoint written as a torch.distributed.checkpoint (DCP) folder, for FSDP2, torchtitan-style
loaders and Accelerate's FSDP2 `load_state` (`hf-zero convert --to dcp`).

The DCP state is what `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` gives for the
model and a torch Adam/AdamW: "model.<FQN>" for every parameter (a tied one under each of its names) and
persistent buffer, "optim.state.<FQN>.exp_avg|exp_avg_sq|step" and "optim.param_groups.<i>.<hp>" with the
group's "params" (FQNs). So `dcp.load({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m,
opt)})` then `set_model_state_dict` / `set_optimizer_state_dict` restores it at any world size.

Streaming: DCP's writer keeps every tensor of a data file until the file is written, so the state is saved in
batches of about `batch_bytes` (each its own `dcp.save`, one data file), and the batches' metadata merged into
one `.metadata`. Host memory: one batch (at least one parameter's tensors), not the checkpoint.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

import torch

from .from_dcp import ACCELERATE_MODEL_DIR, ACCELERATE_OPTIMIZER_DIR
from .foreign import read_dcp_metadata
from .source import CheckpointError, CheckpointSource, rank_file, read_manifest

__all__ = ["export_dcp"]

Fetch = Callable[[], torch.Tensor]
Entry = Tuple[Tuple[Any, ...], int, Union[Fetch, Any]]  # (path in the nested state dict, bytes, fetch or value)


def _state_keys(src: CheckpointSource, g: Dict[str, Any]) -> List[str]:
    if "state_keys" in g:  # format 2 on
        return list(g["state_keys"])
    prefix = f"g{g['index']}.state."
    keys = set()
    for r in range(src.partitions if g["shard_numel"] != g["padded_numel"] else 1):
        keys.update(k[len(prefix):] for k in src.open_file(rank_file(r, src.partitions)).keys()
                    if k.startswith(prefix))
    return sorted(keys)


def _entries(src: CheckpointSource, manifest: Dict[str, Any], model_key: str,
             optim_key: str) -> Tuple[List[Entry], List[Entry]]:
    """The model's and the optimizer's entries, each read when its batch is written."""
    model: List[Entry] = []
    optim: List[Entry] = []
    # manifests saved before hf_zero recorded every parameter's group hold rank 0's only: a parameter they lack is
    # in no list below (torch matches a group by any one member)
    groups_of = (manifest.get("optimizer") or {}).get("param_group_of") or {}
    saved = (manifest.get("optimizer") or {}).get("param_groups") or []
    params: Dict[int, List[str]] = {}
    trained: List[str] = []
    for g in manifest["groups"]:
        keys = _state_keys(src, g) if g["trainable"] else []
        for s in g["slots"]:
            name, shape, numel = s["name"], tuple(s["shape"]), s["numel"]
            dtype = getattr(torch, s["dtype"])
            # trained values and moments as the masters hold them: fp32, or the parameter's own wider dtype (fp64)
            master = torch.promote_types(dtype, torch.float32)
            dtype = master if g["trainable"] else dtype

            def values(name=name, shape=shape, numel=numel, dtype=dtype) -> torch.Tensor:
                return src.read(name, "values", 0, numel).to(dtype).view(shape)

            for alias in dict.fromkeys([name, *s.get("aliases", [])]):  # get_model_state_dict lists every name
                model.append(((model_key, alias), numel * dtype.itemsize, values))
            if not g["trainable"]:
                continue
            group = groups_of.get(name, 0 if len(saved) <= 1 else None)
            if group is not None:  # unknown: left out of every group's list (torch maps a group by any member)
                params.setdefault(int(group), []).append(name)
            trained.append(name)
            step = src.scalar(name, "step")
            if step is not None:
                optim.append(((optim_key, "state", name, "step"), 4, torch.tensor(float(step))))
            for key in keys:
                def state(name=name, shape=shape, numel=numel, key=key, master=master) -> torch.Tensor:
                    v = src.read(name, f"state.{key}", 0, numel)
                    if v is None:
                        raise CheckpointError(f"{src.dir}: {name} has no {key} in some partition: damaged checkpoint")
                    return v.to(master).view(shape)

                optim.append(((optim_key, "state", name, key), numel * master.itemsize, state))
    for b in (manifest.get("model") or {}).get("buffers") or []:
        for alias in b["aliases"]:
            model.append(((model_key, alias), 0, lambda n=b["name"]: src.buffer(n)))
    if trained:
        empty = [i for i in range(len(saved)) if not params.get(i)]
        if empty:
            raise CheckpointError(f"{src.dir}: the manifest says which parameters optimizer group(s) {empty} hold "
                                  f"for none of them, so their hyper-parameters cannot be matched to a group")
        groups = []
        for i, hp in enumerate(saved or [{}]):
            group = {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in hp.items()}
            group["params"] = params.get(i, [])
            groups.append(group)
        optim.append(((optim_key, "param_groups"), 0, groups))
    return model, optim


def _nest(batch: List[Tuple[Tuple[Any, ...], Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for path, value in batch:
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = value
    return out


def _batches(entries: List[Entry], batch_bytes: int) -> Iterator[List[Tuple[Tuple[Any, ...], Any]]]:
    batch: List[Tuple[Tuple[Any, ...], Any]] = []
    size = 0
    for path, nbytes, value in entries:
        if batch and size + nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append((path, value() if callable(value) else value))
        size += nbytes
    if batch:
        yield batch


def _save_streaming(entries: List[Entry], folder: Path, batch_bytes: int) -> None:
    """`entries` as one DCP checkpoint in `folder`: a `dcp.save` per batch into a scratch folder, each batch's data
    file moved in as `__0_<batch>.distcp`, and the batches' metadata merged into `.metadata`."""
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True)
    merged = None
    for b, batch in enumerate(_batches(entries, batch_bytes)):
        scratch = folder / f".batch{b}"
        with warnings.catch_warnings():  # one process, on purpose: no collectives even inside a distributed job
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_nest(batch), storage_writer=dcp.FileSystemWriter(str(scratch), thread_count=1),
                     no_dist=True)
        del batch
        meta = read_dcp_metadata(str(scratch))  # our own file, read the one way hf_zero reads DCP metadata
        renamed = {}
        for name in sorted({info.relative_path for info in meta.storage_data.values()}):
            renamed[name] = f"__0_{b}.distcp" if len(renamed) == 0 else f"__0_{b}_{len(renamed)}.distcp"
            os.replace(scratch / name, folder / renamed[name])
        storage = {i: dataclasses.replace(info, relative_path=renamed[info.relative_path])
                   for i, info in meta.storage_data.items()}
        if merged is None:
            merged = dataclasses.replace(meta, storage_data=storage)
        else:
            merged.state_dict_metadata.update(meta.state_dict_metadata)
            merged.storage_data.update(storage)
            if merged.planner_data is not None and meta.planner_data is not None:
                merged.planner_data.update(meta.planner_data)
        shutil.rmtree(scratch)
    if merged is None:
        raise CheckpointError(f"{folder}: nothing to write")
    if getattr(merged, "storage_meta", None) is not None:
        merged.storage_meta = dataclasses.replace(merged.storage_meta, checkpoint_id=str(folder))
    tmp = folder / ".metadata.tmp"
    with open(tmp, "wb") as f:  # as DCP's FileSystemWriter.finish writes it
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / ".metadata")


def export_dcp(src_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], layout: str = "torch",
               batch_bytes: int = 1 << 30, verify: bool = True) -> Path:
    """Write the hf_zero sharded checkpoint in `src_dir` as a DCP checkpoint in `out_dir` (missing or empty).

    `layout="torch"`: one DCP folder of {"model": ..., "optim": ...} (torchtitan's and the DCP tutorials' form,
    what `dcp.load` + `set_model_state_dict` / `set_optimizer_state_dict` read). `layout="accelerate"`: Accelerate's
    FSDP2 `save_state` folders, `out_dir/pytorch_model_fsdp_0/` ({"model": ...}) and `out_dir/optimizer_0/`
    ({"optimizer": ...}), which its `load_state` reads. Weights of trained parameters are hf_zero's masters
    (fp32, or fp64 for an fp64 parameter); Adam's moments are in the same dtype, its step a 0-d float32 tensor, as
    torch's Adam keeps them. Host memory: about
    `batch_bytes` (module docstring). Written to a scratch folder beside `out_dir` and renamed into place, so
    `out_dir` is complete or absent. Returns `out_dir`."""
    if layout not in ("torch", "accelerate"):
        raise ValueError(f"layout={layout!r}: 'torch' or 'accelerate'")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty folder: refusing to write the DCP checkpoint there")
    manifest = read_manifest(src_dir)
    src = CheckpointSource(Path(src_dir), manifest, verify=verify)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if layout == "torch":
            model, optim = _entries(src, manifest, "model", "optim")
            _save_streaming(model + optim, scratch / "dcp", batch_bytes)
            final = scratch / "dcp"
        else:
            model, optim = _entries(src, manifest, "model", "optimizer")
            final = scratch / "out"
            _save_streaming(model, final / ACCELERATE_MODEL_DIR, batch_bytes)
            if optim:
                _save_streaming(optim, final / ACCELERATE_OPTIMIZER_DIR, batch_bytes)
        if out.exists():
            out.rmdir()
        os.replace(final, out)
    finally:
        src.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return out
