"""hf-zero estimate: the command line over tools/estimate (formula mode, plan mode, activations, --fits)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Dict, List, Optional

from ...config import ZeroConfig
from ...options import BY_NAME, QUANTIZATION_BITS
from .activations import ATTENTION_KINDS, activation_report
from .dry_run_cli import add_dry_run_arguments, misplaced, run_dry
from .table import table as _table
from .formulas import DEFAULT_BLOCK_SIZE
from .plan import (GB, MAX_WORLD, STAGES, ZEROPP_RANKS_PER_HOST, ZEROPP_WORLDS, Planner, check_ranks_per_host,
                   fits_formula, fits_plan, fits_with_activations, formula_recipe, formula_report,
                   hierarchical_formula_report, hierarchical_plan_report, plan_report, zeropp_formula_report,
                   zeropp_plan_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="formula mode: Ψ, the number of parameters (e.g. 7.5e9); all "
                                                   "trainable unless --trainable-fraction says otherwise")
    what.add_argument("--model", help="plan mode: a local config.json (or its folder); built on the meta device")
    parser.add_argument("--num-processes", type=int, default=None, help="N, the data-parallel world size")
    parser.add_argument("--ranks-per-host", type=int, default=None, metavar="K",
                        help="ranks per host (N = hosts x K, K dividing N): adds the multi-host table, the plain "
                             "stage, HSDP (shard_group_size=K, stages 1-3) and hpZ (hpz_partition_size=K, stage 3) "
                             "with memory per rank and communication split into intra- and inter-host (default: "
                             "K = N, one host; the JSON output always carries it)")
    parser.add_argument("--stage", type=int, choices=STAGES, default=None, help="one stage (default: all four)")
    precision = BY_NAME["mixed_precision"].kind
    parser.add_argument("--mixed-precision", default="bf16",
                        choices=precision.values + tuple(a for a, _ in precision.aliases if isinstance(a, str)))
    parser.add_argument("--grad-accum-dtype", default=None, choices=BY_NAME["grad_accum_dtype"].kind.values,
                        help="gradient accumulation dtype (default: 'compute' with --params, ZeroConfig's 'fp32' "
                             "with --model)")
    parser.add_argument("--optimizer-k", type=int, default=None,
                        help="formula mode: K, bytes of master + optimizer states per parameter (paper: 12)")
    parser.add_argument("--trainable-fraction", type=float, default=1.0, metavar="F",
                        help="formula mode: the trainable share of --params (LoRA: ~0.01); the rest is frozen and "
                             "counted apart (compute copy only, never reduced)")
    parser.add_argument("--quantized-frozen-weights", action="store_true",
                        help="stage 3: frozen parameters kept as int8 codes plus an fp32 scale per --block-size "
                             "elements (ZeroConfig.quantized_frozen_weights='int8')")
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per optimizer step")
    parser.add_argument("--fits", type=float, default=None, metavar="GB",
                        help="also print the smallest N (1..65536) for which each stage fits in GB per device")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help="plan mode: micro-batch size per device; with --seq-len adds the activation estimate "
                             "(with and without checkpointing) and counts it in --fits")
    parser.add_argument("--seq-len", type=int, default=None, metavar="S", help="plan mode: sequence length")
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default=None,
                        help="eager keeps the a*s*s attention probabilities (the paper's count); sdpa: a fused "
                             "flash / memory-efficient kernel that does not (default: eager, or sdpa with "
                             "--sequence-parallel-size above 1, which runs fused kernels only)")
    for name, what in LONG_SEQUENCES.items():  # the ZeroConfig options, named as hf-zero config names them
        option = BY_NAME[name]
        parser.add_argument(option.flag, type=option.parse, default=None, metavar=option.kind.metavar,
                            help=f"plan mode with --batch-size/--seq-len (and --dry-run): {what}")
    parser.add_argument("--zeropp", action="store_true",
                        help="ZeRO++ instead (Wang et al. 2023): intra- and inter-host bytes per rank and step of "
                             "stage 3 plain, hpZ, qwZ, hpZ + qwZ, hpZ + qwZ + qgZ, qgZ, HSDP, stage 2 and stage 2 + "
                             "qgZ, next to the paper's figures, at N = 64 and 1024 in hosts of 8 (or the given "
                             "--num-processes / --ranks-per-host)")
    widths = tuple(QUANTIZATION_BITS.values())
    parser.add_argument("--weights-bits", type=int, choices=widths, default=8, help="--zeropp: qwZ's code width")
    parser.add_argument("--gradients-bits", type=int, choices=widths, default=4, help="--zeropp: qgZ's code width")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="--zeropp: elements per fp32 scale (quantization_block_size)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    add_dry_run_arguments(parser)


# the options that change a sequence's activations, not the model states: counted by activation_report
LONG_SEQUENCES = {
    "sequence_parallel_size": "Ulysses sequence parallelism over K ranks, each holding S/K tokens (counted for sdpa, "
                              "the fused kernels it runs)",
    "tiled_loss_tokens": "the head and the loss over tiles of T tokens (no [S, vocab] log-probabilities kept)",
    "tiled_mlp_tokens": "the MLPs and norms over tiles of T positions (each keeps its input only)",
}


def _long_sequences(args: argparse.Namespace) -> Dict[str, int]:
    return {name: getattr(args, name) for name in LONG_SEQUENCES if getattr(args, name) is not None}


def _gb(x: float) -> str:
    return f"{x / GB:.1f}" if x >= 0.05 * GB or x == 0 else f"{x / GB:.3g}"


def _fmt_comm(d: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(d.items()))


def run(args: argparse.Namespace) -> int:
    wrong = misplaced(args)
    if wrong:
        flags, one = ", ".join(wrong), len(wrong) == 1
        if args.dry_run:
            print(f"hf-zero estimate: {flags} {'is' if one else 'are'} not for a dry run (settings go in --option "
                  f"KEY=VALUE): drop {'it' if one else 'them'}", file=sys.stderr)
        else:
            print(f"hf-zero estimate: {flags} only {'applies' if one else 'apply'} with --dry-run: add --dry-run or "
                  f"drop {'it' if one else 'them'}", file=sys.stderr)
        return 2
    long = _long_sequences(args)
    if args.dry_run:  # the dry run takes every ZeroConfig setting as --option KEY=VALUE
        args.option = [f"{name}={value}" for name, value in long.items()] + list(args.option)
        return run_dry(args)
    if args.zeropp:
        return run_zeropp(args)
    t0 = time.perf_counter()
    stages = STAGES if args.stage is None else (args.stage,)
    n = args.num_processes
    with_activations = args.batch_size is not None or args.seq_len is not None
    if n is None and args.fits is None and not with_activations:
        print("hf-zero estimate: give --num-processes N (and/or --fits GB, --batch-size B --seq-len S)",
              file=sys.stderr)
        return 2
    if n is not None and not 1 <= n <= MAX_WORLD:
        print(f"hf-zero estimate: --num-processes must be in 1..{MAX_WORLD}", file=sys.stderr)
        return 2
    if with_activations and (args.batch_size is None or args.seq_len is None or args.model is None):
        print("hf-zero estimate: activations need --model with both --batch-size and --seq-len", file=sys.stderr)
        return 2
    if long and not with_activations:
        print(f"hf-zero estimate: {', '.join(BY_NAME[name].flag for name in long)} only change"
              f"{'s' if len(long) == 1 else ''} the activations: give --model with --batch-size and --seq-len",
              file=sys.stderr)
        return 2
    if not 0 < args.trainable_fraction <= 1:
        print("hf-zero estimate: --trainable-fraction must be in (0, 1]", file=sys.stderr)
        return 2
    if args.trainable_fraction != 1 and args.params is None:
        print("hf-zero estimate: --trainable-fraction is for formula mode (--params); plan mode counts the model's "
              "own requires_grad", file=sys.stderr)
        return 2
    if args.ranks_per_host is not None:
        if n is None:
            print("hf-zero estimate: --ranks-per-host K needs --num-processes N (N ranks in hosts of K)",
                  file=sys.stderr)
            return 2
        try:
            check_ranks_per_host(n, args.ranks_per_host)
        except ValueError as exc:
            print(f"hf-zero estimate: error: {exc}", file=sys.stderr)
            return 2
    k = args.ranks_per_host or n
    budget = args.fits * GB if args.fits is not None else None
    out: Dict[str, Any]
    if args.params is not None:
        r = formula_recipe(args.mixed_precision, args.optimizer_k, args.grad_accum_dtype or "compute")
        psi = args.params * args.trainable_fraction
        frozen = args.params - psi
        frozen_block = args.block_size if args.quantized_frozen_weights else None
        out = formula_report(psi, n or 1, r, args.micro_batches, stages, frozen, frozen_block) if n else {
            "mode": "formula", "psi": psi, "frozen": frozen, "recipe": dataclasses.asdict(r), "stages": {}}
        if n:
            out.update(ranks_per_host=k, hosts=n // k,
                       hierarchical=hierarchical_formula_report(psi, n, k, r, args.micro_batches, stages, frozen))
        if budget is not None:
            out["fits"] = {"gb": args.fits, "min_world_size": fits_formula(psi, r, budget, stages, frozen)}
    else:
        quantized = dict(stage=3, quantized_frozen_weights="int8", quantization_block_size=args.block_size) \
            if args.quantized_frozen_weights else {}
        config = ZeroConfig(mixed_precision=args.mixed_precision, grad_accum_dtype=args.grad_accum_dtype or "fp32",
                            **quantized, **long)
        from ...integrations.hf_models import meta_model

        try:
            model = meta_model(args.model)
        except (OSError, ValueError) as exc:  # a missing or unreadable config: say which, no traceback
            print(f"hf-zero estimate: error: {exc}. Give --model a local config.json or model folder, or --params N",
                  file=sys.stderr)
            return 2
        planner = Planner(model, config)
        out = plan_report(model, n or 1, config, stages, micro_batches=args.micro_batches, planner=planner) if n \
            else {"mode": "plan", "stages": {}}
        if n:
            out.update(ranks_per_host=k, hosts=n // k,
                       hierarchical=hierarchical_plan_report(planner, n, k, stages, args.micro_batches))
        if with_activations:
            try:
                attention = args.attention or ("sdpa" if config.sequence_parallel_size > 1 else "eager")
                out["activations"] = activation_report(model, args.batch_size, args.seq_len, config, attention)
            except ValueError as exc:  # settings the run itself would refuse (sp with eager attention, ...)
                print(f"hf-zero estimate: error: {exc}", file=sys.stderr)
                return 2
        if budget is not None:
            out["fits"] = {"gb": args.fits, "min_world_size": fits_plan(model, config, budget, stages,
                                                                        planner=planner)}
            if with_activations:
                out["fits"]["with_activations"] = fits_with_activations(model, config, budget, out["activations"],
                                                                        stages, planner)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    if args.json:
        print(json.dumps(out, default=float))
        return 0
    print(_render(out, n, hosts_table=args.ranks_per_host is not None))
    return 0


def _render(out: Dict[str, Any], n: Optional[int], hosts_table: bool = False) -> str:
    lines = []
    if out["mode"] == "formula":
        r = out["recipe"]
        frozen = f" + {out['frozen']:.4g} frozen" if out.get("frozen") else ""
        lines.append(f"Formula mode: Ψ = {out['psi']:.4g} trainable{frozen} parameters, " + (f"N = {n}, " if n else "") +
                     f"bytes/param: "
                     f"params {r['param']}, grads {r['grad']}, master {r['master']}, optimizer {r['optim']}")
        if out["stages"]:
            rows = [[f"stage {s}", _gb(v["model_states"]), _fmt_comm(v["comm_elements"]), _fmt_comm(v["comm_bytes"])]
                    for s, v in out["stages"].items()]
            lines.append(_table(["", "model states / rank (GB)", "comm elements / step / rank",
                                 "comm bytes / step / rank"], rows))
    else:
        if out["stages"]:
            lines.append(f"Plan mode: Ψ = {out['psi']:,} trainable + {out['frozen']:,} frozen, N = {n}, "
                         f"mixed_precision {out['mixed_precision']}, grad_accum_dtype {out['grad_accum_dtype']}, "
                         f"buckets: reduce {out['reduce_bucket_size']:,} B, all-gather "
                         f"{out['allgather_bucket_size']:,} B")
            rows = []
            for s, v in out["stages"].items():
                r0, mx = v["rank0"], v["max"]
                rows.append([f"stage {s}", _gb(r0["params"]), _gb(r0["grads"]), _gb(r0["master"]),
                             _gb(r0["optimizer_states"]), _gb(r0["model_states"]),
                             f"{_gb(mx['model_states'])} (r{mx['rank']})", f"{v['padding_elements']:,}",
                             _gb(v["largest_unit_bytes"]), _fmt_comm(v["comm_elements"]), _fmt_comm(v["comm_bytes"])])
            lines.append(_table(["", "params GB", "grads GB", "master GB", "optim GB", "rank 0 GB", "max GB",
                                 "padding el.", "largest unit GB", "comm elements/step", "comm bytes/step"], rows))
    if hosts_table and out.get("hierarchical"):
        lines.extend(_render_hosts(out))
    if "activations" in out:
        lines.extend(_render_activations(out["activations"]))
    if "fits" in out:
        f = out["fits"]
        lines.append(f"Fits in {f['gb']:g} GB per device (model states only): " + _fits_parts(f["min_world_size"]))
        for mode, mins in f.get("with_activations", {}).items():
            peak = out["activations"][mode]["peak"]
            alone = f" (the activations alone need {_gb(peak)} GB)" if peak >= f["gb"] * GB else ""
            lines.append(f"Fits in {f['gb']:g} GB per device with activations, {mode.replace('_', ' ')}: "
                         + _fits_parts(mins) + alone)
    lines.append(f"({out['seconds']:.2f} s)")
    return "\n".join(lines)


_OPTION_LABEL = {"none": "", "hsdp": " HSDP", "hpz": " hpZ"}


def _render_hosts(out: Dict[str, Any]) -> List[str]:
    """The multi-host table: per stage the plain stage, HSDP and hpZ, memory and intra/inter-host traffic."""
    n, k, hosts, psi = out["world_size"], out["ranks_per_host"], out["hosts"], out["psi"]
    worst = ", worst rank" if out["mode"] == "plan" else ""
    plural = lambda count, word: f"{count} {word}" + ("s" if count > 1 else "")  # noqa: E731
    lines = [f"Multiple hosts: N = {n} ranks in {plural(hosts, 'host')} of K = {plural(k, 'rank')}; HSDP: "
             f"shard_group_size={k}, hpZ: hpz_partition_size={k}.",
             "Communication per rank and step, paper counting; a collective is intra-host when its group lies "
             "inside one host, inter-host when its group spans hosts (the ring's view)."]
    if not 1 < k < n:
        lines.append(f"K = {k} {'(one host)' if k == n else '(one rank per host)'}: HSDP and hpZ are off (the "
                     f"engine runs K = 1 or K = N as the plain stage).")
    rows = [[f"stage {s}{_OPTION_LABEL[o]}", _gb(v["model_states"]), _fmt_comm(v["comm_elements"]["intra"]) or "-",
             _fmt_comm(v["comm_elements"]["inter"]) or "-", _gb(v["intra_bytes"]), _gb(v["inter_bytes"]),
             _per_psi(v["intra_elements"], psi), _per_psi(v["inter_elements"], psi)]
            for s, options in out["hierarchical"].items() for o, v in options.items()]
    lines.append(_table(["", f"model states / rank (GB{worst})", "intra-host elements", "inter-host elements",
                         "intra-host GB", "inter-host GB", "intra / Ψ", "inter / Ψ"], rows))
    return lines


def _per_psi(elements: float, psi: float) -> str:
    return f"{elements / psi:.4g}" if psi else "-"


def _fits_parts(mins: Dict[Any, Optional[int]]) -> str:
    return "; ".join(f"stage {s}: " + (f"N >= {m}" if m else f"does not fit (N <= {MAX_WORLD})")
                     for s, m in mins.items())


def _render_activations(act: Dict[str, Any]) -> List[str]:
    rows = [[mode.replace("_", " "), _gb(v["per_layer"]), _gb(v["layers"]), _gb(v["outside"]), _gb(v["stored"]),
             _gb(v["peak"])] for mode, v in ((m, act[m]) for m in ("no_checkpointing", "checkpointing"))]
    long = [f"sequence parallel over {act['sequence_parallel']} ranks" if act.get("sequence_parallel", 1) > 1 else "",
            f"tiled loss {act['tiled_loss_tokens']:,} tokens" if act.get("tiled_loss_tokens") else "",
            f"tiled MLP {act['tiled_mlp_tokens']:,} tokens" if act.get("tiled_mlp_tokens") else ""]
    return [f"Activations per device (any stage, any N): micro-batch {act['batch_size']} x {act['seq_len']} tokens, "
            f"{act['dtype_bytes']}-byte activations, {act['attention']} attention"
            + "".join(f", {part}" for part in long if part),
            _table(["", "one layer GB", "layers keep GB", "outside layers GB", "stored GB", "peak GB"], rows),
            f"Formula: {act['formula']}. The paper's 16-bit formula for these layers alone: "
            f"{_gb(act['paper_layers_16bit'])} GB."]


# ------------------------------------------------------------------------------------------------------- ZeRO++
def run_zeropp(args: argparse.Namespace) -> int:
    """hf-zero estimate --zeropp: the ZeRO++ table (plan.zeropp_formula_report / zeropp_plan_report)."""
    t0 = time.perf_counter()
    given = (("--fits", args.fits is not None), ("--batch-size", args.batch_size is not None),
             ("--seq-len", args.seq_len is not None), ("--stage", args.stage is not None),
             ("--trainable-fraction", args.trainable_fraction != 1)) + tuple(
        (BY_NAME[name].flag, True) for name in _long_sequences(args))
    ignored = [flag for flag, present in given if present]
    if ignored:
        print(f"hf-zero estimate: --zeropp prints its own table (all-trainable stage 3 and stage 2 rows, "
              f"communication only); drop {', '.join(ignored)}", file=sys.stderr)
        return 2
    worlds = ZEROPP_WORLDS if args.num_processes is None else (args.num_processes,)
    k = args.ranks_per_host or ZEROPP_RANKS_PER_HOST
    try:
        for n in worlds:
            check_ranks_per_host(n, k)
        if args.block_size < 1 or args.micro_batches < 1:
            raise ValueError(f"--block-size and --micro-batches must be at least 1, got {args.block_size} and "
                             f"{args.micro_batches}")
    except ValueError as exc:
        default = f" (--zeropp's default K = {ZEROPP_RANKS_PER_HOST})" \
            if args.ranks_per_host is None and "--ranks-per-host" in str(exc) else ""
        print(f"hf-zero estimate: error: {exc}{default}", file=sys.stderr)
        return 2
    bits = dict(weights_bits=args.weights_bits, gradients_bits=args.gradients_bits, block_size=args.block_size,
                micro_batches=args.micro_batches)
    if args.params is not None:
        r = formula_recipe(args.mixed_precision, args.optimizer_k, args.grad_accum_dtype or "compute")
        out = zeropp_formula_report(args.params, worlds, k, r.param, r.grad, **bits)
        out["dtype_bytes"] = {"gather": r.param, "reduce": r.grad}
    else:
        from ...integrations.hf_models import meta_model

        try:
            model = meta_model(args.model)
        except (OSError, ValueError) as exc:
            print(f"hf-zero estimate: error: {exc}. Give --model a local config.json or model folder, or --params N",
                  file=sys.stderr)
            return 2
        config = ZeroConfig(mixed_precision=args.mixed_precision, grad_accum_dtype=args.grad_accum_dtype or "fp32")
        out = zeropp_plan_report(Planner(model, config), worlds, k, **bits)
    out.update(ranks_per_host=k, **bits)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    if args.json:
        print(json.dumps(out, default=float))
    else:
        print(_render_zeropp(out))
    return 0


def _render_zeropp(out: Dict[str, Any]) -> str:
    k, m = out["ranks_per_host"], out["m_bytes"]
    if out["mode"] == "formula":
        d = out["dtype_bytes"]
        how = (f"formula mode: no root unit, no padding; all-gathers {d['gather']} B, reductions {d['reduce']} B "
               f"per element")
    else:
        how = "plan mode: hf_zero's padded flat groups, one collective each, its dtypes (reductions in fp32 " \
              "under bf16 by default)"
    lines = [f"ZeRO++ (Wang et al. 2023, arXiv 2306.10209): bytes per step, Ψ = {out['psi']:.4g} trainable "
             f"parameters, M = 2Ψ = {m / GB:.2f} GB (fp16), qwZ int{out['weights_bits']}, qgZ "
             f"int{out['gradients_bits']}, one fp32 scale per {out['block_size']} elements, "
             f"{out['micro_batches']} micro-batch{'es' if out['micro_batches'] > 1 else ''} per step; {how}."]
    for n, rows in out["worlds"].items():
        hosts = int(n) // k
        lines.append(f"N = {n} ranks in {hosts} host{'s' if hosts > 1 else ''} of K = {k}:")
        table = [[label, f"{row['intra_bytes'] / GB:.3f}", f"{row['inter_bytes'] / GB:.3f}", f"{row['inter_m']:.4f}",
                  f"{row['inter_per_host_m']:.4f}",
                  "-" if row["paper_inter_m"] is None or hosts == 1 else f"{row['paper_inter_m']:g}"]
                 for label, row in rows.items()]
        lines.append(_table(["", "intra-host GB / rank", "inter-host GB / rank", "inter / M", "inter / M per host",
                             "paper (per host)"], table))
    lines += ["Per rank: as the ledger books it (a collective whose group spans hosts is all inter-host).",
              "Per host: the bytes leaving one host, the paper's count: a ring over all N ranks leaves each host",
              "once with the per-rank volume; a group of one rank per host (qgZ's all-to-all across hosts, HSDP's",
              "replica all-reduce) runs K times side by side. Paper: ZeRO-3 3M; ZeRO++ 0.75M = qwZ's forward 0.5M",
              "+ hpZ's backward 0 + qgZ's 0.25M (the excess here is the fp32 scales)."]
    lines.append(f"({out['seconds']:.2f} s)")
    return "\n".join(lines)
