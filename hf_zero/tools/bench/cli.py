"""`hf-zero bench` on the command line: the arguments, one run per system (runner.py; with --hosts 2 on two
namespace hosts at each --link-rate, multihost.py), the table, --json, --plot."""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional

from .base import Settings, cpu_count, extensions_dir, write_json_line
from .capacity import add_capacity_arguments, run_capacity
from .load import LOAD_PRESETS, add_load_arguments, resolve_model_config, run_load
from .runner import (COMPILED, DEFAULT_TIMEOUT_S, PRESETS, RANKS_PER_HOST_FLAG, SYSTEMS, base_system, log,
                     max_positions, build_config, run_system, skipped_row)


# ====================================================================================================== table
def _fmt_mib(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.2f}"


def _fmt_count(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def status_text(row: Dict[str, Any]) -> str:
    """The row's status for people: "ok", "skipped: <reason>" or "error: <exception>"."""
    status = row.get("status", "")
    return f"{status}: {row['reason']}" if status == "skipped" and row.get("reason") else status


def _pair(measured: Optional[float], formula: Optional[float], fmt: Callable[[Optional[float]], str]) -> str:
    """"measured (formula)" in one cell; n/a where neither exists (the torch systems have no intra/inter-host
    ledger)."""
    if measured is None and formula is None:
        return "n/a"
    return f"{fmt(measured)} ({fmt(formula)})"


def format_phases(rows: List[Dict[str, Any]]) -> str:
    """Under the table with --profile: per system, milliseconds per step in each hf_zero phase (rank 0's)."""
    lines = []
    for r in rows:
        phases = r.get("phases_ms_per_step")
        if phases is not None:
            shown = ", ".join(f"{name} {ms:.2f}" for name, ms in phases.items()) or "no hf_zero phases"
            lines.append(f"{r['system']}: ms/step {r['step_ms']:.1f}; {shown}")
    return "\n" + "\n".join(lines) if lines else ""


def format_table(rows: List[Dict[str, Any]]) -> str:
    """The rows as an aligned text table (one line per system, skipped and failed ones included); each measured
    figure is followed by its formula in parentheses."""
    header = ["system", "tokens/s", "x DDP", "state MiB/rank (formula)", "peak MiB/rank",
              "comm elems/step (formula)", "intra-host (formula)", "inter-host (formula)", "status"]
    body = []
    for r in rows:
        ok = r.get("status") == "ok"
        ratio = r.get("x_ddp")
        comm = {w: _pair(r.get(f"comm_elements_measured{w}"), r.get(f"comm_elements_formula{w}"), _fmt_count)
                for w in ("", "_intra", "_inter")}
        body.append([
            r["system"],
            f"{r['tokens_per_s']:,.1f}" if ok else "-",
            f"{ratio:.3f}" if ratio is not None else "n/a",
            _pair(r.get("state_bytes_measured"), r.get("state_bytes_formula"), _fmt_mib) if ok else "-",
            _fmt_mib(r.get("peak_bytes")) if ok else "-",
            comm[""] if ok else "-",
            comm["_intra"] if ok else "-",
            comm["_inter"] if ok else "-",
            status_text(r),
        ])
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
    left = {0, len(header) - 1}

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])


def _fmt_mb(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / 1e6:,.2f}"


def _link_label(rate: Optional[str]) -> str:
    return "unlimited" if rate is None else str(rate)


def format_link_table(rows: List[Dict[str, Any]]) -> str:
    """The rows of a `--hosts` run: per link rate and system, steps/s, the ratio to plain stage 3 (zero3) on the
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
            _pair(r.get("comm_bytes_measured_inter"), r.get("comm_bytes_formula_inter"), _fmt_mb) if ok else "-",
            _pair(r.get("comm_bytes_measured_intra"), r.get("comm_bytes_formula_intra"), _fmt_mb) if ok else "-",
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
HIERARCHICAL = "hierarchical"  # --systems alias: hf_zero's HSDP and hpZ systems
COLLECTIVES = "collectives"  # --systems alias: hf_zero's stages with chunked and flat collectives, side by side
ZEROPP = "zeropp"  # --systems alias: ZeRO++ on a slow link, plain stage 3 and HSDP beside it, DeepSpeed's peers
ZEROPP_SYSTEMS = ("zero3", "zero3-hpz", "zero3-hsdp", "zero3-qwz", "zero3-hpz-qwz", "zero3-hpz-qwz-qgz", "zero2",
                  "zero2-qgz", "deepspeed_zero3", "deepspeed_zero3-hpz", "deepspeed_zero3-hpz-qwz-qgz")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=sorted({**PRESETS, **LOAD_PRESETS}), default=None,
                       help="model shapes: gpt2 = GPT-2 small (124M), gpt2-5m = a ~5.4M-parameter GPT-2 (4 x 256: "
                            "per-step overhead), tiny = a ~141K-parameter GPT-2, llama270m = a ~271M-parameter Llama "
                            "for manual --load runs (default: gpt2)")
    model.add_argument("--config", default=None, metavar="PATH",
                       help="a Transformers config.json (with model_type) to build the causal LM from")
    parser.add_argument("--systems", default="all",
                        help=f"comma-separated systems or 'all' (default: every system but hf_zero's hierarchical "
                             f"and collectives ones); known: {', '.join(SYSTEMS)}; '{HIERARCHICAL}' is "
                             f"{', '.join(n for n, s in SYSTEMS.items() if s.option != 'none')}; '{COLLECTIVES}' is "
                             f"{', '.join(n for n, s in SYSTEMS.items() if s.collectives != 'auto')} (on gloo "
                             f"'auto' is chunked, on NCCL flat); '{ZEROPP}' is {', '.join(ZEROPP_SYSTEMS)} "
                             f"(ZeRO++ on a slow link, with --hosts 2)")
    parser.add_argument(RANKS_PER_HOST_FLAG, dest="ranks_per_host", type=int, default=None, metavar="K",
                        help="group size K of the hierarchical systems (zero*-hsdp: shard_group_size=K, zero3-hpz: "
                             "hpz_partition_size=K), as if the ranks ran on hosts of K; 1 < K < N dividing N "
                             "(default N//2 for an even N >= 4; otherwise those rows are skipped). The run itself "
                             "is on this one host, so its inter-host traffic is 0")
    parser.add_argument("--hosts", type=int, default=1, metavar="H",
                        help="2: run each system's ranks in two hosts made of Linux network namespaces on this "
                             "machine (own hostname, address and disk each, joined by a veth pair), half of "
                             "--num-processes on each, gloo between them over the veth link; the hierarchical "
                             "systems' K is then the ranks per host. Needs root (namespaces, tc). Default 1: all "
                             "ranks here")
    parser.add_argument("--link-rate", default=None, metavar="R[,R...]",
                        help="with --hosts 2: the rate of the link between the hosts, per direction, in tc's units "
                             "(e.g. 100mbit,1gbit; tbf on each veth end, no added delay); several rates run every "
                             "system at each. Default: unlimited")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="run the timed steps under torch.profiler: a Chrome trace per system and rank in DIR, "
                             "and each system's milliseconds per step in hf_zero's phases (hf_zero.gather, .reduce, "
                             ".step, ...: engine/profiling.py) printed under the table and in the JSON. Profiling "
                             "slows every system: compare its phases, not its tokens/s")
    parser.add_argument("--compile", nargs="?", const=Settings.compile_backend, default=None, metavar="BACKEND",
                        help="also run each system with torch.compile(BACKEND) applied after it wraps or shards the "
                             "model (default backend inductor; aot_eager compiles faster): a '<system>+compile' row "
                             "beside each eager one, with its graph breaks; the first (warmup) step compiles")
    parser.add_argument("--lockstep", action="store_true",
                        help="run the systems side by side in one process group, interleaved step by step (each "
                             "round one step of every system, between barriers, in a rotating order): ms per step "
                             "and the median per-round ratio to DDP, robust to the machine's drift between "
                             "sequential runs. Every system's model is in memory at once (small models); not with "
                             "DeepSpeed's systems, --compile, --hosts, --profile or --plot (lockstep.py)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first (default 1)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank per micro-batch (default 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                        help="no: fp32 everywhere; bf16: bf16 compute with fp32 master weights and AdamW states")
    parser.add_argument("--num-processes", type=int, default=2, help="world size (default 2)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the random tokens")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds one system may take before it is killed (default {DEFAULT_TIMEOUT_S})")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write one JSON line with every row and the settings to PATH ('-' for stdout; the table "
                             "then goes to stderr)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw tokens/s and bytes per rank per system to this PNG (needs matplotlib: "
                             "pip install 'hf_zero[bench]')")
    add_load_arguments(parser)
    parser.add_argument("--capacity", action="store_true",
                        help="the capacity table instead of the throughput one: the largest Llama each system trains "
                             "within --budget bytes per rank, enforced by a memory cgroup per rank (the flags below; "
                             "--seed and --malloc-mmap-threshold apply too)")
    add_capacity_arguments(parser)


# bench's own flags that a capacity run does not read, and what to say instead
_NOT_FOR_CAPACITY = {"systems": "--capacity-systems", "num_processes": "--ranks", "steps": "--train-steps",
                     "seq_len": "--tokens", "json": "--capacity-json", "plot": "--capacity-plot", "timeout":
                     "--trial-timeout", "preset": "--shape", "config": "--shape/--width", "load": None, "hosts": None}


def _capacity_conflicts(args: argparse.Namespace) -> List[str]:
    """Flags given (a value other than the default) that this run would ignore: with --capacity the throughput
    bench's, without it the capacity run's."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = parser.parse_args([])

    def given(dest: str) -> bool:  # a Namespace made in code may lack a flag: not given
        return hasattr(args, dest) and getattr(args, dest) != getattr(default, dest)

    if getattr(args, "capacity", False):
        return [f"--{dest.replace('_', '-')}" + (f" (use {instead})" if instead else "")
                for dest, instead in _NOT_FOR_CAPACITY.items() if given(dest)]
    capacity_only = argparse.ArgumentParser()
    add_capacity_arguments(capacity_only)
    return [a.option_strings[0] for a in capacity_only._actions if a.option_strings and a.dest != "help"
            and given(a.dest)]


def _parse_systems(text: str) -> List[str]:
    if text.strip().lower() == "all":
        return [name for name, spec in SYSTEMS.items() if spec.in_all]
    names: List[str] = []
    for n in (n.strip() for n in text.split(",")):
        if n == HIERARCHICAL:
            names += [k for k, spec in SYSTEMS.items() if spec.option != "none"]
        elif n == COLLECTIVES:
            names += [k for k, spec in SYSTEMS.items() if spec.collectives != "auto"]
        elif n == ZEROPP:
            names += [k for k in ZEROPP_SYSTEMS if k in SYSTEMS]
        elif n:
            names.append(n)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)} (or {HIERARCHICAL}, "
                         f"{COLLECTIVES}, {ZEROPP})")
    if not names:
        raise ValueError("--systems is empty")
    seen: List[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


def _run_one(i: int, system: str, systems: List[str], settings: Settings,
             run_fn: Callable[[str, Settings], Dict[str, Any]] = run_system) -> Dict[str, Any]:
    """One system's row: skipped when its optional extra is missing, else run in its own worker group (`run_fn`:
    here, or on the namespace hosts)."""
    tag = f"[{i + 1}/{len(systems)}] {system}" + (f" @ {settings.link_rate}" if settings.link_rate else "")
    spec = SYSTEMS[base_system(system)[0]]
    reason = spec.unavailable(settings) if spec.unavailable is not None else None
    if reason is not None:
        log(f"{tag} skipped: {reason}")
        row = skipped_row(system, reason)
        if settings.hosts > 1:
            row["link_rate"] = settings.link_rate
        return row
    log(f"{tag} ...")
    t0 = time.monotonic()
    row = run_fn(system, settings)
    row["wall_s"] = time.monotonic() - t0
    if settings.hosts > 1:
        row.setdefault("link_rate", settings.link_rate)
    if row["status"] == "ok":
        log(f"{tag}: {row['tokens_per_s']:,.1f} tokens/s, {row['steps_per_s']:.3f} steps/s "
            f"({row['wall_s']:.0f}s including start-up)")
    else:
        log(f"{tag} FAILED:\n{row.get('error', row['status'])}")
    return row


class HostsError(RuntimeError):
    """--hosts 2 cannot run here (no namespaces, tc refused a rate): the message says why."""


def _check_hosts(args: argparse.Namespace) -> List[Optional[str]]:
    """The link rates to run (None: unlimited), after checking --hosts / --link-rate against the rest."""
    hosts = getattr(args, "hosts", 1) or 1
    args.hosts = hosts
    text = getattr(args, "link_rate", None)
    if hosts not in (1, 2):
        raise ValueError(f"--hosts takes 1 or 2 (two namespace hosts), got {hosts}")
    if hosts == 1:
        if text:
            raise ValueError("--link-rate sets the link between hosts: it needs --hosts 2")
        return [None]
    if args.num_processes % hosts:
        raise ValueError(f"--hosts {hosts} puts half of the ranks on each host: --num-processes must be even, "
                         f"got {args.num_processes}")
    k = args.num_processes // hosts
    if getattr(args, "ranks_per_host", None) not in (None, k):
        raise ValueError(f"with --hosts {hosts} the hierarchical systems' K is the ranks per host, {k}; "
                         f"{RANKS_PER_HOST_FLAG} {args.ranks_per_host} would not match the hosts")
    from ..hosts import parse_rate

    rates: List[Optional[str]] = []
    for part in (text or "").split(","):
        part = part.strip()
        if part:
            parse_rate(part)  # ValueError names the rate
            rates.append(part)
    return rates or [None]


def _run_on_hosts(systems: List[str], settings: Settings, rates: List[Optional[str]],
                  links: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every system at every link rate on two namespace hosts (multihost.py); `links` gets each rate's measured
    bulk-transfer rate."""
    from dataclasses import replace

    from ..hosts import HostsUnavailable, TwoHosts
    from .multihost import run_system_on_hosts

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
                row = _run_one(i, system, systems, at_rate, lambda name, s: run_system_on_hosts(name, s, hosts))
                row["link_measured_bps"] = measured
                rows.append(row)
    finally:
        hosts.close()
    return rows


def _run_lockstep(args: argparse.Namespace, systems: List[str], settings: Settings) -> int:
    """--lockstep: the systems interleaved in one process group (lockstep.py); those that cannot be, and those
    unavailable here, get a skipped row with the reason."""
    from .lockstep import format_lockstep_table, run_lockstep, unsupported

    skipped, runnable = [], []
    for name in systems:
        spec = SYSTEMS[name]
        reason = unsupported(name) or (spec.unavailable(settings) if spec.unavailable is not None else None)
        if reason:
            skipped.append(skipped_row(name, reason))
        else:
            runnable.append(name)
    log(f"lockstep: {', '.join(runnable)} interleaved, {settings.warmup} warmup + {settings.steps} timed rounds")
    rows = run_lockstep(runnable, settings) + skipped
    print(format_lockstep_table(rows), file=sys.stdout if args.json != "-" else sys.stderr, flush=True)
    if args.json:
        write_json_line(args.json, {**asdict(settings), "systems": systems, "lockstep": True,
                                     "tokens_per_step": settings.tokens_per_step}, rows)
    failed = [r["system"] for r in rows if r["status"] not in ("ok", "skipped") and r.get("hf_zero")]
    if failed:
        log(f"hf_zero system(s) failed: {', '.join(failed)}")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """`hf-zero bench`: run every requested system, print the table, write --json and --plot; the exit code is
    1 when an hf_zero system failed, 2 on bad arguments, else 0 (skipped rows and failed peers do not count).
    With --capacity, the capacity table instead (capacity/)."""
    conflicts = _capacity_conflicts(args)
    if conflicts:
        reads = "--capacity does not read" if getattr(args, "capacity", False) else \
            "without --capacity, bench does not read"
        print(f"hf-zero bench: error: {reads} {', '.join(conflicts)}", file=sys.stderr)
        return 2
    if getattr(args, "capacity", False):
        return run_capacity(args)
    if getattr(args, "load", False):
        if (getattr(args, "hosts", 1) or 1) > 1:
            print("hf-zero bench: error: --load runs on this one host; --hosts is not supported with it",
                  file=sys.stderr)
            return 2
        return run_load(args)  # load.py: from a save_pretrained folder to a sharded model, per system
    try:
        systems = _parse_systems(args.systems)
        if getattr(args, "compile", None):
            systems = [name for s in systems for name in (s, s + COMPILED)]  # eager and compiled side by side
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "num_processes", "ranks_per_host"):
            if getattr(args, name, None) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
        if args.preset is None and args.config is None:
            args.preset = "gpt2"
        model_config, model_name = resolve_model_config(args)
        max_pos = max_positions(build_config(model_config))
        if max_pos is not None and args.seq_len > max_pos:
            raise ValueError(f"--seq-len {args.seq_len} is longer than the model's {max_pos} positions")
        if getattr(args, "plot", None):
            from .plot import check_matplotlib

            check_matplotlib()  # before minutes of training, not after
        if getattr(args, "lockstep", False):
            refused = [flag for flag, given in (("--hosts", args.hosts > 1), ("--compile", bool(args.compile)),
                                                ("--profile", bool(args.profile)), ("--plot", bool(args.plot)))
                       if given]
            if refused:
                raise ValueError(f"--lockstep runs every system in one process group here: not with "
                                 f"{', '.join(refused)}")
        rates = _check_hosts(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"hf-zero bench: error: {exc}", file=sys.stderr)
        return 2

    import torch

    world = args.num_processes
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        print(f"hf-zero bench: error: {world} processes but {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 2
    settings = Settings(
        model_config=model_config, model_name=model_name, steps=args.steps, warmup=args.warmup,
        batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
        mixed_precision=args.mixed_precision, num_processes=world, lr=args.lr, seed=args.seed,
        timeout_s=args.timeout, threads_per_rank=1 if args.hosts > 1 else max(1, cpu_count() // world),
        ranks_per_host=world // args.hosts if args.hosts > 1 else getattr(args, "ranks_per_host", None),
        hosts=args.hosts,
        compile_backend=getattr(args, "compile", None) or Settings.compile_backend,
        profile_dir=os.path.abspath(args.profile) if getattr(args, "profile", None) else None,
    )
    log(f"model {model_name}, world {world} ({'nccl' if torch.cuda.is_available() else 'gloo'}), "
         f"batch {settings.batch_size} x seq {settings.seq_len} x accum {settings.grad_accum} per rank, "
         f"{settings.warmup} warmup + {settings.steps} timed steps, mixed precision {settings.mixed_precision}, "
         f"{settings.threads_per_rank} threads per rank")

    if getattr(args, "lockstep", False):
        return _run_lockstep(args, systems, settings)

    links: List[Dict[str, Any]] = []
    with extensions_dir(any(SYSTEMS[base_system(name)[0]].jit_extensions for name in systems)):
        if args.hosts == 1:
            rows = [_run_one(i, system, systems, settings) for i, system in enumerate(systems)]
        else:
            try:
                rows = _run_on_hosts(systems, settings, rates, links)
            except HostsError as exc:
                print(f"hf-zero bench: error: {exc}", file=sys.stderr)
                return 2

    for rate in {r.get("link_rate") for r in rows}:  # "x DDP": against DDP on the same link
        ddp = next((r for r in rows if r["system"] == "ddp" and r["status"] == "ok"
                    and r.get("link_rate") == rate), None)
        for r in rows:
            if r.get("link_rate") == rate:
                ok = r["status"] == "ok" and ddp is not None and ddp["tokens_per_s"] > 0
                r["x_ddp"] = r["tokens_per_s"] / ddp["tokens_per_s"] if ok else None

    table = format_table(rows) if args.hosts == 1 else format_link_table(rows)
    if links:
        table += "\n" + "\n".join(f"link {_link_label(ln['rate'])}: a bulk TCP transfer from host B to host A ran at "
                                   f"{ln['measured_bps'] / 1e6:,.1f} Mbit/s" for ln in links)
    compiled = [r for r in rows if r.get("graph_breaks") is not None]
    if compiled:
        table += "\n" + "\n".join(f"{r['system']}: {r['graph_breaks']} graph breaks, {r['graphs_compiled']} graphs "
                                  f"({r['compile_backend']})" for r in compiled)
    table += format_phases(rows)
    to_stdout = args.json != "-"
    print(table, file=sys.stdout if to_stdout else sys.stderr, flush=True)

    if args.json:
        write_json_line(args.json, {**asdict(settings), "systems": systems,
                                     "tokens_per_step": settings.tokens_per_step,
                                     **({"link_rates": rates, "links": links} if args.hosts > 1 else {})}, rows)

    if getattr(args, "plot", None):
        from .plot import plot_rows

        plot_rows(rows, args.plot, title=f"{model_name}, {world} ranks, {settings.tokens_per_step:,} tokens/step, "
                                         f"mixed precision {settings.mixed_precision}")
        log(f"plot written to {args.plot}")

    # A skipped hf_zero row (a hierarchical option without a usable K) said why; only a failed one fails the run.
    failed_hf_zero = [r["system"] for r in rows if r["status"] not in ("ok", "skipped") and r.get("hf_zero")]
    if failed_hf_zero:
        log(f"hf_zero system(s) failed: {', '.join(failed_hf_zero)}")
        return 1
    return 0
