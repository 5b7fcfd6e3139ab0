"""`python -m benchmarks.two_hosts [bench's flags] [--link-rate R1,R2,...]` (from a checkout; formerly `hf-zero
bench --hosts 2`): each system's ranks in two hosts made of Linux namespaces (hosts.py: own network namespace,
hostname and disk each, joined by a veth pair), half of the ranks on each, their gloo traffic between the hosts over
the veth link, rate-limited per direction by tc's token-bucket filter when a rate is given. Needs root (network
namespaces), iproute2's `ip` (and `tc` for a rate) and `unshare`; where they cannot be made it says why and exits 2.

The table is `hf-zero bench`'s run on the hosts: bench's flags (hf_zero.tools.bench.cli: `prepare` checks them and
makes the Settings, `report` prints the table and writes --json / --plot) plus --hosts (2, the default: the only
layout) and --link-rate; per link rate and system, steps/s, the ratio to plain stage 3 on the same link, and the
bytes between and inside the hosts, measured (formula), and what really crossed the link.

How one system runs (`run_system_on_hosts`): the parent starts one launcher per host,
`python -m benchmarks.two_hosts --host-launcher ...` inside the host (`TwoHosts.run`: its environment sets
GLOO_SOCKET_IFNAME to the host's veth end, one OpenMP thread and PYTHONPATH to the checkout's root, so `benchmarks`
imports there). Host A's launcher hosts the TCPStore on its veth address; each launcher spawns its ranks (host A
ranks 0..K-1, host B K..2K-1) as the local bench does (hf_zero.tools.bench.spawn), and they train and measure exactly
as the bench's runner.py `_train` does. The engine's topology sees two hostnames, so its ledger books a collective
over a group that spans the hosts as inter-host. Rank 0 writes the row on host A's disk and each rank its error file
on its own host's disk; the parent reads both.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict, replace
from typing import Any, Dict, List, Optional

from hf_zero.tools.bench.base import Settings, extensions_dir
from hf_zero.tools.bench.cli import add_arguments, prepare, report, run_one, status_text, with_formula
from hf_zero.tools.bench.runner import RANKS_PER_HOST_FLAG, SYSTEMS, base_system, log
from hf_zero.tools.bench.spawn import ERROR_GRACE_S, error_summary, first_error, spawn

PROG = "python -m benchmarks.two_hosts"
HOST_LAUNCHER = "--host-launcher"  # first argument of the command each host runs (`host_main`)
LAUNCH_GRACE_S = 120  # on top of the system's own timeout: interpreter and torch start-up of both launchers


# ====================================================================================================== one system
def run_system_on_hosts(system: str, settings: Settings, hosts) -> Dict[str, Any]:
    """One system on `hosts` (a benchmarks.hosts.TwoHosts, its link already at the rate wanted): half of
    `settings.num_processes` ranks on each host. Returns rank 0's row, or an error row."""
    from .hosts import HostsTimeout

    world = settings.num_processes
    per_host = world // hosts.N
    port = hosts.free_port(0)
    tag = f"{system.replace('+', '_')}-{uuid.uuid4().hex[:8]}"
    inside = os.path.join(hosts.disk, "hfz_bench", tag)  # the same path on each host, each its own folder
    folders = [os.path.join(hosts.disk_of(i), "hfz_bench", tag) for i in range(hosts.N)]
    payload = json.dumps(asdict(settings))
    cmds = [[sys.executable, "-m", "benchmarks.two_hosts", HOST_LAUNCHER, "--system", system, "--host", str(i),
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


def host_main(argv: Optional[List[str]] = None) -> int:
    """One host's launcher: host 0 hosts the store, then each spawns its ranks and waits for them (bounded)."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.two_hosts {HOST_LAUNCHER}",
                                     description="one host's share of a two-host bench run")
    parser.add_argument("--system", required=True)
    parser.add_argument("--host", type=int, required=True)
    parser.add_argument("--ranks-per-host", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--settings", required=True, help="the run's Settings as JSON")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from hf_zero.tools.bench.runner import train_worker

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

# ====================================================================================================== table
def _fmt_mb(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / 1e6:,.2f}"


def _link_label(rate: Optional[str]) -> str:
    return "unlimited" if rate is None else str(rate)


def format_link_table(rows: List[Dict[str, Any]]) -> str:
    """The rows of a two-host run: per link rate and system, steps/s, the ratio to plain stage 3 (zero3) on the
    same link, the bytes on the wire per step and rank (max over ranks) between the hosts and inside them, each
    measured (formula), as the ledger books them, and what really crossed the link per step (both directions,
    the veth ends' counters, headers included)."""
    header = ["link", "system", "hosts x ranks", "steps/s", "x zero3", "inter-host MB/step (formula)",
              "intra-host MB/step (formula)", "link MB/step", "tokens/s", "status"]
    base = {r.get("link_rate"): r for r in rows if r["system"] == "zero3" and r.get("status") == "ok"}
    body = []
    for r in rows:
        ok = r.get("status") == "ok"
        ref = base.get(r.get("link_rate"))
        ratio = r["steps_per_s"] / ref["steps_per_s"] if ok and ref and ref["steps_per_s"] > 0 else None
        layout = f"{r['num_hosts']} x {r['host_size']}" if ok and r.get("host_size") else ("n/a" if ok else "-")
        body.append([
            _link_label(r.get("link_rate")), r["system"], layout,
            f"{r['steps_per_s']:.3f}" if ok else "-",
            f"{ratio:.2f}" if ratio is not None else "n/a",
            with_formula(r.get("comm_bytes_measured_inter"), r.get("comm_bytes_formula_inter"), _fmt_mb) if ok
            else "-",
            with_formula(r.get("comm_bytes_measured_intra"), r.get("comm_bytes_formula_intra"), _fmt_mb) if ok
            else "-",
            _fmt_mb(r.get("link_bytes_per_step")) if ok else "-",
            f"{r['tokens_per_s']:,.1f}" if ok else "-",
            status_text(r),
        ])
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
    left = {0, 1, len(header) - 1}

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    notes = []
    for rate, ref in base.items():  # ZeRO++'s headline: hpZ + qwZ + qgZ against plain stage 3 on the same link
        zpp = next((r for r in rows if r["system"] == "zero3-hpz-qwz-qgz" and r.get("status") == "ok"
                    and r.get("link_rate") == rate), None)
        if zpp is not None and ref.get("comm_bytes_measured_inter"):
            notes.append(f"{_link_label(rate)}: zero3-hpz-qwz-qgz / zero3: steps/s "
                         f"{zpp['steps_per_s'] / ref['steps_per_s']:.2f}x, inter-host bytes "
                         f"{zpp['comm_bytes_measured_inter'] / ref['comm_bytes_measured_inter']:.3f}x")
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body] + notes)


# ====================================================================================================== CLI
class HostsError(RuntimeError):
    """The two hosts cannot run here (no namespaces, tc refused a rate): the message says why."""


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """bench's flags (without its moved ones) and this run's --hosts and --link-rate."""
    add_arguments(parser, moved=False)
    g = parser.add_argument_group("two hosts (needs root, ip, unshare; tc for --link-rate)")
    g.add_argument("--hosts", type=int, default=2, metavar="H",
                   help="2 (the default and the only layout): run each system's ranks in two hosts made of Linux "
                        "network namespaces on this machine (own hostname, address and disk each, joined by a veth "
                        "pair), half of --num-processes on each, gloo between them over the veth link; the "
                        "hierarchical systems' K is then the ranks per host")
    g.add_argument("--link-rate", default=None, metavar="R[,R...]",
                   help="the rate of the link between the hosts, per direction, in tc's units (e.g. 100mbit,1gbit; "
                        "tbf on each veth end, no added delay); several rates run every system at each. Default: "
                        "unlimited")


def check_hosts(args: argparse.Namespace) -> List[Optional[str]]:
    """The link rates to run (None: unlimited), after checking --hosts / --link-rate against the rest."""
    from .link import parse_rate

    hosts = getattr(args, "hosts", 2)
    if hosts != 2:
        raise ValueError(f"--hosts takes 2 (two namespace hosts; one host is `hf-zero bench`), got {hosts}")
    if getattr(args, "load", False):
        raise ValueError("--load runs on this one host (`hf-zero bench --load`); not on two hosts")
    if args.num_processes % hosts:
        raise ValueError(f"--hosts {hosts} puts half of the ranks on each host: --num-processes must be even, "
                         f"got {args.num_processes}")
    k = args.num_processes // hosts
    if getattr(args, "ranks_per_host", None) not in (None, k):
        raise ValueError(f"with --hosts {hosts} the hierarchical systems' K is the ranks per host, {k}; "
                         f"{RANKS_PER_HOST_FLAG} {args.ranks_per_host} would not match the hosts")
    rates: List[Optional[str]] = []
    for part in (getattr(args, "link_rate", None) or "").split(","):
        part = part.strip()
        if part:
            parse_rate(part)  # ValueError names the rate
            rates.append(part)
    return rates or [None]


def run_on_hosts(systems: List[str], settings: Settings, rates: List[Optional[str]],
                 links: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every system at every link rate on two namespace hosts; `links` gets each rate's measured bulk-transfer
    rate."""
    from .hosts import HostsUnavailable, TwoHosts

    try:
        hosts = TwoHosts()
    except HostsUnavailable as exc:
        raise HostsError(f"--hosts 2 runs the ranks in two hosts made of Linux network namespaces, and they cannot "
                         f"be made here: {exc}") from exc
    rows: List[Dict[str, Any]] = []
    try:
        log(f"two hosts {hosts.hostname(0)} ({hosts.addr(0)}) and {hosts.hostname(1)} ({hosts.addr(1)}), "
            f"{settings.num_processes // 2} ranks each")
        for rate in rates:
            try:
                hosts.set_link_rate(rate)
            except HostsUnavailable as exc:
                raise HostsError(f"--link-rate {rate}: {exc}") from exc
            nbytes = int(max(4e6, min(2e8, (hosts.link_rate_bps or 8e9) / 8 * 1.0)))  # about a second of it
            measured = hosts.measure_link(nbytes)
            links.append({"rate": rate, "rate_bps": hosts.link_rate_bps, "measured_bps": measured,
                          "measured_bytes": nbytes, "qdisc": hosts.link_qdiscs()})
            log(f"link {_link_label(rate)}: {measured / 1e6:,.1f} Mbit/s measured (bulk TCP, {nbytes / 1e6:.0f} MB)")
            at_rate = replace(settings, link_rate=rate)
            for i, system in enumerate(systems):
                row = run_one(i, system, systems, at_rate, lambda name, s: run_system_on_hosts(name, s, hosts))
                row["link_measured_bps"] = measured
                rows.append(row)
    finally:
        hosts.close()
    return rows


def run(args: argparse.Namespace) -> int:
    """The two-host bench: every requested system at every --link-rate, the table, --json and --plot; the exit
    code as `hf-zero bench`'s (2 also where the hosts cannot be made here, with the reason)."""
    try:
        rates = check_hosts(args)
        systems, settings = prepare(args, hosts=args.hosts)
    except (ValueError, OSError, ImportError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    links: List[Dict[str, Any]] = []
    with extensions_dir(any(SYSTEMS[base_system(name)[0]].jit_extensions for name in systems)):
        try:
            rows = run_on_hosts(systems, settings, rates, links)
        except HostsError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
    notes = [f"link {_link_label(ln['rate'])}: a bulk TCP transfer from host B to host A ran at "
             f"{ln['measured_bps'] / 1e6:,.1f} Mbit/s" for ln in links]
    return report(args, systems, settings, rows, format_rows=format_link_table, notes=notes,
                  json_settings={"link_rates": rates, "links": links})


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m benchmarks.two_hosts [flags]`, or one host's launcher (`--host-launcher ...`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [HOST_LAUNCHER]:
        return host_main(argv[1:])
    parser = argparse.ArgumentParser(prog=PROG, description="hf-zero bench's systems with their ranks in two "
                                     "network-namespace hosts over a (rate-limited) veth link; needs root")
    add_host_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
