"""Two "hosts" on this one machine, made of Linux namespaces, for multi-host launches (`accelerate launch
--num_machines 2`, `torchrun --nnodes 2`, `hf-zero bench --hosts 2`) without a cluster, optionally joined by a
rate-limited link.

    with TwoHosts(link_rate="200mbit") as hosts:    # or the `two_hosts` fixture of tests/test_multihost.py
        port = hosts.free_port(0)
        a, b = hosts.run([cmd_for_host_a, cmd_for_host_b], env={"X": "1"}, timeout=300)
        rc, out, err = a                            # each result unpacks as (returncode, stdout, stderr)

The tests use it through tests/_hosts.py (a re-export); `hf-zero bench --hosts 2` (tools/bench/multihost.py) runs
its systems across it. It imports nothing of hf_zero.

What each host is:

- network: its own network namespace (`hfz<pid><n>a` / `...b`), the two joined by a veth pair whose ends carry
  the host's address in a private /24 that exists only inside these two namespaces (10.2xx.yy.1 and .2, derived
  from the pid), and `lo` up. `GLOO_SOCKET_IFNAME` is set to the host's veth end, so gloo talks over it.
- link: unlimited (veth: memory copies, several GB/s) unless `link_rate` is given (tc's units: "100mbit",
  "1gbit", "10mbps" = bytes; a bare number is bits/s). Then each veth end gets a token-bucket filter as its root
  qdisc, `tc qdisc replace dev END root tbf rate R burst B latency L`, inside its namespace, so each direction
  carries at most R (`burst`: the bucket, by default 4 ms of R and at least 32 KiB; `latency`: how long a packet
  may queue before tbf drops it, default 200 ms: deep enough that gloo's bulk transfers queue rather than
  drop). No delay is added (netem is not on these machines). `set_link_rate(R)` changes it between runs (None:
  unlimited again); `measure_link(nbytes)` times one bulk TCP transfer from host B to host A and returns bits/s.
- name: its own hostname (a UTS namespace), and an /etc/hosts of its own that names both hosts with their
  addresses (cluster hosts resolve each other's names; torchrun's c10d rendezvous resolves the local hostname).
- disk: its own folder, mounted at the SAME path (`hosts.disk`) inside both hosts but with different contents;
  the folder holding both hosts' real folders is covered by a tmpfs inside each host, so no host can see the
  other's disk. Everything else of the machine (the repository, the Python installation) is seen by both, as a
  shared software image would be. From the test process, host i's disk is `hosts.disk_of(i)`.

Each command runs as
`ip netns exec NS unshare --uts --mount --propagation private sh -c '<setup>; exec "$@"' sh CMD...` where setup
sets the hostname, binds /etc/hosts and the host's disk and hides the real folders. Its environment is
`hosts.env(i, extra)`: os.environ plus ACCELERATE_USE_CPU=1, OMP_NUM_THREADS=1, PYTHONPATH with the repository root,
GLOO_SOCKET_IFNAME, and HOME / HF_HOME / HF_ZERO_CACHE / TMPDIR on the host's disk (so Accelerate finds no stray
config and no cache is shared between the hosts); launcher variables inherited from outside (RANK, MASTER_ADDR,
...) and HF_ZERO_CONFIG_FILE are removed.

API (`TwoHosts`):

- `addr(i)`, `hostname(i)`, `ifname(i)`, `netns(i)`: host i's address, hostname, veth interface, namespace name.
- `link_rate`: the rate as given (None: unlimited); `link_rate_bps`: in bits/s; `set_link_rate(rate)`;
  `measure_link(nbytes)`: bits/s of one timed bulk TCP transfer over the link; `parse_rate("100mbit")` = 1e8.
- `disk`: the disk path as seen inside a host; `disk_of(i)`: host i's real folder, as seen from the test process.
- `free_port(i)`: a TCP port the OS hands out inside host i's namespace (binds port 0 there).
- `wrap(i, cmd)`: the argv that runs `cmd` on host i (for callers that manage the process themselves).
- `run(cmds, env=None, timeout=300, peer_grace=30)`: starts both hosts' commands at once, each in its own process
  group, and returns `[HostRun, HostRun]` (returncode, stdout, stderr, seconds; `describe()` gives all of it).
  Bounded: once one host's command has exited, the other gets `peer_grace` seconds more (a launcher whose peer
  died must not sit out torchrun's 300 s exit barrier); past that, or past `timeout` in all, every process of both
  hosts is killed and `HostsTimeout` is raised, its message holding both hosts' output. `env`: extra variables for
  both hosts (a dict) or per host (a list of two dicts).
- `close()` (also on leaving the `with` block, and at interpreter exit as a fallback): kills whatever still runs
  in the namespaces, deletes both namespaces (and with them the veth pair) and the folders. Idempotent. A harness
  killed before its teardown (SIGKILL) leaves them behind; the next `TwoHosts()` deletes those whose pid is gone.

`worker_logs(log_dir)` reads each rank's own output files of a launch with `--tee 3 --log_dir` (per local rank,
whole), for assertions about what one rank printed.

`TwoHosts()` raises `HostsUnavailable` (with the reason) where namespaces cannot be made: not root, no `ip` or
`unshare` (or `tc` for a link rate), `ip netns add`, the veth or the qdisc refused. `run_local(cmd, env, timeout)` runs one command on the machine
itself (outside any namespace) with the same bounded wait, killing its whole process tree on timeout.
"""
from __future__ import annotations

import atexit
import glob
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

# the folder holding the hf_zero package (the repository root of a checkout): on the hosts' PYTHONPATH
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETUP_TIMEOUT_S = 30  # any one `ip` / `unshare` call of the setup or teardown
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "HF_ZERO_CONFIG_FILE", "ACCELERATE_CONFIG_FILE")
_counter = 0


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (tests skip on it)."""


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


def _sh(*argv: str, timeout: float = SETUP_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
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
def _start(argv: Sequence[str], env: Dict[str, str], log_dir: str, name: str, cwd: Optional[str]):
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


def _kill_tree(proc: subprocess.Popen, extra_pids: Sequence[int] = ()) -> None:
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
                    _kill_tree(p, kill_extra(i))
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
            _kill_tree(p, leftover)
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
        proc, out, err = _start(cmd, env, log_dir, "local", cwd)
        try:
            return wait_all([proc], [(out, err)], ["local run"], timeout, peer_grace=timeout)[0]
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
                proc.wait(timeout=SETUP_TIMEOUT_S)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the hosts
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
               "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40}


def parse_rate(rate: Union[str, float, int]) -> float:
    """Bits per second of a rate written as tc writes it: "100mbit", "1gbit", "2.5kbit", "10mbps" (bytes), or a
    bare number (bits/s). Raises ValueError for anything else or a rate that is not positive."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(rate))
        unit = m.group(2).lower() if m else ""
        if not m or (unit and unit not in _RATE_UNITS):
            raise ValueError(f"link rate {rate!r}: give a number and one of tc's units ({', '.join(_RATE_UNITS)}), "
                             f"e.g. 100mbit")
        value = float(m.group(1)) * _RATE_UNITS.get(unit, 1)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"link rate {rate!r} must be a positive number of bits per second")
    return value


def _tbf_args(bps: float, burst: Optional[int], latency: str) -> List[str]:
    """tc's arguments of the token bucket for `bps`: the rate in whole bits/s (no unit for tc to read otherwise),
    the bucket (`burst` bytes, default 4 ms of the rate, at least 32 KiB) and the queue's latency bound."""
    if burst is None:
        burst = max(32 * 1024, int(bps / 8 * 0.004))
    return ["rate", f"{int(round(bps))}bit", "burst", str(int(burst)), "latency", latency]


# Receives one TCP stream on host A and prints its bytes and the seconds from its first byte to its end.
_SINK = r"""
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - (t0 or time.perf_counter()), flush=True)
"""
_SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
left = int(sys.argv[3]); block = b"\0" * (1 << 20)
while left > 0:
    c.sendall(block[:min(left, len(block))]); left -= min(left, len(block))
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


class TwoHosts:
    N = 2

    def __init__(self, link_rate: Union[None, str, float] = None, burst: Optional[int] = None,
                 latency: str = "200ms") -> None:
        self._closed = False
        self._made: List[str] = []
        self._base: Optional[str] = None
        self._burst, self._latency = burst, latency
        self.link_rate: Union[None, str, float] = None
        self.link_rate_bps: Optional[float] = None
        if link_rate is not None:
            parse_rate(link_rate)  # a bad rate is the caller's error, not an unavailable machine
        reason = self._unavailable(need_tc=link_rate is not None)
        if reason:
            raise HostsUnavailable(reason)
        atexit.register(self.close)
        try:
            self._setup()
            if link_rate is not None:
                self.set_link_rate(link_rate)
        except BaseException as exc:
            self.close()
            if isinstance(exc, (RuntimeError, OSError, subprocess.TimeoutExpired)):
                raise HostsUnavailable(f"could not make the two hosts: {exc}") from exc
            raise

    @staticmethod
    def _unavailable(need_tc: bool = False) -> Optional[str]:
        if sys.platform != "linux":
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "making network namespaces needs root"
        for tool in ("ip", "unshare", "mount", "hostname", "sh") + (("tc",) if need_tc else ()):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed" + (" (iproute2; it sets the link rate)" if tool == "tc" else "")
        return None

    # ---------------------------------------------------------------- setup / teardown
    @staticmethod
    def _reap_stale() -> None:
        """Delete the namespaces and folders of harnesses whose process is gone (killed before its teardown ran):
        their names carry that process's pid. A live process's are never touched."""
        listed = _sh("ip", "netns", "list", check=False).stdout.split()
        for name in listed:
            m = re.fullmatch(r"hfz(\d+)n\d+[ab]", name)
            if not m or int(m.group(1)) == os.getpid() % 10**7:
                continue
            try:
                os.kill(int(m.group(1)), 0)
                continue  # that harness still runs (or the pid was taken again: leave it)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            for pid in [int(x) for x in _sh("ip", "netns", "pids", name, check=False).stdout.split() if x.isdigit()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _sh("ip", "netns", "del", name, check=False)
            for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"hfz_hosts_{name[:-1]}_*")):
                shutil.rmtree(folder, ignore_errors=True)

    def _setup(self) -> None:
        global _counter
        self._reap_stale()
        pid = os.getpid()
        for _ in range(20):  # a name left by a killed run with the same pid: take the next one
            _counter += 1
            stem = f"hfz{pid % 10**7}n{_counter}"
            names = [stem + "a", stem + "b"]
            res = _sh("ip", "netns", "add", names[0], check=False)
            if res.returncode == 0:
                break
            if "exist" not in res.stderr.lower():
                raise RuntimeError(f"ip netns add {names[0]}: {res.stderr.strip()}")
        else:
            raise RuntimeError("no free namespace name")
        self._made.append(names[0])
        _sh("ip", "netns", "add", names[1])
        self._made.append(names[1])
        self._ns = names
        k = (pid * 16 + _counter) % (50 * 256)
        subnet = f"10.{200 + k // 256}.{k % 256}"
        self._addrs = [f"{subnet}.1", f"{subnet}.2"]
        self._hostnames = [f"{stem}-host{c}" for c in "ab"]
        # the veth pair, created in the first namespace so a half-made pair never lands in the machine's own
        _sh("ip", "-n", names[0], "link", "add", names[0], "type", "veth", "peer", "name", names[1], "netns", names[1])
        for ns, addr in zip(names, self._addrs):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ns)
            _sh("ip", "-n", ns, "link", "set", ns, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while True:  # the pair's carrier comes up asynchronously
            states = [_sh("ip", "-n", ns, "-o", "link", "show", ns).stdout for ns in names]
            if all("LOWER_UP" in s for s in states):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"veth pair not up after {SETUP_TIMEOUT_S} s: {states}")
            time.sleep(0.05)  # polling a condition with a deadline
        self._base = tempfile.mkdtemp(prefix=f"hfz_hosts_{stem}_")
        self._real = os.path.join(self._base, "real")  # hidden inside the hosts by a tmpfs
        self.disk = os.path.join(self._base, "disk")
        os.makedirs(self.disk)
        self._logs = os.path.join(self._real, "logs")
        os.makedirs(self._logs)
        hosts_file = os.path.join(self._real, "etc_hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            for addr, name in zip(self._addrs, self._hostnames):
                f.write(f"{addr}\t{name}\n")
        self._hosts_file = hosts_file
        for i in range(self.N):
            for sub in ("home", "hf_home", "cache", "tmp"):
                os.makedirs(os.path.join(self.disk_of(i), sub))

    def close(self) -> None:
        """Kill what still runs in the namespaces, delete them and the folders (also after a failure)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        problems = []
        for ns in reversed(self._made):
            try:
                self._kill_netns(ns)
                _sh("ip", "netns", "del", ns)
            except Exception as exc:  # keep tearing down the rest
                problems.append(f"{ns}: {exc}")
        self._made = []
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
            if os.path.exists(self._base):
                problems.append(f"{self._base} could not be removed")
        if problems:
            print("hf_zero TwoHosts teardown: " + "; ".join(problems), file=sys.stderr)

    def _netns_pids(self, ns: str) -> List[int]:
        res = _sh("ip", "netns", "pids", ns, check=False)
        return [int(x) for x in res.stdout.split() if x.isdigit()]

    def _kill_netns(self, ns: str) -> None:
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while True:
            pids = self._netns_pids(ns)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} in {ns} survive SIGKILL")
            time.sleep(0.05)  # polling a condition with a deadline

    def __enter__(self) -> "TwoHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- what a test needs
    def netns(self, i: int) -> str:
        return self._ns[i]

    def ifname(self, i: int) -> str:
        return self._ns[i]  # each veth end is named after its namespace

    def addr(self, i: int) -> str:
        return self._addrs[i]

    def hostname(self, i: int) -> str:
        return self._hostnames[i]

    def disk_of(self, i: int) -> str:
        return os.path.join(self._real, "ab"[i])

    def set_link_rate(self, rate: Union[None, str, float]) -> None:
        """Limit each direction of the link between the hosts to `rate` (tc's units, see parse_rate; None: remove
        the limit): a tbf root qdisc on each veth end, inside its namespace. Raises HostsUnavailable when tc
        refuses (no sch_tbf in the kernel)."""
        if rate is None:
            for ns in self._ns:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ns, "root", check=False)
            self.link_rate = self.link_rate_bps = None
            return
        bps = parse_rate(rate)
        if shutil.which("tc") is None:
            raise HostsUnavailable("`tc` is not installed (iproute2; it sets the link rate)")
        for ns in self._ns:
            res = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ns, "root", "tbf",
                      *_tbf_args(bps, self._burst, self._latency), check=False)
            if res.returncode != 0:
                raise HostsUnavailable(f"tc could not limit {ns} to {rate}: {res.stderr.strip() or res.stdout.strip()}")
        self.link_rate, self.link_rate_bps = rate, bps

    def link_qdiscs(self) -> List[str]:
        """`tc qdisc show` of each veth end (what the link really runs)."""
        return [_sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", ns).stdout.strip() for ns in self._ns]

    def measure_link(self, nbytes: int, timeout: float = 120) -> float:
        """Bits per second of one bulk TCP transfer of `nbytes` from host B to host A over the link, timed at the
        receiver from its first byte to its last (so start-up is not counted)."""
        sink = subprocess.Popen(["ip", "netns", "exec", self._ns[0], sys.executable, "-c", _SINK, self._addrs[0]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            port = sink.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError(f"link measurement: the receiver did not start: {sink.stderr.read()}")
            _sh("ip", "netns", "exec", self._ns[1], sys.executable, "-c", _SOURCE, self._addrs[0], port,
                str(int(nbytes)), timeout=timeout)
            out, err = sink.communicate(timeout=SETUP_TIMEOUT_S)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        got, seconds = out.split()
        if int(got) != int(nbytes) or float(seconds) <= 0:
            raise RuntimeError(f"link measurement: received {got} of {nbytes} bytes in {seconds} s; {err}")
        return 8 * int(got) / float(seconds)

    def free_port(self, i: int) -> int:
        code = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[1])"
        res = _sh("ip", "netns", "exec", self._ns[i], sys.executable, "-c", code)
        return int(res.stdout.strip())

    def env(self, i: int, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        d = self.disk
        return base_env({
            "GLOO_SOCKET_IFNAME": self.ifname(i), "HOME": os.path.join(d, "home"),
            "HF_HOME": os.path.join(d, "hf_home"), "HF_ZERO_CACHE": os.path.join(d, "cache"),
            "TMPDIR": os.path.join(d, "tmp"), **(extra or {}),
        })

    def wrap(self, i: int, cmd: Sequence[str], cwd: Optional[str] = None) -> List[str]:
        q = shlex.quote
        setup = " && ".join([
            f"hostname {q(self._hostnames[i])}",
            f"mount --bind {q(self._hosts_file)} /etc/hosts",
            f"mount --bind {q(self.disk_of(i))} {q(self.disk)}",
            f"mount -t tmpfs -o size=1m,mode=0700 hfz-hidden {q(self._real)}",  # the other host's disk is gone
            f"cd {q(cwd or self.disk)}",
        ])
        return ["ip", "netns", "exec", self._ns[i], "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", setup + ' && exec "$@"', "sh", *cmd]

    def run(self, cmds: Sequence[Sequence[str]], env: Union[None, Dict[str, str], Sequence[Dict[str, str]]] = None,
            timeout: float = 300, peer_grace: float = 30, cwd: Optional[str] = None) -> List[HostRun]:
        assert len(cmds) == self.N, "one command per host"
        envs = list(env) if isinstance(env, (list, tuple)) else [env, env]
        procs, files = [], []
        try:
            for i, cmd in enumerate(cmds):
                proc, out, err = _start(self.wrap(i, cmd, cwd), self.env(i, envs[i]), self._logs,
                                        f"host{i}-{time.monotonic_ns()}", None)
                procs.append(proc)
                files.append((out, err))
        except BaseException:
            for p in procs:
                _kill_tree(p, self._netns_pids(self._ns[procs.index(p)]))
            raise
        try:
            return wait_all(procs, files, [f"host {'AB'[i]} ({self._hostnames[i]})" for i in range(self.N)],
                            timeout, peer_grace, kill_extra=lambda i: self._netns_pids(self._ns[i]))
        finally:
            for i, p in enumerate(procs):
                if p.poll() is None:  # interrupted (KeyboardInterrupt): nothing outlives the call
                    _kill_tree(p, self._netns_pids(self._ns[i]))
                    p.wait(timeout=SETUP_TIMEOUT_S)
