"""Running, waiting for and killing the processes of a launch, bounded in time: what `TwoHosts` (hosts.py) runs on
each host, and `run_local` on the machine itself. It imports nothing of hf_zero (nor of benchmarks).

- `base_env(extra)`: os.environ for a CPU launch (ACCELERATE_USE_CPU=1, OMP_NUM_THREADS=1, PYTHONPATH with the
  repository root; launcher variables inherited from outside removed).
- `start(argv, env, log_dir, name, cwd)`: one process in its own session and process group, its stdout and stderr
  in files of `log_dir`; `wait_all(procs, files, names, timeout, peer_grace)` waits for them, bounded (`timeout`
  in all, `peer_grace` for the rest once one has exited), kills the process tree of any past that
  (`kill_tree`) and raises `HostsTimeout`, else returns a `HostRun` per process (returncode, stdout, stderr,
  seconds; `describe()` gives all of it).
- `sh(*argv)`: one short command (an `ip` / `unshare` call of the hosts' setup or teardown), bounded by
  SETUP_TIMEOUT_S.

`worker_logs(log_dir)` reads each rank's own output files of a launch with `--tee 3 --log_dir` (per local rank,
whole), for assertions about what one rank printed.

`run_local(cmd, env, timeout)` runs one command on the machine itself (outside any namespace) with the same bounded
wait, killing its whole process tree on timeout.
"""
from __future__ import annotations

import glob
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

# the checkout's root (the folder holding benchmarks/ and hf_zero/): on the hosts' PYTHONPATH, so `python -m
# benchmarks....` and `import hf_zero` work inside them whatever the working directory
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_TIMEOUT_S = 30  # any one `ip` / `unshare` call of the setup or teardown
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "HF_ZERO_CONFIG_FILE", "ACCELERATE_CONFIG_FILE")


class HostsTimeout(AssertionError):
    """A two-host run did not end in time; `runs` holds what each host printed (and how it ended)."""

    def __init__(self, message: str, runs: "List[HostRun]") -> None:
        super().__init__(message)
        self.runs = runs


@dataclass
class HostRun:
    """How one host's command ended. Unpacks as (returncode, stdout, stderr). `killed`: why the harness killed it
    (None when it exited by itself); a negative returncode is the signal that ended it."""

    returncode: Optional[int]
    stdout: str
    stderr: str
    seconds: float
    killed: Optional[str] = None
    name: str = ""
    leftover: Optional[List[int]] = None  # processes still alive in the host after its command ended (killed)
    exit_barrier_race: bool = False  # set by tests/test_multihost.py's output check (torchrun's benign store race)

    def __iter__(self):
        return iter((self.returncode, self.stdout, self.stderr))

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self) -> str:
        """How the command ended and everything it printed (whole: a failure's cause can be anywhere in it)."""
        how = f"killed by the harness ({self.killed})" if self.killed else f"exit code {self.returncode}"
        if self.leftover:
            how += f"; processes {self.leftover} were still running after it and were killed"
        return (f"===== {self.name}: {how} after {self.seconds:.1f} s\n--- stdout\n{self.stdout}\n"
                f"--- stderr\n{self.stderr}")


def worker_logs(log_dir: str) -> Dict[int, Dict[str, str]]:
    """Each local rank's whole stdout and stderr from a launch with `--tee 3 --log_dir LOG_DIR` (torchrun; `accelerate
    launch` passes both on): {local rank: {"stdout": ..., "stderr": ...}}, read from the files torchrun's workers
    write themselves (`LOG_DIR/<run id>/attempt_<n>/<local rank>/std{out,err}.log`), so a rank's lines are neither
    interleaved with another rank's nor limited to what the launcher's console copy caught. `log_dir` as seen from
    the test process (`hosts.disk_of(i)/...`). Empty when no launch wrote there."""
    out: Dict[int, Dict[str, str]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "std*.log"))):
        rank_dir, name = os.path.split(path)
        local_rank = os.path.basename(rank_dir)
        if not local_rank.isdigit() or name not in ("stdout.log", "stderr.log"):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            out.setdefault(int(local_rank), {}).setdefault(name[:-4], "")
            out[int(local_rank)][name[:-4]] += f.read()
    return out


def sh(*argv: str, timeout: float = SETUP_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


def base_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """os.environ for a CPU launch: ACCELERATE_USE_CPU=1, one OpenMP thread, the repository on PYTHONPATH, no
    launcher variables or hf_zero config inherited from outside."""
    env = dict(os.environ)
    for key in _LAUNCHER_VARS:
        env.pop(key, None)
    for key in [k for k in env if k.startswith(("TORCHELASTIC_", "ACCELERATE_", "GLOO_"))]:
        env.pop(key)
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------------------------ processes
def start(argv: Sequence[str], env: Dict[str, str], log_dir: str, name: str, cwd: Optional[str]):
    out = open(os.path.join(log_dir, f"{name}.stdout"), "w+b")
    err = open(os.path.join(log_dir, f"{name}.stderr"), "w+b")
    try:
        proc = subprocess.Popen(list(argv), env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cwd)  # its own session and process group
    except BaseException:
        out.close()
        err.close()
        raise
    return proc, out, err


def _read(f) -> str:
    f.flush()
    f.seek(0)
    data = f.read().decode("utf-8", "replace")
    f.close()
    return data


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _wait_any(procs: List[subprocess.Popen], timeout: float) -> None:
    """Block until one of the running `procs` exits or `timeout` passes (pidfds where the kernel has them; a short
    poll otherwise)."""
    running = [p for p in procs if p.poll() is None]
    if not running or timeout <= 0:
        return
    fds = [fd for fd in (_pidfd(p.pid) for p in running) if fd is not None]
    try:
        if len(fds) == len(running):
            select.select(fds, [], [], timeout)
        else:
            try:
                running[0].wait(timeout=min(timeout, 0.2))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for fd in fds:
            os.close(fd)


def kill_tree(proc: subprocess.Popen, extra_pids: Sequence[int] = ()) -> None:
    """SIGKILL the process group of `proc`, every descendant (torchrun puts its workers in sessions of their
    own) and `extra_pids`."""
    pids = set(extra_pids)
    try:
        import psutil  # a dependency of Accelerate

        pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
    except Exception:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_all(procs: List[subprocess.Popen], files, names: List[str], timeout: float, peer_grace: float,
             kill_extra=lambda i: ()) -> List[HostRun]:
    """Wait for every process, bounded: `timeout` in all, and `peer_grace` for the rest once one has exited."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    ended: Dict[int, float] = {}
    killed: Dict[int, str] = {}
    while True:
        now = time.monotonic()
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = now
        if len(ended) == len(procs):
            break
        limit, why = deadline, f"still running after the {timeout:.0f} s timeout"
        if ended:
            first = min(ended, key=ended.get)
            if ended[first] + peer_grace < limit:
                limit = ended[first] + peer_grace
                why = (f"still running {peer_grace:.0f} s after {names[first]} exited with "
                       f"{procs[first].returncode}")
        if now >= limit:
            for i, p in enumerate(procs):
                if i not in ended:
                    killed[i] = why
                    kill_tree(p, kill_extra(i))
            for i, p in enumerate(procs):
                if i not in ended:
                    try:
                        p.wait(timeout=SETUP_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        pass
                    ended[i] = time.monotonic()
            break
        _wait_any(procs, limit - now)
    runs = []
    for i, p in enumerate(procs):
        # a launcher that exited may leave workers behind (they run in sessions of their own): never leak them,
        # and say so (a clean launch leaves nothing)
        leftover = list(kill_extra(i))
        if leftover:
            kill_tree(p, leftover)
        out, err = _read(files[i][0]), _read(files[i][1])
        runs.append(HostRun(p.returncode, out, err, ended[i] - t0, killed.get(i), names[i], leftover))
    if killed:
        raise HostsTimeout("; ".join(f"{names[i]} {why}" for i, why in killed.items()) + "\n"
                           + "\n".join(r.describe() for r in runs), runs)
    return runs


def run_local(cmd: Sequence[str], env: Dict[str, str], timeout: float = 300, cwd: Optional[str] = None) -> HostRun:
    """Run `cmd` on this machine (no namespace); on timeout kill its process tree and raise HostsTimeout."""
    log_dir = tempfile.mkdtemp(prefix="hfz_local_")
    try:
        proc, out, err = start(cmd, env, log_dir, "local", cwd)
        try:
            return wait_all([proc], [(out, err)], ["local run"], timeout, peer_grace=timeout)[0]
        finally:
            if proc.poll() is None:
                kill_tree(proc)
                proc.wait(timeout=SETUP_TIMEOUT_S)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
