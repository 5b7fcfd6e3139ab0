"""hf-zero estimate --dry-run: the command line over dry_run.py (one dry run per stage, a table or --json)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Tuple

from ...config import ZeroConfig, ZeroConfigError
from ...options import BY_NAME, HIERARCHICAL
from .dry_run import CANNOT_SEE, dry_run
from .plan import GB, STAGES
from .table import table as _table


def add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="run the real engine for one optimizer step as one rank of N on fake tensors (no "
                             "weights, no math) and report what it allocated and sent beside the estimate; --model "
                             "also takes a preset name (tiny, gpt2, gpt2-5m, llama270m, or a Hub name whose shape it knows: "
                             "meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf, HuggingFaceTB/SmolLM2-135M), --params "
                             "builds a Llama of that size")
    parser.add_argument("--hierarchy", choices=("none",) + tuple(HIERARCHICAL), default="none",
                        help="--dry-run: HSDP (shard_group_size) or hpZ (hpz_partition_size) over the "
                             "--ranks-per-host ranks of each host")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="--dry-run: any other ZeroConfig setting, e.g. --option quantized_weights=int8 "
                             "(repeatable)")
    parser.add_argument("--rank", type=int, default=0, help="--dry-run: the rank to play (default 0)")
    parser.add_argument("--steps", type=int, default=1,
                        help="--dry-run: optimizer steps to run, reporting the last (2: the steady state, once the "
                             "first backward has fixed the gradient buckets' launch order)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="--dry-run: hf_zero's activation checkpointing on the layers (as activation_checkpointing "
                             "'on' installs it)")
    parser.add_argument("--cpu-checkpointing", action="store_true",
                        help="--dry-run, with --gradient-checkpointing: the checkpoints in host memory "
                             "(cpu_checkpointing, P_a+cpu), reported apart from the device's bytes")


def _configs(args: argparse.Namespace) -> Dict[int, ZeroConfig]:
    values: Dict[str, Any] = {"mixed_precision": args.mixed_precision,
                              "grad_accum_dtype": args.grad_accum_dtype or "fp32"}
    for item in args.option:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ZeroConfigError(f"--option {item!r}: write KEY=VALUE, e.g. --option quantized_weights=int8")
        if key not in BY_NAME or not BY_NAME[key].engine:
            raise ZeroConfigError(f"--option {key}: no such ZeroConfig setting (docs/configuration.md lists them)")
        try:  # each option reads its own text, as its hf-zero config flag does
            values[key] = BY_NAME[key].kind.parse(text.strip(), f"--option {key}")
        except argparse.ArgumentTypeError as exc:
            raise ZeroConfigError(str(exc)) from None
    if args.hierarchy != "none":
        values[HIERARCHICAL[args.hierarchy]] = "host"
    stages = STAGES if args.stage is None else (args.stage,)
    if args.hierarchy == "hpz":
        stages = (3,)
    elif args.hierarchy == "hsdp":
        stages = tuple(s for s in stages if s >= 1)
    return {stage: ZeroConfig(**{**values, "stage": stage}) for stage in stages}


def misplaced(args: argparse.Namespace) -> List[str]:
    """Flags that mean nothing with (or without) --dry-run, named so the caller can say which to drop."""
    if args.dry_run:
        given = (("--zeropp", args.zeropp), ("--fits", args.fits is not None),
                 ("--trainable-fraction", args.trainable_fraction != 1), ("--optimizer-k", args.optimizer_k is not None),
                 ("--quantized-frozen-weights", args.quantized_frozen_weights))
    else:
        given = (("--hierarchy", args.hierarchy != "none"), ("--option", bool(args.option)), ("--rank", args.rank != 0),
                 ("--gradient-checkpointing", args.gradient_checkpointing), ("--steps", args.steps != 1),
                 ("--cpu-checkpointing", args.cpu_checkpointing))
    return [flag for flag, present in given if present]


def run_dry(args: argparse.Namespace) -> int:
    if args.num_processes is None:
        print("hf-zero estimate: --dry-run needs --num-processes N", file=sys.stderr)
        return 2
    try:
        configs = _configs(args)
    except (ZeroConfigError, TypeError, ValueError) as exc:
        print(f"hf-zero estimate: error: {exc}", file=sys.stderr)
        return 2
    model = args.params if args.params is not None else args.model
    reports: List[Dict[str, Any]] = []
    for stage, config in configs.items():
        try:
            reports.append(dry_run(model, config, args.num_processes, ranks_per_host=args.ranks_per_host,
                                   rank=args.rank, batch_size=args.batch_size or 1, seq_len=args.seq_len or 128,
                                   micro_batches=args.micro_batches, steps=args.steps,
                                   gradient_checkpointing=args.gradient_checkpointing,
                                   cpu_checkpointing=args.cpu_checkpointing,
                                   progress=not args.json and sys.stderr.isatty()))
        except (OSError, ValueError, ZeroConfigError) as exc:
            print(f"hf-zero estimate: error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({"mode": "dry_run", "runs": reports}, default=float))
    else:
        print(render(reports))
    return 0


def _unit(reports: List[Dict[str, Any]]) -> Tuple[str, float]:
    """GB (the paper's, decimal) for big models, MB for small ones."""
    largest = max(r["measured"]["model_states"] for r in reports)
    return ("GB", GB) if largest >= 0.1 * GB else ("MB", 1e6)


def _long_sequences(r: Dict[str, Any]) -> str:
    """The header's note on sequence parallelism, tiling and CPU checkpoints, empty when none is on."""
    ls = r.get("long_sequences", {})
    parts = []
    if ls.get("sequence_parallel_size", 1) > 1:
        a2a = ls["all_to_all"]
        parts.append(f"sequence parallel over {ls['sequence_parallel_size']} ranks ({ls['tokens_per_rank']:,} tokens "
                     f"per rank, {a2a['calls']} all-to-alls of {a2a['bytes'] / 1e9:.3g} GB a step)")
    for key, what in (("tiled_loss_tokens", "tiled loss"), ("tiled_mlp_tokens", "tiled MLP")):
        if ls.get(key):
            parts.append(f"{what} {ls[key]:,} tokens")
    if r.get("cpu_checkpointing"):
        parts.append("activation checkpoints in host memory")
    return "; " + ", ".join(parts) if parts else ""


def _elements(d: Dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in d.items()) or "-"


def render(reports: List[Dict[str, Any]]) -> str:
    first = reports[0]
    unit, scale = _unit(reports)
    _g = lambda x: f"{x / scale:.3f}"  # noqa: E731
    lines = [f"Dry run: rank {first['rank']} of N = {first['world_size']} ({first['hosts']} host(s) of "
             f"{first['ranks_per_host']}), Ψ = {first['psi']:,} trainable + {first['frozen']:,} frozen, "
             f"mixed_precision {first['mixed_precision']}, grad_accum_dtype {first['grad_accum_dtype']}, "
             f"micro-batch {first['batch_size']} x {first['seq_len']}, {first['micro_batches']} per step"
             + _long_sequences(first),
             f"model states per rank, {unit} (measured = the engine's memory_stats() after the step; plan = the "
             "estimator's exact count; formula = the paper's, no padding; peak = the most live bytes of the step, on "
             "the device and in host memory (offload, CPU checkpoints) apart; activations = the forward's most):"]
    header = ["", "params", "grads", "master", "optim", "measured", "plan", "formula", "Δ formula",
              "peak: device", "host", "activations"]
    rows = []
    for r in reports:
        m = r["measured"]
        label = f"stage {r['stage']}" + ("" if r["option"] == "none" else f" {r['option']}")
        delta = (m["model_states"] - r["formula"]["model_states"]) / max(r["formula"]["model_states"], 1)
        rows.append([label, _g(m["params"]), _g(m["grads"]), _g(m["master"]), _g(m["optimizer_states"]),
                     _g(m["model_states"]), _g(r["plan"]["model_states"]), _g(r["formula"]["model_states"]),
                     f"{100 * delta:+.2f}%", _g(r["peak"]["device"]["total"]), _g(r["peak"]["host"]["total"]),
                     _g(r["peak"]["activations"])])
    lines.append(_table(header, rows))
    lines.append(f"working buffers per rank, {unit}: the step's peak beside the budget the engine keeps it to "
                 "(gradient buckets: comm_buffers_budget; gathered stage-3 parameters: live_parameters_budget, "
                 "max_live_parameters in bytes, which prefetches keep to):")
    rows = []
    for r in reports:
        m = r["measured"]
        label = f"stage {r['stage']}" + ("" if r["option"] == "none" else f" {r['option']}")
        gathered = (f"{_g(m['gathered_params_peak'])} / {_g(m['live_parameters_budget'])}" if r["stage"] == 3
                    else "-")
        rows.append([label, f"{_g(m['comm_buffers_peak'])} / {_g(m['comm_buffers_budget'])}", gathered])
    lines.append(_table(["", "gradient buckets, peak / budget", "gathered parameters, peak / budget"], rows))
    lines.append("communication per rank and step, elements (ledger = the engine's, formula = the paper's counting "
                 "over the plan's padded groups):")
    rows = []
    for r in reports:
        label = f"stage {r['stage']}" + ("" if r["option"] == "none" else f" {r['option']}")
        for side in ("intra", "inter"):
            ledger = {k: v[f"{side}_elements"] for k, v in r["ledger"].items() if k != "total" and v[f"{side}_elements"]}
            formula = {k: v["elements"] for k, v in r["formula_comm"].get(side, {}).items() if v["elements"]}
            if ledger or formula:
                rows.append([label, side, _elements(ledger), _elements(formula)])
    lines.append(_table(["", "host", "ledger", "formula"], rows))
    secs = ", ".join(f"stage {r['stage']}: shard_model {r['seconds']['shard_model']:.1f} s, step "
                     f"{r['seconds']['step']:.1f} s" for r in reports)
    lines.append(f"({secs})")
    lines.append("Not seen by a dry run: " + "; ".join(CANNOT_SEE) + ".")
    return "\n".join(lines)

