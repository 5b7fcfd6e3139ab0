"""Pretrained weights read straight into shards: each rank reads only the byte ranges it owns.

A `.safetensors` file is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte range) and
the tensors' bytes, row-major. A flat element range [a, b) of a tensor is therefore one contiguous byte range,
read with one `os.pread`: no memory map, no whole-tensor read, no file a rank does not need is opened. A folder
with `model.safetensors.index.json` maps each key to its file (Hugging Face's sharded layout).

`WeightSource` is what `shard_model(..., weights=...)` reads from; `parameters_on_meta()` builds a module whose
parameters take no memory while its buffers (rotary `inv_freq`, ...) are computed as usual.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch
from torch import nn

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


class WeightsError(ValueError):
    """Pretrained weights that do not fit the model (missing file, unexpected key, shape) or a damaged file, named
    in the message."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute byte offset of the tensor's data in the file

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    # json.loads keeps the last of two equal keys: a second entry for a tensor would silently replace the first
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _check_entry(file: Path, key: str, info: Any, base: int, data_bytes: int,
                 error: Callable[[str], Exception]) -> TensorEntry:
    """One tensor's header entry, checked as the safetensors format promises it."""
    where = f"{file}: tensor {key!r:.200}"  # a hostile name may be megabytes long
    if not isinstance(info, dict):
        raise error(f"{where}: its header entry is {type(info).__name__} {info!r:.80}, not an object with dtype, "
                    f"shape and data_offsets: damaged file")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise error(f"{where} has dtype {dtype!r:.40}, which hf_zero cannot read (it reads {', '.join(_DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise error(f"{where}: shape {shape!r:.80} is not a list of non-negative integers: damaged file")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise error(f"{where}: data_offsets {offsets!r:.80} is not two integers: damaged file")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise error(f"{where}: data_offsets [{begin}, {end}] lie outside the data section (bytes 0..{data_bytes} "
                    f"after the header): the file is truncated or damaged")
    entry = TensorEntry(file, _DTYPES[dtype], tuple(shape), base + begin)
    if end - begin != entry.nbytes:
        raise error(f"{where}: {dtype} {shape!r:.80} takes {entry.nbytes} bytes but its data_offsets [{begin}, {end}] "
                    f"span {end - begin}: damaged file")
    return entry


def read_safetensors_header(file: Union[str, os.PathLike],
                            error: Callable[[str], Exception] = WeightsError) -> Dict[str, TensorEntry]:
    """The tensors of a safetensors file (8-byte little-endian header length, JSON header, data), each checked
    against what the format promises: the header inside the file and at most MAX_HEADER_BYTES (checked before it
    is read, so a hostile length costs no memory), a JSON object of tensor entries (and a string-to-string
    `__metadata__`), known dtypes, shapes of non-negative ints, data offsets inside the data section, spanning
    exactly what shape and dtype need, and no two tensors sharing bytes. Any failure raises `error(message)`
    (WeightsError by default) naming the file and, where there is one, the tensor."""
    file = Path(file)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise error(f"{file} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise error(f"{file} is not a safetensors file: its header length {n} runs past the end of the file "
                        f"({size} bytes)")
        if n > MAX_HEADER_BYTES:
            raise error(f"{file}: header length {n} is over the {MAX_HEADER_BYTES} bytes safetensors allows: "
                        f"damaged or hostile file")
        text = f.read(n)
    if len(text) != n:
        raise error(f"{file} is not a safetensors file: it ends inside its header")
    try:
        header = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise error(f"{file}: the key {exc.key!r:.200} appears twice in the header (one entry would hide the other): "
                    f"damaged file") from None
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested deeper than the parser goes
        raise error(f"{file} is not a safetensors file (its header is not JSON: {str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise error(f"{file} is not a safetensors file: its header is a JSON {type(header).__name__}, not an "
                    f"object of tensors")
    base, data_bytes = 8 + n, size - 8 - n
    entries: Dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise error(f"{file}: '__metadata__' is {info!r:.80}, not an object of strings: damaged file")
            continue
        entries[key] = _check_entry(file, key, info, base, data_bytes, error)
    spans = sorted((e.begin, e.begin + e.nbytes, key) for key, e in entries.items() if e.nbytes)
    for (b1, e1, k1), (b2, e2, k2) in zip(spans, spans[1:]):  # sorted by start: an overlap shows between neighbours
        if b2 < e1:
            raise error(f"{file}: tensors {k1!r:.200} (bytes {b1 - base}..{e1 - base}) and {k2!r:.200} (bytes "
                        f"{b2 - base}..{e2 - base}) overlap: damaged or hostile file")
    return entries


class WeightSource:
    """The tensors of a safetensors file, or of a folder (single file or sharded with an index).

    `read(key, a, b)` returns elements [a, b) of the flattened tensor in the file's dtype. `bytes_read` and
    `files_opened` say what was read.
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        path = Path(os.path.expanduser(str(path)))
        self.path = path
        if path.is_dir():
            index = path / INDEX
            if index.is_file():
                self._file_of = self._read_index(index)
            elif (path / SINGLE).is_file():
                self._file_of = None
                self._single = path / SINGLE
            else:
                raise FileNotFoundError(f"{path} holds neither {SINGLE} nor {INDEX}: give the folder "
                                        f"save_pretrained wrote, or a .safetensors file")
        elif path.is_file():
            self._file_of, self._single = None, path
        else:
            raise FileNotFoundError(f"{path}: no such weights file or folder")
        self._headers: Dict[Path, Dict[str, TensorEntry]] = {}
        self._fds: Dict[Path, int] = {}
        self.bytes_read = 0
        self.files_opened: Set[Path] = set()

    # ---------------------------------------------------------------- index
    @staticmethod
    def _read_index(index: Path) -> Dict[str, Path]:
        """{key: file} of an index; every file a relative path inside the index's folder (no absolute path, no
        `..`), so a hostile index cannot point the reads elsewhere. Symlinks are followed (the Hub's cache
        links each file to a blob outside the snapshot folder)."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise WeightsError(f"{index} is not a safetensors index (no weight_map): {str(exc)[:200]}") from None
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: weight_map is a JSON {type(weight_map).__name__}, not an object of "
                               f"tensor names to file names")
        out = {}
        for key, name in weight_map.items():
            parts = Path(name).parts if isinstance(name, str) and "\0" not in name else None
            if not parts or Path(name).is_absolute() or ".." in parts or "\\" in name:
                raise WeightsError(f"{index}: weight_map places tensor {key!r:.200} in {name!r:.200}, which is not a file "
                                   f"name inside {index.parent}: damaged or hostile index")
            out[key] = index.parent / name
        return out

    def keys(self) -> List[str]:
        if self._file_of is not None:
            return list(self._file_of)
        return list(self._header(self._single))

    def entry(self, key: str) -> TensorEntry:
        file = self._file_of.get(key) if self._file_of is not None else self._single
        if file is None:
            raise KeyError(key)
        header = self._header(file)
        if key not in header:
            raise WeightsError(f"{file} does not hold {key!r}, which {INDEX} places there: the folder is "
                               f"incomplete or the index is stale")
        return header[key]

    def _header(self, file: Path) -> Dict[str, TensorEntry]:
        if file not in self._headers:
            if not file.is_file():
                raise FileNotFoundError(f"{file} is missing: {INDEX} in {self.path} lists it; copy the whole "
                                        f"folder save_pretrained wrote")
            self._headers[file] = read_safetensors_header(file)
        return self._headers[file]

    # ---------------------------------------------------------------- data
    def read(self, key: str, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `key`, in the file's dtype (one pread of those bytes)."""
        e = self.entry(key)
        end = e.numel if end is None else end
        if not 0 <= start <= end <= e.numel:
            raise ValueError(f"{key}: range [{start}, {end}) outside its {e.numel} elements")
        size = e.dtype.itemsize
        out = torch.empty(end - start, dtype=e.dtype)
        if end == start:
            return out
        fd = self._fds.get(e.file)
        if fd is None:
            fd = self._fds[e.file] = os.open(e.file, os.O_RDONLY)
            self.files_opened.add(e.file)
        want = (end - start) * size
        view = memoryview(out.view(torch.uint8).numpy())
        got = 0
        while got < want:  # pread may return less than asked for
            n = os.preadv(fd, [view[got:]], e.begin + start * size + got)
            if n <= 0:
                raise WeightsError(f"{e.file} ends inside tensor {key!r}: the file is truncated")
            got += n
        self.bytes_read += want
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def config_model_type(self) -> Optional[str]:
        """`model_type` of the config.json beside the weights, if there is one."""
        folder = self.path if self.path.is_dir() else self.path.parent
        cfg = folder / "config.json"
        if not cfg.is_file():
            return None
        try:
            return json.loads(cfg.read_text()).get("model_type")
        except ValueError:
            return None


@dataclass
class PretrainedWeights:
    """Where a meta-built model's weights are, and how to initialise what the files lack (set by from_pretrained).

    `init_module(module)` initialises a module's parameters in place (Transformers: the model's `_init_weights`);
    `init_param(model, name)` may return the initial values of one parameter the files lack (adapters added on
    top: PEFT's LoRA init), else None; `ignore_unexpected`: key patterns the files may hold that the model does
    not (Transformers' `_keys_to_ignore_on_load_unexpected`); `rename`: (old, new) substrings that turn a parameter
    name of a wrapped model into its key in the files (PEFT moves a wrapped layer's weight to `base_layer.`)."""

    path: Union[str, os.PathLike]
    init_module: Optional[Callable[[nn.Module], None]] = None
    ignore_unexpected: Tuple[str, ...] = ()
    init_param: Optional[Callable[[nn.Module, str], Optional[torch.Tensor]]] = None
    rename: Tuple[Tuple[str, str], ...] = ()


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters are new meta tensors of the same shapes (the originals, maybe
    already sharded, are never read): materialise what you need with `to_empty`."""
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    return copy.deepcopy(module, memo)


class _MetaParameters(threading.local):
    """Per thread: how many `parameters_on_meta` blocks are open (a thread started inside one starts at 0)."""

    depth = 0


_META = _MetaParameters()
_META_HOOK: List[Any] = []  # the one registration handle, made on first use and kept for the process
_META_HOOK_LOCK = threading.Lock()


def _parameter_to_meta(module: nn.Module, name: str, param: nn.Parameter) -> Optional[nn.Parameter]:
    """torch's parameter-registration hook: in a thread inside `parameters_on_meta`, the parameter being
    registered becomes a meta one of the same class, shape, dtype, requires_grad and attributes; elsewhere None
    (torch keeps the parameter as given)."""
    if not _META.depth or param.device.type == "meta":
        return None
    meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
    meta.__dict__.update(param.__dict__)
    return meta


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules inside this block with their parameters on the meta device (no memory, no init cost later)
    and their buffers computed as usual on the host (rotary `inv_freq` and other non-persistent buffers).

    Only this thread's modules are affected. Through torch's public
    `torch.nn.modules.module.register_module_parameter_registration_hook` (called by every
    `Module.register_parameter`, so by every `self.weight = nn.Parameter(...)`): hf_zero registers its hook once
    per process, on first use, and the hook does nothing outside such a block. No torch attribute is replaced."""
    with _META_HOOK_LOCK:
        if not _META_HOOK:
            _META_HOOK.append(nn.modules.module.register_module_parameter_registration_hook(_parameter_to_meta))
    _META.depth += 1
    try:
        yield
    finally:
        _META.depth -= 1
