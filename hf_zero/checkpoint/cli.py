"""`hf-zero consolidate`, `hf-zero convert` and `hf-zero push`."""
from __future__ import annotations

import argparse
import sys


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", metavar="checkpoint",
                        help="a sharded checkpoint folder (hf_zero.checkpoint.save_checkpoint), or one per host when "
                             "the hosts saved to disks of their own (each rank file is read from the folder that "
                             "holds it); or a DeepSpeed ZeRO or DCP (FSDP2) checkpoint folder")
    parser.add_argument("out_dir", help="where to write the save_pretrained layout: a new or empty folder, or an "
                                        "earlier export (replaced atomically)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file, as save_pretrained's (default 5GB)")
    parser.add_argument("--dtype", default=None, help="cast floating tensors: bf16, fp16, fp32 (default: as trained)")
    parser.add_argument("--config", default=None,
                        help="a folder with config.json (and generation_config.json) or a config JSON file "
                             "(default: the config saved with the checkpoint)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder to include")
    parser.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the rank files")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace out_dir even if it is a file or a folder that is not an earlier export (a model folder) "
                             "(without it such a path is refused and left untouched)")
    _add_trust(parser)


def _add_trust(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust-pickles", action="store_true",
                        help="a DeepSpeed or DCP folder: unpickle its files in full, which runs whatever code they "
                             "hold (default: read them with no code run; a file that needs more is refused, naming "
                             "the class)")


def run_consolidate(args: argparse.Namespace) -> int:
    from .export import export_pretrained
    from .source import CheckpointError

    size = int(args.max_shard_size) if str(args.max_shard_size).isdigit() else args.max_shard_size
    try:
        src = args.checkpoints[0] if len(args.checkpoints) == 1 else args.checkpoints
        out = export_pretrained(src, args.out_dir, model_config=args.config, tokenizer=args.tokenizer,
                                max_shard_size=size, dtype=args.dtype, verify=not args.no_verify,
                                overwrite=args.overwrite, trust=args.trust_pickles)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"hf-zero consolidate: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the checkpoint to convert: a DeepSpeed ZeRO folder (a `latest` file or a "
                                    "global_stepN/ folder, as Accelerate's save_state and the Trainer write it) or a "
                                    "DCP folder (.metadata); with --to dcp, an hf_zero sharded checkpoint")
    parser.add_argument("dst", help="where to write it: a new or empty folder, or an earlier checkpoint of the same "
                                    "kind (replaced atomically)")
    parser.add_argument("--to", choices=["hf_zero", "dcp"], default="hf_zero",
                        help="hf_zero (default): an hf_zero sharded checkpoint that load_state / load_checkpoint "
                             "reshard at any world size and stage; dcp: a torch.distributed.checkpoint folder that "
                             "FSDP2 and Accelerate load")
    parser.add_argument("--layout", choices=["torch", "accelerate"], default="torch",
                        help="--to dcp: torch (default), one DCP folder of {model, optim} as torchtitan writes and "
                             "dcp.load reads; accelerate, Accelerate's FSDP2 save_state folders "
                             "(pytorch_model_fsdp_0/, optimizer_0/) that its load_state reads")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace dst even if it is a file or a folder of something else (--to hf_zero)")
    _add_trust(parser)


def run_convert(args: argparse.Namespace) -> int:
    from .source import CheckpointError

    try:
        if args.to == "dcp":
            from .to_dcp import export_dcp

            out = export_dcp(args.src, args.dst, layout=args.layout)
        else:
            from .convert import convert_checkpoint
            from .source import read_manifest

            out = convert_checkpoint(args.src, args.dst, trust=args.trust_pickles, overwrite=args.overwrite)
            m = read_manifest(out)
            was = m["converted_from"]
            print(f"converted {was['description']} ({was['world_size']} ranks, step {m['step']}): "
                  f"{len(m['groups'])} tensors, {m['model']['num_parameters']:,} parameters with their Adam state "
                  f"-> {out}, an hf_zero checkpoint: load_checkpoint(engine, {str(out)!r}) at any world size and "
                  f"stage, or place it as zero_shards/ of a save_state folder")
            return 0
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"hf-zero convert: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="an exported model folder (hf-zero consolidate)")
    parser.add_argument("repo_id", help="the Hub repository, e.g. user/my-model (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--message", default=None, help="the commit message")
    parser.add_argument("--token", default=None, help="a Hub token (default: HF_TOKEN or the saved login)")


def run_push(args: argparse.Namespace) -> int:
    from .hub import DEFAULT_MESSAGE, push_to_hub
    from .source import CheckpointError

    try:
        info = push_to_hub(args.folder, args.repo_id, token=args.token, private=args.private,
                           commit_message=args.message or DEFAULT_MESSAGE)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"hf-zero push: error: {exc}", file=sys.stderr)
        return 1
    print(f"pushed {args.folder} to {args.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0
