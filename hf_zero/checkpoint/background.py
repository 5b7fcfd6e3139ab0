"""Asynchronous checkpoint saves: `save_checkpoint(..., async_save=True)` copies each rank's state to host memory
on the training thread and writes, agrees and publishes it on a thread of its own (`SaveHandle`).

One save per engine is in flight at a time: the next save, a load, `engine.wait_for_save()` and `engine.close()`
wait for it first. A failure is kept until it is reported, once, by whichever of those (or the handle's
`result()`) comes first; a process that ends with a save in flight waits for it at exit and logs its failure, so
no error is lost. The host copies stay allocated between saves and are reused (one copy of the rank's shard, in
pinned memory on a GPU) until `engine.close()`.

The background save's collectives (the ranks' agreement on every step, the manifest's broadcast) go over a gloo
group of its own, made once per engine at its first asynchronous save (`dist.new_group` is collective: every rank
makes it at the same save). Over the engine's own group they would interleave with the training thread's
all-gathers and reduce-scatters in an order that differs between ranks, and the ranks would exchange the wrong
messages or hang; gloo, because the save exchanges Python objects on CPU whatever the training backend (NCCL).
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..engine.exit import hold
from .source import CheckpointError

if TYPE_CHECKING:
    from ..engine import ZeroEngine
    from ..engine.comm import Comm

__all__ = ["SaveHandle", "close", "comm_for", "host_buffers", "keep_host_buffers", "pending", "start",
           "wait_for_save"]
logger = logging.getLogger("hf_zero")


class SaveHandle:
    """A checkpoint save running in the background. `result()` waits for it and returns the folder, or raises
    CheckpointError naming the folder if the save failed (every call; the error counts as reported)."""

    def __init__(self, directory: Path, run: Callable[[], Path]) -> None:
        self.directory = directory
        self._run = run
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[[Path], None]] = []
        self._lock = threading.Lock()
        self._ran = False  # run() returned or raised: callbacks added from now on are called at once
        self.reported = False
        self._thread = threading.Thread(target=self._main, name=f"hf_zero save {directory.name}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # kept for the training thread
            self._error = exc
        finally:
            self._run = None  # the snapshot's host copies go with it
            with self._lock:
                self._ran, callbacks = True, list(self._callbacks)
            for fn in callbacks:
                self._call(fn)
            self._done.set()

    def _call(self, fn: Callable[[Path], None]) -> None:
        if self._error is not None:
            return
        try:
            fn(self.directory)
        except Exception as exc:  # a failing callback does not fail the save
            logger.warning("hf_zero: after saving %s: %s: %s", self.directory, type(exc).__name__, exc)

    def add_done_callback(self, fn: Callable[[Path], None]) -> None:
        """Call `fn(directory)` once the save succeeded: on the save's thread, or here if it already finished.
        `fn` must not use a collective."""
        with self._lock:
            if not self._ran:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def done(self) -> bool:
        """Whether the save finished (successfully or not)."""
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> Path:
        """Wait for the save (at most `timeout` seconds: TimeoutError) and return its folder; CheckpointError if it
        failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the save of {self.directory} is still running after {timeout} s")
        if self._error is None:
            return self.directory
        self.reported = True
        exc = self._error
        text = str(exc) if isinstance(exc, CheckpointError) and str(self.directory) in str(exc) else \
            f"saving the checkpoint to {self.directory} in the background failed: {type(exc).__name__}: {exc}"
        raise CheckpointError(text) from exc

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error is not None else "done")
        return f"SaveHandle({str(self.directory)!r}, {state})"


class _Saver:
    """One engine's background saves: the process group they talk over and the save in flight (or failed and not
    yet reported)."""

    def __init__(self, comm: "Comm") -> None:
        self.comm: Optional["Comm"] = comm
        self.pending: Optional[SaveHandle] = None
        self.buffers: Optional[Dict[str, torch.Tensor]] = None  # the last save's host copies, reused by the next
        hold(self)

    def release_groups(self) -> None:
        """At exit (engine/exit.py): drop the save group, so that it ends before the interpreter."""
        self.comm = None


class _EngineSide:
    """What the engine calls as `engine.background_save` (the engine imports nothing of the checkpoint layer)."""

    def __init__(self, engine: "ZeroEngine") -> None:
        self._engine = weakref.ref(engine)  # the engine owns this; a strong reference back would keep it alive

    def wait(self) -> Optional[Path]:
        engine = self._engine()
        return wait_for_save(engine) if engine is not None else None

    def close(self) -> None:
        engine = self._engine()
        if engine is not None:
            close(engine)


def _new_saver(engine: "ZeroEngine", comm: "Comm") -> _Saver:
    saver = _savers[engine] = _Saver(comm)
    engine.background_save = _EngineSide(engine)
    return saver


_savers: "weakref.WeakKeyDictionary[Any, _Saver]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_exit_hook = False


def comm_for(engine: "ZeroEngine") -> "Comm":
    """The Comm background saves of `engine` talk over. Collective the first time (on every rank of the engine's
    group, at the same save): a new gloo group over the same ranks. A one-rank world (or a dry run's simulated one)
    needs no collective: the engine's own Comm answers locally."""
    saver = _savers.get(engine)
    if saver is not None and saver.comm is not None:
        return saver.comm
    from ..engine.comm import Comm
    from ..engine.control import Control

    if not isinstance(engine.comm.control, Control):
        comm = engine.comm
    else:
        ranks, timeout = engine.comm.global_ranks, _timeout(engine.comm.group)
        if engine.comm.group is None:  # the world: new_group needs every rank of the world anyway
            group = dist.new_group(backend="gloo", timeout=timeout)
        else:  # a sub-group's members only (the other ranks do not save with this engine)
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        comm = Comm(group)  # registers itself for release at exit (engine/exit.py)
    with _lock:
        if saver is None:
            saver = _new_saver(engine, comm)
        saver.comm = comm
    return comm


def _timeout(group: Optional[Any]) -> Optional[Any]:
    """The engine's group's collective timeout, for the save's group (new_group's default is gloo's 30 minutes: a
    peer that died mid-save would hold the survivors that long)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or a torch without these internals: the default
            continue
    return None


def start(engine: "ZeroEngine", directory: Path, run: Callable[[], Path]) -> SaveHandle:
    """Run `run()` (the save's writes and agreements, which must not touch the engine) on a thread; the engine's
    previous background save must be finished (`wait_for_save`)."""
    global _exit_hook
    with _lock:
        saver = _savers.get(engine)
        if saver is None:  # comm_for made it, unless a caller skipped it (one rank: the engine's own Comm)
            saver = _new_saver(engine, engine.comm)
        if not _exit_hook:  # registered after the engine's close_at_exit hook, so it runs before the groups close
            _exit_hook = True
            atexit.register(_wait_at_exit)
        handle = saver.pending = SaveHandle(directory, run)
    return handle


def host_buffers(engine: "ZeroEngine") -> Optional[Dict[str, torch.Tensor]]:
    """The host copies of the engine's last background save (finished: call after `wait_for_save`), to copy the
    next save's state into."""
    saver = _savers.get(engine)
    return saver.buffers if saver is not None else None


def keep_host_buffers(engine: "ZeroEngine", tensors: Optional[Dict[str, torch.Tensor]]) -> None:
    """Keep `tensors` for the engine's next background save (one host copy of the rank's shard stays allocated
    between saves: fresh memory would cost the training thread its page faults, or pinning, at every save)."""
    saver = _savers.get(engine)
    if saver is not None and tensors is not None:
        saver.buffers = tensors


def close(engine: "ZeroEngine") -> None:
    """Wait for the engine's background save (raising its error) and free its host copies."""
    try:
        wait_for_save(engine)
    finally:
        saver = _savers.get(engine)
        if saver is not None:
            saver.buffers = None


def pending(engine: "ZeroEngine") -> Optional[SaveHandle]:
    """The engine's background save that is running or failed unreported, if any."""
    saver = _savers.get(engine)
    return saver.pending if saver is not None else None


def wait_for_save(engine: "ZeroEngine") -> Optional[Path]:
    """Wait for `engine`'s background save, if one is in flight; return its folder, or raise its CheckpointError
    (once: a failure already reported by the handle's result() is not raised again)."""
    saver = _savers.get(engine)
    handle = saver.pending if saver is not None else None
    if handle is None:
        return None
    already, saver.pending = handle.reported, None
    try:
        return handle.result()
    except CheckpointError:
        if already:
            return None
        raise


def _wait_at_exit() -> None:
    """atexit: let every save in flight finish (its thread is a daemon) and log a failure nobody was told of."""
    for saver in list(_savers.values()):
        handle, saver.pending = saver.pending, None
        if handle is None:
            continue
        already = handle.reported
        try:
            handle.result()
        except CheckpointError as exc:
            if not already:
                logger.error("hf_zero: at exit: %s", exc)
