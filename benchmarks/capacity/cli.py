"""`python -m benchmarks.capacity` (formerly `hf-zero bench --capacity`): the capacity flags, the run over
ranks x modes x systems (`run_capacity`), its table, JSON and plot."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from hf_zero.tools.bench.runner import log

from .budget import CGROUP_MODES
from .cells import OVERHEAD_GUESS, Cell, measured_overhead, search_cell, seed_layers
from .cgroups import memory_cgroup_support
from .estimate import Estimator
from .systems import ALL_SYSTEMS, DEFAULT_SYSTEMS, SHAPES, SYSTEMS, parse_modes, parse_system, parse_systems
from .table import cell_json, format_table, plot_cells
from .trials import RunOptions
from .units import gib, parse_bytes
from .weights import RandomCheckpoint

DEFAULT_BUDGET = "640MiB"
DESCRIPTION = ("the largest Llama (layers added at a fixed width) that each system trains within a per-rank memory "
               "budget, enforced by a memory cgroup per rank, next to the estimator's prediction")


def _argument_type(parse, what: str):
    """argparse's `type` from a parser that raises ValueError: the message names the flag's value and why."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what  # argparse names the type in "invalid <name> value" messages
    return convert


def parse_ranks(text: str) -> List[int]:
    """"2,4" -> [2, 4]: world sizes, each a positive integer."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"world sizes are positive integers, comma-separated (e.g. 2,4), got {text!r}")
    return list(dict.fromkeys(int(p) for p in parts))


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    """The capacity run's flags, all distinct from `hf-zero bench`'s (they shared one parser before the capacity run
    moved here); the two they have in common, --seed and --malloc-mmap-threshold, `add_shared_arguments` adds."""
    g = parser.add_argument_group("capacity (python -m benchmarks.capacity)")
    count = _argument_type(positive_int, "positive integer")
    g.add_argument("--budget", type=parse_bytes, default=parse_bytes(DEFAULT_BUDGET), metavar="BYTES",
                   help=f"memory per rank, e.g. 1.5GiB, 1536MiB, 2e9 (default {DEFAULT_BUDGET}); enforced by a memory "
                        f"cgroup per rank where the machine has one")
    g.add_argument("--capacity-systems", dest="capacity_systems", default=DEFAULT_SYSTEMS, metavar="LIST",
                   type=_argument_type(parse_systems, "system list"),
                   help=f"comma-separated systems, 'all' for {', '.join(ALL_SYSTEMS)}; a peer may take ':bf16' "
                        f"(parameters stored in bf16, e.g. fsdp2:bf16); deepspeed_zero3-int8 is DeepSpeed's "
                        f"zero_quantized_nontrainable_weights (default {DEFAULT_SYSTEMS})")
    g.add_argument("--ranks", default="2", metavar="N[,N...]", type=_argument_type(parse_ranks, "world sizes"),
                   help="world sizes (default 2; e.g. 2,4)")
    g.add_argument("--modes", default="full", metavar="full,lora", type=_argument_type(parse_modes, "mode list"),
                   help="full fine-tune and/or LoRA (PEFT, q_proj and v_proj) (default full)")
    g.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                   help="width preset: " + "; ".join(f"{k}: hidden {v['hidden_size']}, intermediate "
                                                      f"{v['intermediate_size']}, {v['num_attention_heads']} heads, "
                                                      f"vocab {v['vocab_size']}" for k, v in SHAPES.items())
                        + " (default tiny)")
    g.add_argument("--width", type=count, default=None, help="hidden size (overrides the shape's)")
    g.add_argument("--intermediate", type=count, default=None,
                   help="MLP size (default: the shape's, or 2.6875 x width)")
    g.add_argument("--heads", type=count, default=None, help="attention heads (default: the shape's, or width / 64)")
    g.add_argument("--vocab", type=count, default=None, help="vocabulary size (default: the shape's)")
    g.add_argument("--layers", type=count, default=None,
                   help="run each system once at this many layers instead of searching (the 7B demonstration)")
    g.add_argument("--max-layers", type=count, default=256,
                   help="the search's largest size (default 256): a system that still fits there is 'capped'")
    g.add_argument("--train-steps", type=count, default=2,
                   help="optimizer steps a size must train to fit (default 2: the first allocates the optimizer's "
                        "states, the second runs with everything live)")
    g.add_argument("--tokens", type=count, default=16, help="sequence length (default 16; batch 1 per rank)")
    g.add_argument("--lora-rank", type=count, default=8, help="LoRA rank (default 8)")
    g.add_argument("--cgroups", choices=CGROUP_MODES, default="per-rank",
                   help="per-rank: a memory cgroup per rank limited to the budget (default); shared: one cgroup of "
                        "ranks x budget; off: no limit, each size's peak RSS compared with the budget")
    g.add_argument("--trial-timeout", type=float, default=900.0,
                   help="seconds one trial (one size of one system) may take (default 900)")
    g.add_argument("--weights-dir", default=None, metavar="DIR",
                   help="where hf_zero's random checkpoint is written (default: a temporary folder, removed after)")
    g.add_argument("--keep-weights", action="store_true",
                   help="keep the random checkpoint in --weights-dir for the next run (default: removed)")
    g.add_argument("--weights-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of that checkpoint's files (default fp32; bf16 halves the disk, the model still "
                        "loads in fp32)")
    g.add_argument("--capacity-json", dest="capacity_json", default=None, metavar="PATH",
                   help="write the cells (and every trial) as JSON")
    g.add_argument("--capacity-plot", dest="capacity_plot", default=None, metavar="PNG",
                   help="plot measured against estimated layer counts (needs matplotlib)")

def add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    """The two flags a capacity run shares with `hf-zero bench` (which declares them itself in its own parser)."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="glibc's MALLOC_MMAP_THRESHOLD_ in every rank: buffers of at least BYTES are mmap'd and "
                             "given back when freed (default: glibc's own, which keeps freed chunks of up to 32 MiB "
                             "in the heap, where they count against the budget)")


def _shape(args: argparse.Namespace) -> Dict[str, int]:
    """The Llama's width from --shape, with --width (MLP and heads scaled as Llama-2's unless given), --intermediate,
    --heads, --vocab over it."""
    shape = dict(SHAPES[args.shape])
    if args.width is not None:
        shape["hidden_size"] = args.width
        if args.intermediate is None:
            shape["intermediate_size"] = int(math.ceil(args.width * 11008 / 4096 / 8) * 8)
        if args.heads is None:
            shape["num_attention_heads"] = max(1, args.width // 64)
    for key, value in (("intermediate_size", args.intermediate), ("num_attention_heads", args.heads),
                       ("vocab_size", args.vocab)):
        if value is not None:
            shape[key] = value
    if shape["hidden_size"] % shape["num_attention_heads"]:
        raise ValueError(f"width {shape['hidden_size']} is not a multiple of {shape['num_attention_heads']} heads")
    return shape


def _listed(value: Any, parse) -> List[Any]:
    return list(value) if isinstance(value, (list, tuple)) else parse(value)


# glibc keeps freed chunks of up to 32 MiB in its heap (its dynamic mmap threshold): measured, that moved a rank's
# peak by up to 0.4 GiB between neighbouring sizes and hid two thirds of stage 3 + int8's capacity (39 layers
# against 124 at 1.5 GiB). With buffers of 1 MiB and more mmap'd and given back when freed, the peak follows the
# buffers the system holds, which is what the table compares.
CAPACITY_MMAP_THRESHOLD = 1 << 20


def _mmap_threshold(args: argparse.Namespace) -> Optional[int]:
    """--malloc-mmap-threshold for the ranks: CAPACITY_MMAP_THRESHOLD unless given; 0 leaves glibc's own."""
    value = getattr(args, "malloc_mmap_threshold", None)
    if value is None:
        return CAPACITY_MMAP_THRESHOLD
    return value or None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # `kill PID` must still run the finally blocks: the ranks are killed, their cgroups (which keep their limit and
    # charge until root removes them) and the random checkpoint removed
    raise SystemExit(128 + signum)


def run_capacity(args: argparse.Namespace) -> int:
    """Run the capacity table (or the fixed-size runs of --layers); print it; 0 when every cell ran, 1 otherwise.
    SIGTERM ends it like Ctrl-C: ranks killed, cgroups and the random checkpoint removed."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _run_capacity(args)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run_capacity(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_capacity(args: argparse.Namespace) -> int:
    try:
        shape = _shape(args)
        # argparse has parsed these already; a Namespace made in code may still hold the command line's text
        systems = _listed(args.capacity_systems, parse_systems)
        ranks = _listed(args.ranks, parse_ranks)
        modes = _listed(args.modes, parse_modes)
        if args.keep_weights and args.weights_dir is None:
            raise ValueError("--keep-weights keeps the random checkpoint in --weights-dir: name the folder")
        if args.capacity_plot:
            from hf_zero.tools.bench.plot import check_matplotlib

            check_matplotlib()  # before the trials, not after
    except (ValueError, ImportError) as exc:
        print(f"python -m benchmarks.capacity: error: {exc}", file=sys.stderr)
        return 2
    support, why = (None, "--cgroups off") if args.cgroups == "off" else memory_cgroup_support()
    cgroups = args.cgroups if support is not None else "off"
    if support is None and args.cgroups != "off":
        log(f"no memory cgroup ({why}): the budget is NOT enforced; each size runs unlimited and its peak RSS is "
            f"compared with the budget")
    own_dir = args.weights_dir is None
    workdir = tempfile.mkdtemp(prefix="hfz_capacity_") if own_dir else args.weights_dir
    os.makedirs(workdir, exist_ok=True)
    opts = RunOptions(shape=shape, budget=args.budget, steps=args.train_steps, seq_len=args.tokens,
                      lora_rank=args.lora_rank, seed=getattr(args, "seed", 0) or 0, timeout_s=args.trial_timeout,
                      cgroups=cgroups, support=support, workdir=workdir,
                      malloc_mmap_threshold=_mmap_threshold(args))
    estimator = Estimator(shape, args.lora_rank)
    needs_weights = any(SYSTEMS[parse_system(s)[0]].family == "hf_zero" for s in systems)
    checkpoint = RandomCheckpoint(os.path.join(workdir, "weights"), shape, args.weights_dtype, opts.seed) \
        if needs_weights else None
    enforcement = (f"{cgroups} memory cgroup v{support.version}" if support is not None
                   else f"NOT enforced ({why}): peak RSS compared with the budget")
    log(f"Llama hidden {shape['hidden_size']}, intermediate {shape['intermediate_size']}, "
        f"{shape['num_attention_heads']} heads, vocab {shape['vocab_size']}; budget {gib(args.budget)} per rank, "
        f"{enforcement}; {opts.steps} steps of batch 1 x {opts.seq_len} tokens; systems {', '.join(systems)}; "
        f"modes {', '.join(modes)}; ranks {', '.join(map(str, ranks))}; glibc MALLOC_MMAP_THRESHOLD_ "
        f"{opts.malloc_mmap_threshold or 'its own (dynamic)'}")
    cells: List[Cell] = []
    overheads: Dict[str, int] = {}  # per family, what ranks held besides model states so far: the next seed's
    t0 = time.monotonic()
    try:
        for world in ranks:
            for mode in modes:
                for name in systems:
                    family = SYSTEMS[parse_system(name)[0]].family
                    if mode not in SYSTEMS[parse_system(name)[0]].modes:
                        continue
                    overhead = overheads.get(family, max(overheads.values(), default=OVERHEAD_GUESS))
                    start = seed_layers(estimator, name, mode, world, args.budget, overhead, args.max_layers)
                    cell = search_cell(name, mode, world, opts, checkpoint, estimator, args.max_layers, args.layers,
                                       start=start)
                    cells.append(cell)
                    measured = measured_overhead(cell.trials)
                    if measured is not None:
                        overheads[family] = max(measured, overheads.get(family, 0))
    finally:
        written = checkpoint.written_s if checkpoint is not None else 0.0
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif checkpoint is not None and not args.keep_weights:
            shutil.rmtree(checkpoint.root, ignore_errors=True)
    title = (f"Llama width {shape['hidden_size']} (intermediate {shape['intermediate_size']}, vocab "
             f"{shape['vocab_size']}), {gib(args.budget)} per rank, {enforcement}")
    print(title)
    print(format_table(cells, fixed=args.layers is not None))
    print("est. layers: the estimator's largest layer count whose model states fit the budget (the paper's formulas "
          "for the peers, hf_zero's plan for hf_zero); est. (budget - runtime): the same within the budget less the "
          "measured runtime footprint (interpreter, torch, libraries, process group). Model states only: the gap to "
          "the measured count is the rest column, peak RSS - model states - runtime (activations, communication "
          "buffers, gathered units, temporaries, the allocator's retained heap). trials (from): the trials the search "
          "took and the size it started from, the estimator's count within the budget less what ranks held besides "
          "their model states earlier in the run (peak RSS - model states).")
    log(f"done in {time.monotonic() - t0:.0f}s ({written:.0f}s writing the random checkpoint)")
    if args.capacity_json:
        with open(args.capacity_json, "w") as f:
            json.dump({"settings": {"shape": shape, "budget": args.budget, "enforcement": enforcement,
                                    "steps": opts.steps, "seq_len": opts.seq_len, "lora_rank": opts.lora_rank,
                                    "systems": systems, "modes": modes, "ranks": ranks, "layers": args.layers,
                                    "malloc_mmap_threshold": opts.malloc_mmap_threshold},
                       "cells": [cell_json(c) for c in cells]}, f)
    if args.capacity_plot:
        plot_cells(cells, args.capacity_plot, title)
        log(f"plot written to {args.capacity_plot}")
    return 0 if all(c.status != "error" for c in cells) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m benchmarks.capacity [flags]`, or a trial's rank (`--worker JOB --rank R`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        from .worker import worker_main

        worker_main(argv[1], int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=DESCRIPTION)
    add_capacity_arguments(parser)
    add_shared_arguments(parser)
    return run_capacity(parser.parse_args(argv))
