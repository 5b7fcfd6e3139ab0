"""hf-zero: the command line (bench, config, estimate, consolidate, convert, push)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from .tools.bench.cli import moved_flags, moved_message

        moved = moved_flags(argv[1:])  # before argparse: it would stop at the capacity table's own flags
        if moved:
            print(moved_message(moved), file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="hf-zero", description="ZeRO for Hugging Face: tools")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="train a causal LM under DDP, FSDP2, torch's ZeroRedundancyOptimizer, "
                                         "DeepSpeed ZeRO-1/2/3 and hf_zero stages 0-3 side by side")
    from .tools.bench.cli import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    config = sub.add_parser("config", help="write the Accelerate config and hf_zero.yaml (or --show them)")
    from .integrations.config_cli import add_arguments as add_config_arguments

    add_config_arguments(config)
    from .checkpoint import cli as checkpoint_cli

    checkpoint_cli.add_consolidate_arguments(sub.add_parser(
        "consolidate", help="write the save_pretrained layout from a sharded checkpoint (offline, bounded memory)"))
    checkpoint_cli.add_convert_arguments(sub.add_parser(
        "convert", help="turn a DeepSpeed ZeRO or DCP (FSDP2) checkpoint into an hf_zero one, or an hf_zero one into "
                        "DCP (--to dcp); offline, streaming"))
    checkpoint_cli.add_push_arguments(sub.add_parser("push", help="upload an exported folder to the Hugging Face Hub"))
    from .tools.estimate import cli as estimate

    estimate.add_arguments(sub.add_parser("estimate", help="model-state memory and communication per rank, stages 0-3"))
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return estimate.run(args)
    if args.command == "consolidate":
        return checkpoint_cli.run_consolidate(args)
    if args.command == "push":
        return checkpoint_cli.run_push(args)
    if args.command == "convert":
        return checkpoint_cli.run_convert(args)
    if args.command == "bench":
        from .tools.bench.cli import run

        return run(args)
    if args.command == "config":
        from .integrations.config_cli import run as run_config

        return run_config(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
