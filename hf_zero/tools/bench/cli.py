"""`hf-zero bench` on the command line: the arguments, one run per system (runner.py), the table, --json, --plot.

`prepare` (the arguments checked, the Settings) and `report` (the table, --json, --plot, the exit code) are also
what the checkout's two-namespace-host bench (benchmarks/two_hosts.py) runs around its own rows. The capacity table
and that bench need root and are not part of the library: given --capacity or --hosts / --link-rate, bench names
their command (`python -m benchmarks.capacity`, `python -m benchmarks.two_hosts`, from a checkout) and exits 2."""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .base import Settings, cpu_count, extensions_dir, write_json_line
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


def with_formula(measured: Optional[float], formula: Optional[float], fmt: Callable[[Optional[float]], str]) -> str:
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
        comm = {w: with_formula(r.get(f"comm_elements_measured{w}"), r.get(f"comm_elements_formula{w}"),
                                _fmt_count) for w in ("", "_intra", "_inter")}
        body.append([
            r["system"],
            f"{r['tokens_per_s']:,.1f}" if ok else "-",
            f"{ratio:.3f}" if ratio is not None else "n/a",
            with_formula(r.get("state_bytes_measured"), r.get("state_bytes_formula"), _fmt_mib) if ok else "-",
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


# ====================================================================================================== CLI
HIERARCHICAL = "hierarchical"  # --systems alias: hf_zero's HSDP and hpZ systems
COLLECTIVES = "collectives"  # --systems alias: hf_zero's stages with chunked and flat collectives, side by side
ZEROPP = "zeropp"  # --systems alias: ZeRO++ on a slow link, plain stage 3 and HSDP beside it, DeepSpeed's peers
ZEROPP_SYSTEMS = ("zero3", "zero3-hpz", "zero3-hsdp", "zero3-qwz", "zero3-hpz-qwz", "zero3-hpz-qwz-qgz", "zero2",
                  "zero2-qgz", "deepspeed_zero3", "deepspeed_zero3-hpz", "deepspeed_zero3-hpz-qwz-qgz")


def add_arguments(parser: argparse.ArgumentParser, moved: bool = True) -> None:
    """bench's flags; `moved`: also --capacity, --hosts and --link-rate, whose runs moved to benchmarks/ (bench
    names the command there); benchmarks/two_hosts.py declares its own --hosts and --link-rate instead."""
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
                             f"(ZeRO++ on a slow link: python -m benchmarks.two_hosts)")
    parser.add_argument(RANKS_PER_HOST_FLAG, dest="ranks_per_host", type=int, default=None, metavar="K",
                        help="group size K of the hierarchical systems (zero*-hsdp: shard_group_size=K, zero3-hpz: "
                             "hpz_partition_size=K), as if the ranks ran on hosts of K; 1 < K < N dividing N "
                             "(default N//2 for an even N >= 4; otherwise those rows are skipped). The run itself "
                             "is on this one host, so its inter-host traffic is 0")
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
                             "DeepSpeed's systems, --compile, --profile or --plot (lockstep.py)")
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
    if moved:
        add_moved_arguments(parser)


# what moved out of the library into the checkout's benchmarks/ (not packaged: it needs root), and its command there
MOVED = {
    "--capacity": ("the capacity table (a memory cgroup per rank)", "python -m benchmarks.capacity",
                   "with the same capacity flags (--budget, --capacity-systems, --ranks, ...)"),
    "--hosts": ("the two-host bench (ranks in two network-namespace hosts)", "python -m benchmarks.two_hosts",
                "with bench's flags and --hosts 2 [--link-rate R,...]"),
    "--link-rate": ("the two-host bench's link rate (tc on a veth pair)", "python -m benchmarks.two_hosts",
                    "with bench's flags and --hosts 2 --link-rate R,..."),
}
_MOVED_DESTS = {"--capacity": "capacity", "--hosts": "hosts", "--link-rate": "link_rate"}


def add_moved_arguments(parser: argparse.ArgumentParser) -> None:
    """--capacity, --hosts and --link-rate, kept so that bench can name where they went (`moved_message`)."""
    g = parser.add_argument_group("moved to the checkout's benchmarks/ (need root; not in the installed package)")
    g.add_argument("--capacity", action="store_true",
                   help=f"moved: {MOVED['--capacity'][0]} is `{MOVED['--capacity'][1]}`, run from a checkout")
    g.add_argument("--hosts", type=int, default=None, metavar="H",
                   help=f"moved: {MOVED['--hosts'][0]} is `{MOVED['--hosts'][1]}`, run from a checkout")
    g.add_argument("--link-rate", default=None, metavar="R[,R...]",
                   help=f"moved: {MOVED['--link-rate'][0]} is `{MOVED['--link-rate'][1]}`, run from a checkout")


def moved_flags(args: "argparse.Namespace | Sequence[str]") -> List[str]:
    """The moved flags given: in a command line (before argparse, which would stop at the capacity table's own
    flags) or in parsed arguments."""
    if isinstance(args, argparse.Namespace):
        return [flag for flag, dest in _MOVED_DESTS.items() if getattr(args, dest, None) not in (None, False)]
    return [flag for flag in MOVED if any(a == flag or a.startswith(flag + "=") for a in args)]


def moved_message(flags: Iterable[str]) -> str:
    """What bench says, with exit code 2, when given a flag whose run moved to benchmarks/."""
    lines = []
    for flag in dict.fromkeys(flags):
        what, command, how = MOVED[flag]
        lines.append(f"hf-zero bench: error: {flag} moved out of the library: {what} needs root and runs from a "
                     f"checkout of hf_zero (not packaged): `{command}`, {how}; see benchmarks/README.md")
    return "\n".join(dict.fromkeys(lines))


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


def run_one(i: int, system: str, systems: List[str], settings: Settings,
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



def prepare(args: argparse.Namespace, hosts: int = 1) -> Tuple[List[str], Settings]:
    """The arguments checked and the run's Settings: (the systems to run, in order; the settings). Raises
    ValueError (or OSError / ImportError) naming what is wrong, before anything runs. `hosts` > 1: the ranks run on
    that many hosts, half of them each (benchmarks/two_hosts.py): one thread per rank, K = the ranks per host."""
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
        refused = [flag for flag, given in (("--hosts", hosts > 1), ("--compile", bool(args.compile)),
                                            ("--profile", bool(args.profile)), ("--plot", bool(args.plot)))
                   if given]
        if refused:
            raise ValueError(f"--lockstep runs every system in one process group here: not with "
                             f"{', '.join(refused)}")

    import torch

    world = args.num_processes
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        raise ValueError(f"{world} processes but {torch.cuda.device_count()} GPUs")
    settings = Settings(
        model_config=model_config, model_name=model_name, steps=args.steps, warmup=args.warmup,
        batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
        mixed_precision=args.mixed_precision, num_processes=world, lr=args.lr, seed=args.seed,
        timeout_s=args.timeout, threads_per_rank=1 if hosts > 1 else max(1, cpu_count() // world),
        ranks_per_host=world // hosts if hosts > 1 else getattr(args, "ranks_per_host", None),
        hosts=hosts,
        compile_backend=getattr(args, "compile", None) or Settings.compile_backend,
        profile_dir=os.path.abspath(args.profile) if getattr(args, "profile", None) else None,
    )
    log(f"model {model_name}, world {world} ({'nccl' if torch.cuda.is_available() else 'gloo'}), "
        f"batch {settings.batch_size} x seq {settings.seq_len} x accum {settings.grad_accum} per rank, "
        f"{settings.warmup} warmup + {settings.steps} timed steps, mixed precision {settings.mixed_precision}, "
        f"{settings.threads_per_rank} threads per rank")
    return systems, settings


def run(args: argparse.Namespace) -> int:
    """`hf-zero bench`: run every requested system, print the table, write --json and --plot; the exit code is
    1 when an hf_zero system failed, 2 on bad arguments (and on --capacity / --hosts / --link-rate, which moved to
    benchmarks/: the message names the command), else 0 (skipped rows and failed peers do not count)."""
    moved = moved_flags(args)
    if moved:
        print(moved_message(moved), file=sys.stderr)
        return 2
    if getattr(args, "load", False):
        return run_load(args)  # load.py: from a save_pretrained folder to a sharded model, per system
    try:
        systems, settings = prepare(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"hf-zero bench: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "lockstep", False):
        return _run_lockstep(args, systems, settings)
    with extensions_dir(any(SYSTEMS[base_system(name)[0]].jit_extensions for name in systems)):
        rows = [run_one(i, system, systems, settings) for i, system in enumerate(systems)]
    return report(args, systems, settings, rows)


def report(args: argparse.Namespace, systems: List[str], settings: Settings, rows: List[Dict[str, Any]],
           format_rows: Callable[[List[Dict[str, Any]]], str] = format_table, notes: Sequence[str] = (),
           json_settings: Optional[Dict[str, Any]] = None) -> int:
    """The rows' "x DDP" (against DDP on the same link), the table (`format_rows`, then `notes` under it), --json
    (the settings, `json_settings` added) and --plot; the exit code: 1 when an hf_zero system failed, else 0."""
    for rate in {r.get("link_rate") for r in rows}:  # "x DDP": against DDP on the same link
        ddp = next((r for r in rows if r["system"] == "ddp" and r["status"] == "ok"
                    and r.get("link_rate") == rate), None)
        for r in rows:
            if r.get("link_rate") == rate:
                ok = r["status"] == "ok" and ddp is not None and ddp["tokens_per_s"] > 0
                r["x_ddp"] = r["tokens_per_s"] / ddp["tokens_per_s"] if ok else None

    table = format_rows(rows)
    if notes:
        table += "\n" + "\n".join(notes)
    compiled = [r for r in rows if r.get("graph_breaks") is not None]
    if compiled:
        table += "\n" + "\n".join(f"{r['system']}: {r['graph_breaks']} graph breaks, {r['graphs_compiled']} graphs "
                                  f"({r['compile_backend']})" for r in compiled)
    table += format_phases(rows)
    to_stdout = args.json != "-"
    print(table, file=sys.stdout if to_stdout else sys.stderr, flush=True)

    if args.json:
        write_json_line(args.json, {**asdict(settings), "systems": systems,
                                     "tokens_per_step": settings.tokens_per_step, **(json_settings or {})}, rows)

    if getattr(args, "plot", None):
        from .plot import plot_rows

        plot_rows(rows, args.plot, title=f"{settings.model_name}, {settings.num_processes} ranks, "
                                         f"{settings.tokens_per_step:,} tokens/step, "
                                         f"mixed precision {settings.mixed_precision}")
        log(f"plot written to {args.plot}")

    # A skipped hf_zero row (a hierarchical option without a usable K) said why; only a failed one fails the run.
    failed_hf_zero = [r["system"] for r in rows if r["status"] not in ("ok", "skipped") and r.get("hf_zero")]
    if failed_hf_zero:
        log(f"hf_zero system(s) failed: {', '.join(failed_hf_zero)}")
        return 1
    return 0
