"""CPU: tokens/s and memory per rank of a long-sequence step with sp = 2 against sp = 1 (issue #44, item 8).

Runs examples/long_context.py under `accelerate launch` (2 gloo ranks) for each variant, alternating variants over
`--repeats` rounds so that a machine's slow spell hits all of them, and writes one JSON with every rank's figures:

    python -m benchmarks.long_context_cpu --seq-len 8192 --repeats 2 --json docs/long_context_cpu.json

Variants (all ZeRO stage 3, activation checkpointing on, one sequence per replica per step):
- sp1: each rank trains its own sequence (2 replicas);
- sp2: the two ranks share one sequence (1 replica, each rank S/2 tokens);
- sp2_tiled: sp2 with the tiled loss and MLP.
tokens/s counts every rank's tokens (the replicas' sequences), so sp1 moves twice the tokens per step. Peak RSS is
per rank, with glibc's big buffers mmap'd (MALLOC_MMAP_THRESHOLD_=1 MiB) so that freed memory leaves the count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "long_context.py")


def variants(seq_len: int) -> Dict[str, List[str]]:
    tile = str(max(1, seq_len // 8))
    return {"sp1": ["--sequence_parallel_size", "1"],
            "sp2": ["--sequence_parallel_size", "2"],
            "sp2_tiled": ["--sequence_parallel_size", "2", "--tiled_loss_tokens", tile, "--tiled_mlp_tokens", tile]}


def run_one(name: str, extra: List[str], args: argparse.Namespace, out: str) -> List[dict]:
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS=str(args.threads),
               MALLOC_MMAP_THRESHOLD_=str(1 << 20), PYTHONPATH=path)
    prefix = os.path.join(out, name)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", EXAMPLE,
           "--seq_len", str(args.seq_len), "--steps", str(args.steps), "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--vocab", str(args.vocab), "--json", prefix] + extra
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return [json.load(open(f"{prefix}.rank{r}.json")) for r in range(2)]


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    runs: Dict[str, List[List[dict]]] = {name: [] for name in variants(args.seq_len)}
    print(f"long-context CPU bench: {args.seq_len} tokens, {len(runs)} variants x {args.repeats} rounds, 2 ranks",
          flush=True)
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(args.repeats):
            for name, extra in variants(args.seq_len).items():
                start = time.time()
                ranks = run_one(f"{name}_{round_}", extra, args, out)
                runs[name].append(ranks)
                print(f"round {round_ + 1} {name}: {ranks[0]['tokens_per_s']:,.0f} tokens/s, peak RSS "
                      f"{max(r['peak_rss_bytes'] for r in ranks) / 2**30:.2f} GiB ({time.time() - start:.0f} s)",
                      flush=True)
    summary = {name: {"tokens_per_s": [r[0]["tokens_per_s"] for r in rs],
                      "peak_rss_gib_per_rank": [[x["peak_rss_bytes"] / 2**30 for x in r] for r in rs]}
               for name, rs in runs.items()}
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "summary": summary, "runs": runs}, f, indent=1)
    for name, s in summary.items():
        print(f"{name:10s} tokens/s {', '.join(f'{t:,.0f}' for t in s['tokens_per_s'])}; peak RSS per rank (GiB) "
              f"{s['peak_rss_gib_per_rank']}")


if __name__ == "__main__":
    main()
