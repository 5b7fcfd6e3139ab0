"""`hf-zero bench --hosts 2 [--link-rate R1,R2,...]`: each system's ranks in two hosts made of Linux namespaces
(hf_zero/tools/hosts.py: own network namespace, hostname and disk each, joined by a veth pair), half of the ranks
on each, their gloo traffic between the hosts over the veth link, rate-limited per direction by tc's token-bucket
filter when a rate is given. Needs root (namespaces, tc); where they cannot be made the bench says why and exits 2.

How one system runs (`run_system_on_hosts`): the parent starts one launcher per host,
`python -m hf_zero.tools.bench.multihost ...` inside the host (`TwoHosts.run`: its environment sets
GLOO_SOCKET_IFNAME to the host's veth end and one OpenMP thread). Host A's launcher hosts the TCPStore on its veth
address; each launcher spawns its ranks (host A ranks 0..K-1, host B K..2K-1) as the local bench does
(spawn.py), and they train and measure exactly as runner.py's `_train` does. The engine's topology sees two
hostnames, so its ledger books a collective over a group that spans the hosts as inter-host. Rank 0 writes the
row on host A's disk and each rank its error file on its own host's disk; the parent reads both.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict
from typing import Any, Dict, List, Optional

from .base import Settings
from .spawn import ERROR_GRACE_S, error_summary, first_error, spawn

LAUNCH_GRACE_S = 120  # on top of the system's own timeout: interpreter and torch start-up of both launchers


def run_system_on_hosts(system: str, settings: Settings, hosts) -> Dict[str, Any]:
    """One system on `hosts` (a hf_zero.tools.hosts.TwoHosts, its link already at the rate wanted): half of
    `settings.num_processes` ranks on each host. Returns rank 0's row, or an error row."""
    from ..hosts import HostsTimeout
    from .runner import SYSTEMS, base_system

    world = settings.num_processes
    per_host = world // hosts.N
    port = hosts.free_port(0)
    tag = f"{system.replace('+', '_')}-{uuid.uuid4().hex[:8]}"
    inside = os.path.join(hosts.disk, "hfz_bench", tag)  # the same path on each host, each its own folder
    folders = [os.path.join(hosts.disk_of(i), "hfz_bench", tag) for i in range(hosts.N)]
    payload = json.dumps(asdict(settings))
    cmds = [[sys.executable, "-m", "hf_zero.tools.bench.multihost", "--system", system, "--host", str(i),
             "--ranks-per-host", str(per_host), "--master-addr", hosts.addr(0), "--port", str(port),
             "--out-dir", inside, "--settings", payload] for i in range(hosts.N)]
    killed: Optional[str] = None
    try:
        runs = hosts.run(cmds, timeout=settings.timeout_s + LAUNCH_GRACE_S, peer_grace=ERROR_GRACE_S + 40)
    except HostsTimeout as exc:
        runs, killed = exc.runs, str(exc).splitlines()[0]
    try:
        result_path = os.path.join(folders[0], "result.json")
        error = first_error(folders, world)
        if error is None and os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        if error is None:
            tails = "\n".join(f"{r.name}: exit code {r.returncode}\n{r.stderr[-3000:]}" for r in runs)
            error = (f"killed: {killed}" if killed else "no result") + f"\n{tails}"
        return {"system": system, "status": "error: " + error_summary(error), "error": error,
                "hf_zero": SYSTEMS[base_system(system)[0]].hf_zero, "link_rate": settings.link_rate}
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    """One host's launcher: host 0 hosts the store, then each spawns its ranks and waits for them (bounded)."""
    parser = argparse.ArgumentParser(prog="python -m hf_zero.tools.bench.multihost",
                                     description="one host's share of an hf-zero bench --hosts run")
    parser.add_argument("--system", required=True)
    parser.add_argument("--host", type=int, required=True)
    parser.add_argument("--ranks-per-host", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--settings", required=True, help="the run's Settings as JSON")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from .runner import train_worker

    settings = Settings(**json.loads(args.settings))
    world, first = settings.num_processes, args.host * args.ranks_per_host
    os.makedirs(args.out_dir, exist_ok=True)
    store = None
    if args.host == 0:  # the rendezvous, on host A's veth address: every rank reaches it over the link
        store = dist.TCPStore(args.master_addr, args.port, None, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=settings.timeout_s))
    procs, timed_out = spawn(
        train_worker, lambda i: (first + i, world, args.port, args.system, settings, args.out_dir, args.master_addr),
        args.ranks_per_host, settings.timeout_s, settings.threads_per_rank)
    del store
    codes = [p.exitcode for p in procs]
    print(f"[hf-zero bench] host {args.host}: ranks {first}..{first + args.ranks_per_host - 1} exit codes {codes}"
          + (f" (timed out after {settings.timeout_s:.0f} s)" if timed_out else ""), file=sys.stderr, flush=True)
    return 0 if not timed_out and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
