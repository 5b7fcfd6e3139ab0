"""Consolidated export: the Hugging Face layout that `save_pretrained` writes, from a live engine or offline.

`export_pretrained(src, out_dir)` writes what `model.save_pretrained(out_dir)` writes for the unsharded model:
`model.state_dict()`'s names (persistent buffers included, tied weights once, under the name Transformers keeps),
each tensor in its original dtype (or `dtype`), split into `model.safetensors` or `model-0000k-of-0000n.safetensors`
+ `model.safetensors.index.json` exactly as `save_pretrained(max_shard_size=...)` splits them, plus `config.json`,
`generation_config.json` and tokenizer files.

- `src` a `ZeroEngine`: collective; every rank takes part in the gathers (one flat group at a time), rank 0 writes.
- `src` a sharded checkpoint folder, or several (one per host, for a save to disks the hosts do not share): offline,
  no process group and no model code: the manifest says where every element of every tensor lies, and each tensor
  is read from the partition files that hold it (plain reads of just its byte ranges), each file from whichever
  folder has it.

Either way one output file is assembled, written and dropped before the next: peak host memory is about one output
shard plus one flat group (online) or one tensor (offline), never the model. The output goes to a temporary folder
renamed into place at the end, so a failed export leaves `out_dir` as it was.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import safetensors.torch as _st
import torch

from ..engine.state import full_group_values, group_layout
from .layout import config_texts, dtype_name, model_config_texts, model_layout
from .publish import check_target, fsync_tree, is_export, resolve, swap_into_place
from .foreign_source import ForeignSource
from .open_foreign import open_foreign
from .source import MANIFEST, CheckpointError, CheckpointSource, read_manifests

if TYPE_CHECKING:
    from ..engine import ZeroEngine

logger = logging.getLogger("hf_zero")

WEIGHTS_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}
# what a previous export (or save_pretrained) left that this one replaces
_STALE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def parse_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a floating dtype; allowed: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint manifest")
    return dt


# ---------------------------------------------------------------------------------------------- the tensors
class _Entry:
    """One tensor of the output: a parameter (a slot of a flat group) or a persistent buffer."""

    __slots__ = ("name", "group", "slot", "buffer", "shape", "dtype")

    def __init__(self, name: str, group: Optional[Dict[str, Any]], slot: Optional[Dict[str, Any]],
                 buffer: Optional[Dict[str, Any]]) -> None:
        self.name, self.group, self.slot, self.buffer = name, group, slot, buffer
        spec = slot if slot is not None else buffer
        self.shape, self.dtype = tuple(spec["shape"]), _dtype(spec["dtype"])


def _saved_keys(model: Dict[str, Any], aliases: List[List[str]]) -> List[str]:
    """The keys save_pretrained writes, in its order: state-dict keys minus `_keys_to_ignore_on_save`, minus
    tied duplicates. Of each group of names for one tensor it drops those matching the model's
    `_tied_weights_keys` (keeping the last one if all match), as `remove_tied_weights_from_state_dict` does;
    if several remain (ties Transformers does not declare) the first in state-dict order is kept."""
    ignore = set(model["keys_to_ignore_on_save"])
    keys = [k for k in model["state_dict_keys"] if k not in ignore]
    present = set(keys)
    patterns = model["tied_weight_patterns"]
    drop = set()
    for names in aliases:
        names = [n for n in names if n in present]
        if len(names) < 2:
            continue
        found, delete = 0, set()
        for n in sorted(names):
            if any(re.search(p, n) for p in patterns):
                found += 1
                if found < len(names):
                    delete.add(n)
        keep = [n for n in keys if n in names and n not in delete]
        drop.update(n for n in names if n not in keep[:1])
    return [k for k in keys if k not in drop]


def _entries(groups: List[Dict[str, Any]], model: Dict[str, Any]) -> List[_Entry]:
    where: Dict[str, Tuple[str, Any, Any]] = {}
    aliases: List[List[str]] = []
    for g in groups:
        for s in g["slots"]:
            aliases.append(list(s["aliases"]))
            for a in s["aliases"]:
                where[a] = ("param", g, s)
    for b in model["buffers"]:
        aliases.append(list(b["aliases"]))
        for a in b["aliases"]:
            where[a] = ("buffer", None, b)
    out = []
    for key in _saved_keys(model, aliases):
        if key not in where:
            raise CheckpointError(f"the manifest lists state-dict key {key!r} but no tensor for it: damaged manifest")
        kind, g, spec = where[key]
        out.append(_Entry(key, g, spec, None) if kind == "param" else _Entry(key, None, None, spec))
    return out


def _split(entries: List[_Entry], dtype: Optional[torch.dtype], max_shard_size: Union[int, str]):
    """huggingface_hub's own split (the one save_pretrained calls), on meta tensors of the output sizes."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {e.name: torch.empty(e.shape, dtype=_out_dtype(e.dtype, dtype), device="meta") for e in entries}
    return split_torch_state_dict_into_shards(meta, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)


def _out_dtype(orig: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    # model.to(dtype) casts floating parameters and buffers only
    return dtype if dtype is not None and orig.is_floating_point else orig


class _FileReader:
    """Offline: each tensor straight from the rank files that hold it."""

    collective = False

    def __init__(self, src: CheckpointSource) -> None:
        self.src = src

    def __call__(self, e: _Entry) -> torch.Tensor:
        if e.buffer is not None:
            return self.src.buffer(e.buffer["name"])
        flat = self.src.read(e.slot["name"], "values", 0, e.slot["numel"])
        return flat.to(e.dtype).view(e.shape)

    def close(self) -> None:
        self.src.close()


class _EngineReader:
    """Online: one flat group at a time gathered whole by the engine (`full_group_values`: the master values for
    trainable groups, as the sharded checkpoint stores them); rank 0 (partition 0 of the first replica) slices its
    tensors out, the other ranks of its replica only take part. Other replicas hold the same shards and skip the
    gathers."""

    def __init__(self, engine: "ZeroEngine") -> None:
        self.engine = engine
        self.rank0 = engine.comm.rank == 0
        self.gathers = engine.partition_comm.global_rank(0) == engine.comm.global_rank(0)  # rank 0's replica
        self._index: Optional[int] = None
        self._full: Optional[torch.Tensor] = None
        self._reuse: Dict[torch.dtype, torch.Tensor] = {}  # one gather buffer per dtype, the largest group's size
        self.collective = True
        _, self.buffers = model_layout(engine)

    @torch.no_grad()
    def __call__(self, e: _Entry) -> Optional[torch.Tensor]:
        if e.buffer is not None:
            return self.buffers[e.buffer["name"]].detach().to("cpu", copy=True) if self.rank0 else None
        if not self.gathers:
            return None
        gi = e.group["index"]
        if gi != self._index:
            self._full = full_group_values(self.engine, gi, "export", reuse=self._reuse)
            self._index = gi
        if not self.rank0:
            return None
        s = e.slot
        return self._full[s["offset"]:s["offset"] + s["numel"]].view(e.shape).to("cpu", e.dtype, copy=True)

    def close(self) -> None:
        self._full, self._index, self._reuse = None, None, {}


# ---------------------------------------------------------------------------------------------- config files
def _edit_config(text: bytes, dtype: Optional[str], architecture: Optional[str]) -> bytes:
    """Set `dtype` and `architectures` as save_pretrained does, keeping its formatting (indent 2, sorted keys)."""
    cfg = json.loads(text)
    if dtype is not None:
        cfg["dtype"] = dtype
    if architecture is not None:
        cfg["architectures"] = [architecture]
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def _config_files(model_config: Any, model: Dict[str, Any], base: Dict[str, bytes],
                  dtype_name: Optional[str]) -> Dict[str, bytes]:
    """config.json and generation_config.json: from `model_config` (a PretrainedConfig, a folder holding
    config.json, or a JSON file) when given, else `base` (the engine's model's, or those saved with the
    checkpoint). A generation config comes from `model_config`'s folder, else `base`, else (a model that can
    generate) from the config, as Transformers builds it for a model made from a config."""
    arch = model["class"] if model.get("transformers") else None
    out: Dict[str, bytes] = {}
    if model_config is None:
        out = dict(base)
    elif hasattr(model_config, "to_json_string") and hasattr(model_config, "save_pretrained"):
        out = config_texts(model_config, None, arch, dtype_name)
        if "generation_config.json" in base:
            out["generation_config.json"] = base["generation_config.json"]
        elif model.get("can_generate"):
            from transformers import GenerationConfig

            gen = GenerationConfig.from_model_config(model_config)
            out["generation_config.json"] = config_texts(model_config, gen)["generation_config.json"]
    else:
        path = Path(model_config)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise FileNotFoundError(f"model_config={str(model_config)!r}: no config.json there")
        out["config.json"] = cfg_file.read_bytes()
        gen_file = path / "generation_config.json" if path.is_dir() else None
        if gen_file is not None and gen_file.is_file():
            out["generation_config.json"] = gen_file.read_bytes()
        elif "generation_config.json" in base:
            out["generation_config.json"] = base["generation_config.json"]
    if "config.json" in out:
        try:
            out["config.json"] = _edit_config(out["config.json"], dtype_name, arch)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model_config: config.json is not valid JSON ({exc})") from None
    return out


def _save_tokenizer(tokenizer: Any, tmp: Path) -> None:
    if tokenizer is None:
        return
    if not hasattr(tokenizer, "save_pretrained"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    tokenizer.save_pretrained(str(tmp))


def _carry_over(old: Path, tmp: Path) -> None:
    """Files of an existing `out_dir` that this export does not write (a README, training args) stay; weight
    files of the previous export do not (they would mix with the new ones)."""
    if not old.is_dir():
        return
    for item in old.iterdir():
        if (tmp / item.name).exists() or _STALE.fullmatch(item.name):
            continue
        if item.is_dir():
            shutil.copytree(item, tmp / item.name, symlinks=True)
        else:
            shutil.copy2(item, tmp / item.name)


def _new_tmp(out_dir: Path) -> Path:
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def _complete(tmp: Path, out_dir: Path, configs: Dict[str, bytes], tokenizer: Any) -> None:
    for name, text in configs.items():
        (tmp / name).write_bytes(text)
    _save_tokenizer(tokenizer, tmp)
    _carry_over(out_dir, tmp)
    fsync_tree(tmp)  # every byte on the disk before the rename publishes the folder
    swap_into_place(tmp, out_dir)


# ---------------------------------------------------------------------------------------------- the writer
def _write(entries: List[_Entry], reader, tmp: Optional[Path], dtype: Optional[torch.dtype],
           max_shard_size: Union[int, str], num_parameters: int, progress: bool) -> Optional[str]:
    """Every rank runs this loop (the online reader's gathers are collective); only the rank with a `tmp`
    writes. A failed write stops the writing, not the loop, so the other ranks' gathers still find a partner.
    Returns the error, if any."""
    split = _split(entries, dtype, max_shard_size)
    by_name = {e.name: e for e in entries}
    files = list(split.filename_to_tensors.items())
    error: Optional[str] = None
    bar = None
    if tmp is not None and progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(files), desc="Writing model shards", unit="file")
    for fname, names in files:
        tensors: Dict[str, torch.Tensor] = {}
        for name in names:
            e = by_name[name]
            t = reader(e)
            if tmp is not None and error is None:
                tensors[name] = t.to(_out_dtype(e.dtype, dtype)).contiguous()
            del t
        if tmp is not None and error is None:
            try:
                _st.save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            except Exception as exc:
                if reader.collective is False:
                    raise
                error = f"writing {fname}: {type(exc).__name__}: {exc}"
            if bar is not None:
                bar.update(1)
        del tensors
    if bar is not None:
        bar.close()
    if tmp is not None and error is None and split.is_sharded:
        index = {"metadata": {"total_parameters": num_parameters, **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return error


def export_pretrained(src: Union["ZeroEngine", str, os.PathLike, Sequence[Union[str, os.PathLike]]],
                      out_dir: Union[str, os.PathLike],
                      model_config: Any = None, tokenizer: Any = None, max_shard_size: Union[int, str] = "5GB",
                      dtype: Union[None, str, torch.dtype] = None, progress: bool = True,
                      verify: bool = True, overwrite: bool = False, trust: bool = False) -> Path:
    """Write the Hugging Face `save_pretrained` layout of the model to `out_dir`.

    Args:
        src: a `ZeroEngine` (collective: call on every rank; rank 0 writes) or a sharded checkpoint folder
            written by `save_checkpoint(engine, dir)` (offline: no process group, no model code), or a list of
            such folders: one per host when the hosts saved to disks of their own (each file is read from the
            first folder that has it; a file in none of them is an error naming it). Also a checkpoint another
            system wrote: a DeepSpeed ZeRO folder or a torch.distributed.checkpoint (FSDP2) folder, read with no
            code run from it (checkpoint/open_foreign.py); its config.json is taken from the folder or the one
            above it (the Trainer's checkpoint-N), else give `model_config`.
        out_dir: the output folder: missing, empty, or an earlier export (a model folder in save_pretrained's
            layout), which is replaced atomically
            (files there that an export does not write are kept, earlier weight files are not). A regular file or
            a folder of other files is refused (CheckpointError, nothing touched) unless `overwrite=True`.
        model_config: a `PretrainedConfig`, a folder with `config.json` (and maybe `generation_config.json`) or a
            JSON file; default: the engine's `model.config`, or the config saved with the checkpoint.
        tokenizer: a tokenizer (anything with `save_pretrained`) or a folder `AutoTokenizer` can read.
        max_shard_size: as `save_pretrained`'s ("5GB", "500MB", or bytes).
        dtype: cast floating tensors (e.g. "bf16"); default: each tensor's original dtype.
        progress: a tqdm bar over the output files (on the writing rank).
        verify: check the rank files against the manifest's SHA-256 before reading them (offline).
        overwrite: replace `out_dir` even if it is a file or a folder that is not an earlier export.
        trust: unpickle a foreign folder's files in full (runs whatever code they hold; only for trusted folders).
    Returns:
        `out_dir` as a Path (on every rank).
    """
    out_dir = Path(out_dir)
    dtype = parse_dtype(dtype)
    from ..engine import ZeroEngine

    if isinstance(src, ZeroEngine):
        return _export_engine(src, out_dir, model_config, tokenizer, max_shard_size, dtype, progress, overwrite)
    if isinstance(src, (str, os.PathLike)):
        folders = [Path(src)]
    elif isinstance(src, (list, tuple)) and src and all(isinstance(d, (str, os.PathLike)) for d in src):
        folders = [Path(d) for d in src]
    else:
        raise TypeError(f"src must be a ZeroEngine, a checkpoint folder or a list of checkpoint folders, got "
                        f"{type(src).__name__}")
    check_target(out_dir, is_export, "export", overwrite)
    return _export_dir(folders, out_dir, model_config, tokenizer, max_shard_size, dtype, progress, verify, trust)


def _export_dir(folders: List[Path], out_dir: Path, model_config, tokenizer, max_shard_size, dtype, progress,
                verify, trust: bool = False) -> Path:
    folders = [resolve(f) for f in folders]  # a save killed between its two renames left the previous one aside
    ckpt = folders[0]
    foreign = open_foreign(str(ckpt), trust) if len(folders) == 1 and not (ckpt / MANIFEST).exists() else None
    if foreign is not None:  # DeepSpeed ZeRO or DCP: the same export, read through the folder's own layout
        src: Union[CheckpointSource, ForeignSource] = foreign
        model, base = foreign.m["model"], dict(foreign.configs)
        entries = _entries(foreign.groups, model)
        for e in entries:  # fail before writing anything: every file present and readable
            if e.slot is not None:
                for fname in dict.fromkeys(foreign.files_for(e.slot["name"], 0, e.slot["numel"])):
                    foreign.open_file(fname)
    else:
        manifest = read_manifests(folders)
        model = manifest.get("model")
        if model is None:
            raise CheckpointError(f"{ckpt} was saved by an hf_zero without the model's state-dict layout (checkpoint "
                                  f"format v{manifest.get('format_version')}): load it into the engine and save it "
                                  f"again (or export from the engine)")
        src = CheckpointSource(folders, manifest, verify=verify)
        entries = _entries(manifest["groups"], model)
        for fname in src.file_names():  # fail before writing anything: every file present, sized, intact
            src.check_file(fname)
        src.verify = False  # just checked
        base = {}
        for n in ("config.json", "generation_config.json"):
            path = src.locate(n)
            if path is not None:
                base[n] = path.read_bytes()
    out_dtype = dtype_name(dtype) if dtype is not None else model["dtype"]
    configs = _config_files(model_config, model, base, out_dtype)
    if "config.json" not in configs:
        logger.warning("hf_zero: %s has no config.json and no model_config was given: the export holds weights "
                       "only (from_pretrained needs a config)", ckpt)
    reader = _FileReader(src)
    tmp = _new_tmp(out_dir)
    try:
        _write(entries, reader, tmp, dtype, max_shard_size, model["num_parameters"], progress)
        _complete(tmp, out_dir, configs, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    return out_dir


@torch.no_grad()
def _export_engine(engine: "ZeroEngine", out_dir: Path, model_config, tokenizer, max_shard_size, dtype,
                   progress, overwrite) -> Path:
    comm = engine.comm
    multi = comm.world_size > 1
    engine.wait()  # no reduction of the engine's may still be in flight beside the export's own collectives
    layout, _ = model_layout(engine)
    entries = _entries(group_layout(engine), layout)
    reader = _EngineReader(engine)
    reader.collective = multi
    error: Optional[str] = None
    tmp: Optional[Path] = None
    configs: Dict[str, bytes] = {}
    if comm.rank == 0:
        try:
            check_target(out_dir, is_export, "export", overwrite)
            out_dtype = dtype_name(dtype) if dtype is not None else layout["dtype"]
            configs = _config_files(model_config, layout, model_config_texts(engine.model, layout["dtype"]),
                                    out_dtype)
            tmp = _new_tmp(out_dir)
        except Exception as exc:
            if not multi:
                raise
            error = f"{type(exc).__name__}: {exc}"
    try:
        # every rank runs the same gathers; rank 0 (unless already failed) writes
        err = _write(entries, reader, tmp if error is None else None, dtype, max_shard_size,
                     layout["num_parameters"], progress)
        error = error or err
        if tmp is not None and error is None:
            try:
                _complete(tmp, out_dir, configs, tokenizer)
            except Exception as exc:
                if not multi:
                    raise
                error = f"{type(exc).__name__}: {exc}"
    finally:
        reader.close()
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    status = comm.control.share(error)
    if status is not None:
        raise CheckpointError(f"exporting to {out_dir} failed on rank 0 ({status}); {out_dir} is unchanged")
    return out_dir
