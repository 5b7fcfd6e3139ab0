"""Two "hosts" on this one machine, made of Linux namespaces, for multi-host launches (`accelerate launch
--num_machines 2`, `torchrun --nnodes 2`, `python -m benchmarks.two_hosts`) without a cluster, optionally joined by a
rate-limited link.

    with TwoHosts(link_rate="200mbit") as hosts:    # or the `two_hosts` fixture of tests/test_multihost.py
        port = hosts.free_port(0)
        a, b = hosts.run([cmd_for_host_a, cmd_for_host_b], env={"X": "1"}, timeout=300)
        rc, out, err = a                            # each result unpacks as (returncode, stdout, stderr)

Needs root, iproute2's `ip` (and `tc` for a link rate) and util-linux's `unshare` (benchmarks/README.md). The tests
use it through tests/_hosts.py (a re-export); `python -m benchmarks.two_hosts` (two_hosts.py) runs the bench's
systems across it. It imports nothing of hf_zero but its two helpers, whose public names it re-exports:
procs.py (starting, waiting for and killing the hosts' processes: `HostRun`, `HostsTimeout`, `base_env`,
`wait_all`, `run_local`, `worker_logs`) and link.py (`parse_rate`, tc's token-bucket arguments, the link
measurement's scripts).

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

`TwoHosts()` raises `HostsUnavailable` (with the reason) where namespaces cannot be made: not root, no `ip` or
`unshare` (or `tc` for a link rate), `ip netns add`, the veth or the qdisc refused. `worker_logs` and `run_local`
(one command on the machine itself, outside any namespace, with the same bounded wait) are procs.py's.
"""
from __future__ import annotations

import atexit
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Union

from .link import SINK, SOURCE, parse_rate, tbf_args
from .procs import (ROOT, SETUP_TIMEOUT_S, HostRun, HostsTimeout, base_env, kill_tree, run_local, sh, start, wait_all,
                    worker_logs)

__all__ = ["ROOT", "SETUP_TIMEOUT_S", "HostRun", "HostsTimeout", "HostsUnavailable", "TwoHosts", "base_env",
           "parse_rate", "run_local", "wait_all", "worker_logs"]

_counter = 0


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (tests skip on it)."""


# ------------------------------------------------------------------------------------------------ the hosts
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
        listed = sh("ip", "netns", "list", check=False).stdout.split()
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
            for pid in [int(x) for x in sh("ip", "netns", "pids", name, check=False).stdout.split() if x.isdigit()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", name, check=False)
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
            res = sh("ip", "netns", "add", names[0], check=False)
            if res.returncode == 0:
                break
            if "exist" not in res.stderr.lower():
                raise RuntimeError(f"ip netns add {names[0]}: {res.stderr.strip()}")
        else:
            raise RuntimeError("no free namespace name")
        self._made.append(names[0])
        sh("ip", "netns", "add", names[1])
        self._made.append(names[1])
        self._ns = names
        k = (pid * 16 + _counter) % (50 * 256)
        subnet = f"10.{200 + k // 256}.{k % 256}"
        self._addrs = [f"{subnet}.1", f"{subnet}.2"]
        self._hostnames = [f"{stem}-host{c}" for c in "ab"]
        # the veth pair, created in the first namespace so a half-made pair never lands in the machine's own
        sh("ip", "-n", names[0], "link", "add", names[0], "type", "veth", "peer", "name", names[1], "netns", names[1])
        for ns, addr in zip(names, self._addrs):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ns)
            sh("ip", "-n", ns, "link", "set", ns, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while True:  # the pair's carrier comes up asynchronously
            states = [sh("ip", "-n", ns, "-o", "link", "show", ns).stdout for ns in names]
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
                sh("ip", "netns", "del", ns)
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
        res = sh("ip", "netns", "pids", ns, check=False)
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
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ns, "root", check=False)
            self.link_rate = self.link_rate_bps = None
            return
        bps = parse_rate(rate)
        if shutil.which("tc") is None:
            raise HostsUnavailable("`tc` is not installed (iproute2; it sets the link rate)")
        for ns in self._ns:
            res = sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ns, "root", "tbf",
                      *tbf_args(bps, self._burst, self._latency), check=False)
            if res.returncode != 0:
                raise HostsUnavailable(f"tc could not limit {ns} to {rate}: {res.stderr.strip() or res.stdout.strip()}")
        self.link_rate, self.link_rate_bps = rate, bps

    def link_qdiscs(self) -> List[str]:
        """`tc qdisc show` of each veth end (what the link really runs)."""
        return [sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", ns).stdout.strip() for ns in self._ns]

    def measure_link(self, nbytes: int, timeout: float = 120) -> float:
        """Bits per second of one bulk TCP transfer of `nbytes` from host B to host A over the link, timed at the
        receiver from its first byte to its last (so start-up is not counted)."""
        sink = subprocess.Popen(["ip", "netns", "exec", self._ns[0], sys.executable, "-c", SINK, self._addrs[0]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            port = sink.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError(f"link measurement: the receiver did not start: {sink.stderr.read()}")
            sh("ip", "netns", "exec", self._ns[1], sys.executable, "-c", SOURCE, self._addrs[0], port,
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
        res = sh("ip", "netns", "exec", self._ns[i], sys.executable, "-c", code)
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
                proc, out, err = start(self.wrap(i, cmd, cwd), self.env(i, envs[i]), self._logs,
                                        f"host{i}-{time.monotonic_ns()}", None)
                procs.append(proc)
                files.append((out, err))
        except BaseException:
            for p in procs:
                kill_tree(p, self._netns_pids(self._ns[procs.index(p)]))
            raise
        try:
            return wait_all(procs, files, [f"host {'AB'[i]} ({self._hostnames[i]})" for i in range(self.N)],
                            timeout, peer_grace, kill_extra=lambda i: self._netns_pids(self._ns[i]))
        finally:
            for i, p in enumerate(procs):
                if p.poll() is None:  # interrupted (KeyboardInterrupt): nothing outlives the call
                    kill_tree(p, self._netns_pids(self._ns[i]))
                    p.wait(timeout=SETUP_TIMEOUT_S)
