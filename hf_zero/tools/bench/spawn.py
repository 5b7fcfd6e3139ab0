"""Bench workers: spawn one group of processes, wait for it with a bound, and read back what failed first."""
from __future__ import annotations

import json
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

ERROR_GRACE_S = 20  # after one rank died, how long its peers get to fail on their own before being killed


def spawn(target: Callable, args_of: Callable[[int], tuple], n: int, timeout_s: float, threads: int,
          env: Optional[Dict[str, str]] = None) -> Tuple[List[Any], bool]:
    """Start `n` spawned processes target(*args_of(i)) with OMP_NUM_THREADS=`threads` (and `env`) and wait for them:
    a failure gives the others ERROR_GRACE_S to fail on their own, `timeout_s` bounds the whole; whatever is still
    alive then is killed. Returns (the processes, whether the timeout struck)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    env = {"OMP_NUM_THREADS": str(threads), **(env or {})}  # inherited by the children
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    procs = []
    try:
        for i in range(n):
            p = ctx.Process(target=target, args=args_of(i), daemon=True)
            p.start()
            procs.append(p)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    timed_out = wait_bounded(lambda: [p.exitcode for p in procs], lambda: multiprocessing.connection.wait(
        [p.sentinel for p in procs if p.is_alive()], timeout=1.0), ERROR_GRACE_S, timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return procs, timed_out


def wait_bounded(exit_codes: Callable[[], Sequence[Optional[int]]], pause: Callable[[], Any], grace_s: float,
                 timeout_s: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait until every process has exited (`exit_codes()` holds no None), or until `grace_s` after the first
    failure (a rank blocked in a collective with a dead peer never exits on its own), or `timeout_s` in all;
    True when the timeout ended it. `pause()` blocks a little: until a process exits, or one poll interval."""
    start, first_failure = clock(), None
    while True:
        codes = exit_codes()
        if all(c is not None for c in codes):
            return False
        now = clock()
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = now
        if first_failure is not None and now - first_failure > grace_s:
            return False
        if now - start > timeout_s:
            return True
        pause()


def first_error(out_dir: Union[str, Sequence[str]], world: int) -> Optional[str]:
    """The error file of the rank that failed first for a reason of its own (ranks that only lost a peer go last);
    `out_dir` may be several folders (one per host), each holding its own ranks' files."""
    texts = {}
    for folder in ([out_dir] if isinstance(out_dir, str) else out_dir):
        for r in range(world):
            path = os.path.join(folder, f"error_rank{r}.txt")
            if os.path.exists(path) and r not in texts:
                with open(path) as f:
                    texts[r] = f.read()
    if not texts:
        return None
    order = sorted(texts, key=lambda r: ("by peer" in texts[r] or "Connection reset" in texts[r], r))
    return f"rank {order[0]}: " + texts[order[0]].strip()


def error_summary(error: str) -> str:
    """The last line of a traceback (the exception), with its rank, for a table's status column."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    rank = error.split(":", 1)[0] if error.startswith("rank ") else ""
    text = f"{rank}: {lines[-1]}" if rank and lines else (lines[-1] if lines else error)
    return text if len(text) <= 160 else text[:157] + "..."


def run_group(target: Callable, args_of: Callable[[int, str, str], tuple], world: int, timeout_s: float,
              threads: int, prefix: str) -> Tuple[Optional[Any], Optional[str]]:
    """Host a store on a free port, spawn `world` workers target(*args_of(rank, port, out_dir)) and wait for them
    (`spawn`); returns (rank 0's result from `worker_done`, None) or (None, the first error: a worker's traceback,
    the timeout, or the exit codes). The workers' folder (`prefix` names it) is removed."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    out_dir = tempfile.mkdtemp(prefix=prefix)
    port = store.port
    procs, timed_out = spawn(target, lambda rank: args_of(rank, port, out_dir), world, timeout_s, threads)
    del store
    result_path = os.path.join(out_dir, "result.json")
    error = first_error(out_dir, world)
    result = None
    if error is None and os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    elif error is None:
        error = (f"timed out after {timeout_s:.0f}s" if timed_out
                 else f"no result; worker exit codes {[p.exitcode for p in procs]}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return result, error


def worker_done(rank: int, out_dir: str, result: Any) -> None:
    """A worker's normal end: rank 0 writes `result` (atomically), every rank leaves the group and exits 0 without
    interpreter teardown (destroying the group's and store's C++ threads at exit sometimes aborts after the work)."""
    try:
        if rank == 0:
            path = os.path.join(out_dir, "result.json")
            with open(path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(path + ".tmp", path)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        worker_failed(rank, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_failed(rank: int, out_dir: str) -> None:
    """A worker's failure: its traceback to error_rank{rank}.txt (first_error reads it), then exit 1 at once, so
    that peers blocked in a collective with it fail on the closed connection."""
    with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w") as f:
        f.write(traceback.format_exc())
    sys.stderr.flush()
    os._exit(1)
