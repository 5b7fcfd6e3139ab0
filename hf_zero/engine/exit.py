"""Process groups end before the interpreter does.

gloo runs a process group's collectives on threads of its own (`pt_gloo_runloop`, and its transport's
`gloo_tcp_loop`) that live as long as the group's backend object, that is until the last reference to the
`ProcessGroup` is gone: `destroy_process_group()` unregisters the group and calls its `shutdown()`, which stops
nothing on gloo (torch 2.13: neither does the backend's own `shutdown()` or `abort()`). A group still referenced
when the interpreter finalizes keeps its threads into finalization, where a thread that has to take the GIL is
ended by CPython with pthread_exit through a noexcept frame: "terminate called without an active exception",
SIGABRT, after the script finished correctly (3 runs in 6 of a plain 2-rank torchrun script on a loaded machine).

What keeps a group alive past the end of a script, and what hf_zero does about each (it changes no object of
another library: no defaults rewritten, no attributes of other modules assigned):

- the script itself, which leaves the group alive (no destroy_process_group(): the Trainer, most examples). The
  exit hook destroys it.
- hf_zero's own objects that hold a group (`Comm`, `CheckpointStore`, the background save's `_Saver`). Each
  registers itself with `hold` and has a `release_groups()` that drops every reference it keeps, its parts'
  included (a Comm's strategies and its control plane: the control plane kept hpZ's host groups from
  dist.new_group, and so their threads, into finalization: issue 45's aborts of 4-rank hpZ launches); the exit
  hook calls it on every one still alive. An engine and model the script dropped are garbage the collector can
  free (the hooks torch keeps in C++ hold hf_zero's objects weakly: reducer.weak_hook), so the hook's
  `gc.collect()` frees them and the groups they held; the hook keeps no engine or holder in a local variable while
  it collects.
- the script's own references (a global `tp_group = dist.new_group(...)`, a mesh): the script's to drop.
- default arguments bound at import, torch's bug (upstream): a signature `group=dist.group.WORLD` binds the world
  group of the moment its module is imported. `torch.distributed.nn.functional` is imported by `torch._dynamo`,
  which the first `torch.optim` optimizer imports: a script that builds its optimizer after init_process_group
  holds the world group in ten such defaults for the rest of the process. This module imports it itself, so a
  script that imports hf_zero before it initialises the process group (the usual order) gets those defaults
  bound to None (the default group). The others of the kind (`UPSTREAM_GROUP_DEFAULTS`: torch's
  ZeroRedundancyOptimizer and FSDP's ShardedGradScaler, DeepSpeed's `deepspeed.comm.torch`) take seconds to
  import and are not imported here: a script that imports them after init_process_group keeps the world group
  to the end, and its gloo threads into finalization (docs/engine.md, "Ending a script").

`close_at_exit(engine)` (every ZeroEngine calls it when built, HfZeroAccelerator when built) registers one atexit
hook per process. atexit hooks run before finalization, while every module is intact (also in a rank started by
torch.multiprocessing.spawn: its start method "spawn" returns from the rank's function into multiprocessing's
spawn_main, which ends with sys.exit; "fork" ends the child with os._exit, which runs no hook and does not finalize
the interpreter either), so the hook can: wait for the
collectives still in flight of every live engine; destroy the process groups if they are still alive; release the
groups of every hf_zero object that holds one; and collect garbage. atexit runs hooks last in, first out: hooks
registered after the first engine (or HfZeroAccelerator) was built run before this one and may still use the
process group; hooks registered earlier run after it and find it destroyed.
"""
from __future__ import annotations

import atexit
import gc
import logging
import weakref
from typing import Any, Optional

import torch.distributed as dist

if dist.is_available():
    # Imported before the script initialises its process group, its `group=group.WORLD` defaults bind None
    # instead of the world group (see above: torch._dynamo imports it when the first optimizer is built).
    import torch.distributed.nn.functional  # noqa: F401

logger = logging.getLogger("hf_zero")

# Modules whose function signatures say `group=dist.group.WORLD` (or the like), upstream's bug: imported after
# init_process_group, they hold the world group from then on. The first is imported above; tests/test_exit.py checks
# the list against a live process that imports every module after init_process_group.
UPSTREAM_GROUP_DEFAULTS = (
    "torch.distributed.nn.functional",  # broadcast, gather, ..., all_reduce: imported by torch._dynamo
    "torch.distributed.optim.zero_redundancy_optimizer",  # _broadcast_object
    "torch.distributed.fsdp.sharded_grad_scaler",  # ShardedGradScaler.__init__(process_group=...)
    "deepspeed.comm.torch",  # TorchBackend.barrier / monitored_barrier: imported during Accelerate's prepare
)

_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
_holders: "weakref.WeakSet[Any]" = weakref.WeakSet()
_registered = False


def hold(holder: Any) -> None:
    """Register an hf_zero object that keeps a process group (held weakly here): at exit its `release_groups()`
    drops its references to groups, so that they end before the interpreter."""
    _holders.add(holder)


def close_at_exit(engine: Optional[Any] = None) -> None:
    """Close and free every process group when the interpreter exits (one atexit hook per process, registered by
    the first call); `engine` (anything with `wait()`, held weakly) is waited for first, so that no collective is in
    flight when its group is destroyed."""
    global _registered
    if engine is not None:
        _engines.add(engine)
    if not _registered:
        _registered = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    _wait_for_engines()
    release_process_groups()


def _wait_for_engines() -> None:
    # a frame of its own: its loop variable would otherwise keep the last engine (and, through its Comms, its
    # groups' Python side) alive past the collection below, into finalization
    for engine in list(_engines):
        try:
            engine.wait()
        except Exception as exc:  # a peer that died: close the groups anyway
            logger.warning("hf_zero: at exit, waiting for the engine's collectives failed (%s: %s)",
                           type(exc).__name__, exc)


def release_process_groups() -> int:
    """Destroy the process groups if they are alive, have every live hf_zero object that holds a group drop it
    (`hold`), and collect garbage (engines and models the script dropped). Returns how many hf_zero objects released
    their groups. Local to this process; call it only when no collective will follow (at exit): an engine whose
    groups were released raises on its next collective."""
    if not dist.is_available():
        return 0
    if dist.is_initialized():
        dist.destroy_process_group()
    released = _release_holders()
    gc.collect()  # groups in reference cycles (a dropped engine, its model) go now, not at finalization
    return released


def _release_holders() -> int:
    # a frame of its own, like _wait_for_engines: no local outlives it to keep a holder alive through the collection
    holders = list(_holders)
    for holder in holders:
        holder.release_groups()
    return len(holders)
