"""How long save_checkpoint blocks the training thread: synchronous vs `async_save=True`.

    python -m benchmarks.async_save [--preset llama270m] [--world 2] [--stage 3] [--rounds 3] [--out docs/async_save.json]

W gloo ranks on CPU (spawned, a FileStore: no port) shard the preset's model at the given stage, train one step
(so AdamW has its state), then per round: a synchronous save to DIR/sync, an asynchronous save of the same state
to DIR/async (the time until the call returns is what the training thread is blocked; the time until its handle's
result() is the background write), and the two folders are compared: every file's SHA-256 in the manifests and,
in the last round, every byte. Both saves fsync (as every save does). Reports the medians over the rounds per rank
and the ratio of the blocked time to the synchronous save's, as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank: int, world: int, store: str, folder: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import read_manifest, save_checkpoint
    from hf_zero.integrations.hf_models import causal_lm_from_config, config_from_dict, quiet
    from hf_zero.tools.presets import preset

    quiet()
    torch.manual_seed(0)
    model = causal_lm_from_config(config_from_dict(preset(args.preset)))
    params = sum(p.numel() for p in model.parameters())
    engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-4), ZeroConfig(stage=args.stage))
    x = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(rank))
    loss = engine.model(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.optimizer.step()
    base = Path(folder)
    rounds: List[Dict[str, float]] = []
    identical = True
    for r in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(engine, base / "sync", step=r)
        sync_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        handle = save_checkpoint(engine, base / "async", step=r, async_save=True)
        blocked_s = time.perf_counter() - t0
        handle.result()
        background_s = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:
            a, b = read_manifest(base / "sync"), read_manifest(base / "async")
            same = a["files"] == b["files"] and a["file_bytes"] == b["file_bytes"]
            if r == args.rounds - 1:  # every byte once (the manifest but for its save_id)
                names = sorted(os.listdir(base / "sync"))
                same = same and names == sorted(os.listdir(base / "async")) and all(
                    filecmp.cmp(base / "sync" / n, base / "async" / n, shallow=False)
                    for n in names if n != "manifest.json")
                a.pop("save_id"), b.pop("save_id")
                same = same and a == b
            identical = identical and same
        rounds.append({"sync_s": sync_s, "async_blocked_s": blocked_s, "async_total_s": background_s})
    shard_bytes = (base / "sync" / f"rank{rank:05d}-of-{world:05d}.safetensors").stat().st_size
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rounds": rounds, "identical": identical, "params": params, "shard_bytes": shard_bytes}, f)
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Any = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama270m")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--out", default=str(ROOT / "docs" / "async_save.json"))
    args = p.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="hfz_async_bench_")
    folder = args.dir or os.path.join(scratch, "ckpt")
    os.makedirs(folder, exist_ok=True)
    try:
        mp.spawn(_worker, args=(args.world, os.path.join(scratch, "store"), folder, args, scratch), nprocs=args.world)
        ranks = [json.load(open(os.path.join(scratch, f"rank{r}.json"))) for r in range(args.world)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)

    def median(key: str) -> float:  # per rank the median over rounds; the slowest rank (the others wait for it)
        return max(statistics.median(x[key] for x in r["rounds"]) for r in ranks)

    result = {
        "what": "wall time save_checkpoint blocks the training thread, synchronous vs async_save=True (fsync on)",
        "preset": args.preset, "parameters": ranks[0]["params"], "stage": args.stage, "world_size": args.world,
        "backend": "gloo, CPU", "rounds": args.rounds, "shard_bytes_per_rank": [r["shard_bytes"] for r in ranks],
        "sync_s": round(median("sync_s"), 3),
        "async_blocked_s": round(median("async_blocked_s"), 3),
        "async_total_s": round(median("async_total_s"), 3),
        "blocked_ratio": round(median("async_blocked_s") / median("sync_s"), 4),
        "byte_identical": all(r["identical"] for r in ranks[:1]),
        "per_rank_rounds": [r["rounds"] for r in ranks],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "command": "python -m benchmarks.async_save " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_rank_rounds"}, indent=1))
    return result


if __name__ == "__main__":
    main()
