"""Checkpoint folders other systems wrote, recognized and read with no code run from them.

- DeepSpeed ZeRO (`save_checkpoint`, through Accelerate's `save_state` or the Trainer): a `latest` file naming a
  `global_stepN/` folder of `mp_rank_*_model_states.pt` and `*zero_pp_rank_*_optim_states.pt`, torch pickles. They
  are read with `load_without_code` (checkpoint/pickles.py); the few DeepSpeed types they hold come back as inert
  records named by their DeepSpeed class (`DeepSpeedRecord`, `ZeroStage`), DeepSpeed is never imported.
- torch.distributed.checkpoint (DCP: FSDP2, Accelerate's sharded FSDP2 state, torchtitan): a `.metadata` file,
  a plain pickle, read by an unpickler that admits DCP's metadata classes and torch's sizes, dtypes and layouts by
  name and refuses anything else, then `*.distcp` files of tensor data.

`inspect_foreign(folder)` says what a folder is ("DeepSpeed ZeRO-3 checkpoint, 4 ranks, step 120"). This is the
reading layer of issue #36; loading such a folder into an engine at another world size and stage builds on it.
"""
from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from .pickles import UntrustedPickleError, load_without_code
from .source import CheckpointError

__all__ = ["DeepSpeedRecord", "ForeignCheckpoint", "ZeroStage", "inspect_foreign", "looks_foreign",
           "read_dcp_metadata", "read_deepspeed_file"]

TRUST = "trust_pickles=True"


class DeepSpeedRecord:
    """A DeepSpeed object as data: its class's name (`deepspeed_class`) and the attributes it was pickled with.
    Nothing of DeepSpeed is imported or run."""

    deepspeed_class = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        return f"<{self.deepspeed_class} record {sorted(k for k in self.__dict__ if k != 'args')}>"


class ZeroStage(int):
    """DeepSpeed's ZeroStageEnum (an IntEnum) as the int it holds."""


def _record(name: str) -> type:
    return type(name.rsplit(".", 1)[1], (DeepSpeedRecord,), {"deepspeed_class": name})


# The DeepSpeed classes its ZeRO checkpoints pickle (0.19: the loss scaler in the optimizer states, the stage enum,
# stages 1-2's parameter fragments).
_DEEPSPEED_TYPES: Tuple[Tuple[Any, str], ...] = (
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    *((_record(name), name) for name in ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                                         "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                                         # stages 1-2: where each parameter sits in the rank's flat partition
                                         "deepspeed.utils.tensor_fragment.fragment_address")),
)


def read_deepspeed_file(path: str, trust: bool = False, mmap: bool = False) -> Any:
    """One DeepSpeed checkpoint file (`*_model_states.pt`, `*_optim_states.pt`) with no code run from it; any class
    beyond tensors, plain data and DeepSpeed's records raises UntrustedPickleError naming it and the file."""
    try:
        return load_without_code(path, TRUST, trust, map_location="cpu", extra=_DEEPSPEED_TYPES, mmap=mmap)
    except UntrustedPickleError:
        raise
    except (RuntimeError, EOFError, OSError, ValueError) as exc:  # truncated or not a torch file
        raise CheckpointError(f"{path}: not a readable DeepSpeed checkpoint file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); was it copied whole?") from None


# ------------------------------------------------------------------------------------------ DCP's .metadata
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "MetadataIndex", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch's Size and dtypes, paths: by name; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unsupported global: {module}.{name}")


def read_dcp_metadata(folder: str, trust: bool = False) -> Any:
    """A DCP checkpoint's `.metadata` (a `torch.distributed.checkpoint.metadata.Metadata`) with no code run from it;
    a class beyond DCP's metadata raises UntrustedPickleError naming it and the file."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        data = f.read()
    if trust:
        return pickle.loads(data)
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("unsupported global"):
            raise UntrustedPickleError(
                f"{path}: refused to unpickle ({exc}). hf_zero reads DCP metadata admitting only "
                f"torch.distributed.checkpoint's metadata classes, so that a folder cannot run code; pass {TRUST} "
                f"if you trust whoever wrote it") from None
        raise CheckpointError(f"{path}: not a readable DCP metadata file ({exc}); was it copied whole?") from None
    except (EOFError, ValueError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a readable DCP metadata file ({type(exc).__name__}: {exc}); was it "
                              f"copied whole?") from None


# ------------------------------------------------------------------------------------------ what a folder is
@dataclass
class ForeignCheckpoint:
    """What `inspect_foreign` found: `kind` ("deepspeed" or "dcp"), the ZeRO stage (DeepSpeed), the data-parallel
    world size that wrote it, the step, and the files."""

    kind: str
    folder: str
    world_size: int
    step: Optional[int] = None
    stage: Optional[int] = None
    files: List[str] = field(default_factory=list)

    def describe(self) -> str:
        step = f", step {self.step}" if self.step is not None else ""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.kind == "deepspeed":
            return f"DeepSpeed ZeRO-{self.stage} checkpoint, {ranks}{step}"
        return f"torch.distributed.checkpoint (DCP) checkpoint, written by {ranks}{step}"


_RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _deepspeed_step_folder(folder: str) -> Tuple[str, Optional[int]]:
    """The `global_stepN` folder a DeepSpeed checkpoint's `latest` names (or `folder` itself when it is one)."""
    if _has_rank_files(folder):
        m = re.search(r"global_step(\d+)$", os.path.basename(os.path.normpath(folder)))
        return folder, int(m.group(1)) if m else None
    with open(os.path.join(folder, "latest")) as f:
        tag = f.read().strip()
    if not tag or os.path.basename(tag) != tag or tag in (".", ".."):
        raise CheckpointError(f"{folder}/latest names {tag!r}, not a folder inside {folder}: refused (a tag is one "
                              f"folder name, such as global_step120)")
    step_folder = os.path.join(folder, tag)
    if not os.path.isdir(step_folder):
        raise CheckpointError(f"{folder}/latest names {tag!r}, which is not there: copy the whole checkpoint folder")
    m = re.fullmatch(r"global_step(\d+)", tag)
    return step_folder, int(m.group(1)) if m else None


def _has_rank_files(folder: str) -> bool:
    return os.path.isdir(folder) and any(_RANK_FILE.match(n) for n in os.listdir(folder))


def looks_foreign(folder: str) -> bool:
    """Whether `folder` has the files of a DeepSpeed or DCP checkpoint (names only; nothing is read)."""
    names = ("latest", ".metadata", os.path.join("pytorch_model_fsdp_0", ".metadata"))
    return any(os.path.isfile(os.path.join(folder, n)) for n in names) or _has_rank_files(folder)


def inspect_foreign(folder: str, trust: bool = False) -> Optional[ForeignCheckpoint]:
    """A DeepSpeed ZeRO or DCP checkpoint folder described (reading only its small metadata), or None when it is
    neither. A folder that is one but lacks files raises CheckpointError naming what is missing."""
    if os.path.isfile(os.path.join(folder, ".metadata")):
        meta = read_dcp_metadata(folder, trust)
        files = sorted({info.relative_path for info in (getattr(meta, "storage_data", None) or {}).values()})
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise CheckpointError(f"{folder}: DCP checkpoint without {missing[:3]}: copy the whole folder")
        return ForeignCheckpoint("dcp", folder, max(len(files), 1), files=files)
    if not (os.path.isfile(os.path.join(folder, "latest")) or _has_rank_files(folder)):
        return None
    step_folder, step = _deepspeed_step_folder(folder)
    found = [(int(m.group(1)), int(m.group(2))) for n in os.listdir(step_folder) if (m := _RANK_FILE.match(n))]
    model_parallel = sorted({mp for _, mp in found})
    if model_parallel != [0]:
        raise CheckpointError(f"{step_folder}: a DeepSpeed checkpoint of {len(model_parallel)} model-parallel ranks "
                              f"(mp_rank {model_parallel}): hf_zero reads data-parallel ZeRO checkpoints only "
                              f"(mp_rank_00); merge the tensor-parallel shards first")
    ranks = sorted(dp for dp, _ in found)
    world = len(ranks)
    if ranks != list(range(world)):
        raise CheckpointError(f"{step_folder}: DeepSpeed optimizer states for ranks {ranks}, not 0..{world - 1}: "
                              f"copy every rank's file")
    first = next(n for n in sorted(os.listdir(step_folder)) if _RANK_FILE.match(n))
    states = read_deepspeed_file(os.path.join(step_folder, first), trust)
    inner = states.get("optimizer_state_dict", {}) if isinstance(states, dict) else {}
    stage = inner.get("zero_stage")
    partitions = inner.get("partition_count")
    written = partitions[0] if isinstance(partitions, (list, tuple)) and partitions else partitions
    if isinstance(written, int) and written != world:
        raise CheckpointError(f"{step_folder}: its optimizer states were partitioned {written} ways but {world} "
                              f"rank files are here: copy every rank's file")
    files = sorted(n for n in os.listdir(step_folder) if n.endswith(".pt"))
    return ForeignCheckpoint("deepspeed", step_folder, world, step, int(stage) if stage is not None else None, files)
