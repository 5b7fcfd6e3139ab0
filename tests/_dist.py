"""Run scenario functions in W gloo worker processes and hand their results back to the test process.

A scenario is ``(name, fn, kwargs)``; every rank calls ``fn(rank, world_size, **kwargs)`` and must return something
picklable.  All scenarios of one world size run in ONE spawn, one after the other, on one process group.  If a
scenario raises (on any rank) or hangs, that spawn is stopped, the scenario is recorded as failed with every rank's
traceback, and the remaining scenarios are run in a fresh spawn, so one failure does not hide the others.

Functions must be importable by the spawned children: define them at module level (test modules are importable
because the child gets the parent's ``sys.path``).
"""
from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.multiprocessing as mp

Scenario = Tuple[str, Callable[..., Any], Dict[str, Any]]

PG_TIMEOUT_S = 120  # gloo collective timeout inside the workers: a mismatched collective raises instead of hanging
STALL_TIMEOUT_S = 300  # no scenario finished for this long: kill the spawn and call the running scenario hung
ERROR_GRACE_S = 30  # after one rank failed, how long the others get to fail/exit on their own before being killed


class WorkerError(AssertionError):
    """A scenario failed in at least one worker; the message carries each rank's traceback."""


# ---------------------------------------------------------------------------------------------------------- worker
def _write(out_dir: str, rank: int, idx: int, payload: Tuple[str, Any]) -> None:
    path = os.path.join(out_dir, f"r{rank}_s{idx}.pkl")
    try:
        data = pickle.dumps(payload)
    except Exception:  # result not picklable: report that instead
        data = pickle.dumps(("err", "result could not be pickled:\n" + traceback.format_exc()))
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # atomic: the parent never reads half a file


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, scenarios: List[Tuple[int, Scenario]]):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
    except BaseException:
        _write(out_dir, rank, scenarios[0][0], ("err", "init_process_group failed:\n" + traceback.format_exc()))
        raise
    for idx, (name, fn, kwargs) in scenarios:
        try:
            payload = ("ok", fn(rank, world_size, **kwargs))
        except BaseException:
            payload = ("err", traceback.format_exc())
        _write(out_dir, rank, idx, payload)
        if payload[0] == "err":
            os._exit(1)  # peers blocked in a collective with us get a connection error and fail too
        dist.barrier()  # scenario boundaries line up on all ranks (outside any engine's counted collectives)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------- parent
def _spawn_once(world_size: int, scenarios: List[Tuple[int, Scenario]]) -> Dict[int, Dict[int, Tuple[str, Any]]]:
    """One spawn over `scenarios`; returns {scenario index: {rank: ("ok", result) | ("err", text)}}."""
    tmp = tempfile.mkdtemp(prefix="hfz_dist_")
    try:
        return _spawn_in(tmp, world_size, scenarios)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _spawn_in(tmp: str, world_size: int, scenarios: List[Tuple[int, Scenario]]):
    store_path = os.path.join(tmp, "store")
    ctx = mp.get_context("spawn")
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker, args=(rank, world_size, store_path, tmp, scenarios), daemon=True)
            p.start()
            procs.append(p)
    except BaseException:
        for p in procs:  # do not leave the started ranks waiting for the missing ones
            p.kill()
        raise
    finally:
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp

    def n_files() -> int:
        return sum(1 for f in os.listdir(tmp) if f.endswith(".pkl"))

    last_progress, seen = time.monotonic(), 0
    first_failure: Optional[float] = None
    hung = False
    while any(p.is_alive() for p in procs):
        # event-driven wait on process exit (bounded so file progress and deadlines are checked)
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
        now = time.monotonic()
        count = n_files()
        if count != seen:
            seen, last_progress = count, now
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if failed and first_failure is None:
            first_failure = now
        if first_failure is not None and now - first_failure > ERROR_GRACE_S:
            break
        if now - last_progress > STALL_TIMEOUT_S:
            hung = True
            break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()

    results: Dict[int, Dict[int, Tuple[str, Any]]] = {}
    for f in os.listdir(tmp):
        if f.endswith(".pkl"):
            rank, idx = (int(x[1:]) for x in f[:-4].split("_"))
            with open(os.path.join(tmp, f), "rb") as fh:
                results.setdefault(idx, {})[rank] = pickle.load(fh)
    # the first scenario not finished on every rank gets a description of what happened to the missing ranks
    for idx, _ in scenarios:
        got = results.setdefault(idx, {})
        if len(got) == world_size and all(v[0] == "ok" for v in got.values()):
            continue
        for rank, p in enumerate(procs):
            if rank not in got:
                why = "hung (no scenario finished for %ds), killed" % STALL_TIMEOUT_S if hung else (
                    f"no result; process exit code {p.exitcode}")
                got[rank] = ("err", why)
        break
    return results


def run_scenarios(world_size: int, scenarios: Sequence[Scenario]) -> Dict[str, Any]:
    """Run all scenarios for one world size; returns {name: [result of rank 0, ..., rank W-1] | WorkerError}."""
    names = [s[0] for s in scenarios]
    assert len(set(names)) == len(names), "scenario names must be unique"
    out: Dict[str, Any] = {}
    pending = list(enumerate(scenarios))
    while pending:
        results = _spawn_once(world_size, pending)
        for idx, (name, _, _) in pending:
            got = results.get(idx, {})
            if len(got) == world_size and all(v[0] == "ok" for v in got.values()):
                out[name] = [got[r][1] for r in range(world_size)]
                continue
            # ranks that merely lost their peer ("Connection closed by peer") go last: the cause is elsewhere
            order = sorted(got, key=lambda r: ("by peer" in str(got[r][1]), r))
            text = "\n".join(
                f"----- rank {r}: " + (got[r][1] if got[r][0] == "err" else "finished") for r in order
            )
            out[name] = WorkerError(f"scenario {name!r} failed at world size {world_size}:\n{text}")
            pending = [(i, s) for i, s in pending if i > idx]
            break
        else:
            pending = []
    return out


class DistResults:
    """Lazily runs every scenario of a world size once and caches the results (use one per test module).

    `scenarios_for(world_size)` returns the scenario list for that world size.  Calling `results(W, name)` runs the
    whole list for W on first use and returns the per-rank results of `name`, or raises its WorkerError.
    """

    def __init__(self, scenarios_for: Callable[[int], Sequence[Scenario]]):
        self._scenarios_for = scenarios_for
        self._cache: Dict[int, Dict[str, Any]] = {}

    def __call__(self, world_size: int, name: str) -> List[Any]:
        if world_size not in self._cache:
            self._cache[world_size] = run_scenarios(world_size, self._scenarios_for(world_size))
        res = self._cache[world_size][name]
        if isinstance(res, WorkerError):
            raise res
        return res
