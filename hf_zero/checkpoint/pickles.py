"""Checkpoint files that are pickles, read with no code run from them.

`load_without_code` reads one file with `torch.load(weights_only=True)`: tensors, plain Python data, numpy's
RNG-state data types, whatever the caller names in `extra` (a stand-in object for a class name, e.g. an inert
record for a DeepSpeed type that is never imported), and whatever the user allowed with
`torch.serialization.add_safe_globals`. Anything else is refused with `UntrustedPickleError`, naming the file and
the opt-in that trusts it; `trust=True` unpickles in full. Nothing outside the call changes (torch's
`safe_globals` context is scoped to it).
"""
from __future__ import annotations

import os
import pickle
import re
from typing import Any, List, Sequence, Tuple

import torch

from .source import CheckpointError

__all__ = ["UntrustedPickleError", "load_without_code", "refusal_reason", "untrusted_error"]


class UntrustedPickleError(CheckpointError):
    """A checkpoint file holds a pickle that cannot be loaded without running code from it (torch.load with
    weights_only=True refuses it). The message names the file and the opt-in that trusts it."""


def _numpy_data_types() -> List[Any]:
    """What the numpy part of an RNG state (np.random.get_state(): a uint32 ndarray) needs besides plain data:
    numpy's array and dtype classes and its array reconstructor, which builds an empty array of an allowed class
    (the unpickler admits only allowed classes). Data types only: no function that could do anything else."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 pickles a dtype by its class (UInt32DType, ...)
    if dtypes is not None:
        allowed += [t for t in vars(dtypes).values() if isinstance(t, type) and issubclass(t, np.dtype)]
    return allowed


def refusal_reason(exc: BaseException) -> str:
    """The reason in torch's weights-only error, without its advice to load with weights_only=False or to allow
    the refused global (which is the payload). torch words it two ways: "WeightsUnpickler error: ..." and, for a
    global of a module it blocks outright (os, posix, subprocess, ...), "Trying to load unsupported GLOBAL ...".
    """
    text = str(exc)
    m = (re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.? Please |\n\s*\n|$)", text, re.S)
         or re.search(r"(Trying to load unsupported GLOBAL [^\n]+?)\.?(?:\n|$)", text))
    return " ".join((m.group(1) if m else text.strip().splitlines()[0] if text.strip() else type(exc).__name__)
                    .split())


def untrusted_error(f: Any, exc: BaseException, opt_in: str) -> UntrustedPickleError:
    """The refusal of file `f` (a path or an open file), naming it and `opt_in`."""
    name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", repr(f))
    return UntrustedPickleError(
        f"{name}: refused to unpickle ({refusal_reason(exc)}). hf_zero reads checkpoint files with "
        f"torch.load(weights_only=True) so that a folder cannot run code; this file needs full unpickling, "
        f"which runs whatever code it holds. If you trust whoever wrote the folder, pass {opt_in}; or allow "
        f"just the classes it needs with torch.serialization.add_safe_globals([...])")


def load_without_code(f: Any, opt_in: str, trust: bool = False, map_location: Any = None,
                      extra: Sequence[Tuple[Any, str]] = (), mmap: bool = False) -> Any:
    """One checkpoint file read with no code run from it: `torch.load(weights_only=True)` with numpy's RNG-state
    data types allowed besides torch's own and whatever the user allowed with
    `torch.serialization.add_safe_globals`; a refusal raises `UntrustedPickleError` naming the file and `opt_in`.
    `trust=True` unpickles in full (`weights_only=False`). `mmap=True` (a path only) maps the tensors' storage
    instead of reading it: pages are read when touched. Nothing outside this call changes."""
    if trust:
        return torch.load(f, map_location=map_location, weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(_numpy_data_types() + list(extra)):
            return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise untrusted_error(f, exc, opt_in) from None
