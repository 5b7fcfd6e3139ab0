"""How long one reduce-scatter takes on gloo, per form: what chose the pairwise exchange (collectives/chunked.py).

    python -m benchmarks.gloo_reduce_scatter [--numel 5300000] [--worlds 2 3 4] [--reps 20] [--out docs/FILE.json]

W gloo ranks on CPU (spawned, one thread each, a FileStore: no port) time, on an fp32 tensor of `numel` elements
(the default: the gradient of issue 43's GPT-2 of 4 layers x 256, vocab 8192, 21 MB):

- `all_reduce`: gloo's all-reduce of the whole tensor (DDP's collective);
- `reduce_scatter_tensor`: torch's, which on gloo clones the input and all-reduces it (the flat form's);
- `reduce_per_chunk`: one `dist.reduce` per chunk to its owner (the chunked form's before this change);
- `hf_zero_chunked`: hf_zero's Comm with collectives="chunked" (the pairwise exchange of the chunks);
- `all_gather_into_tensor` and `hf_zero_chunked_all_gather`: the two all-gathers of the shard, for scale.

Each is checked against the sum of the ranks' inputs before it is timed. Reports the median of `reps` timed calls
(3 untimed first), between barriers, in ms, per world size, as JSON. Needs no root.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store: str, numel: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from hf_zero.engine.comm import Comm

    n = numel - numel % world
    base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    everyone = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    expected = sum(everyone).chunk(world)[rank]
    x, shard = base.clone(), torch.empty(n // world)
    comm = Comm(collectives="chunked")

    def per_chunk() -> None:
        for h in [dist.reduce(c, r, async_op=True) for r, c in enumerate(x.chunk(world))]:
            h.wait()

    forms: Dict[str, Callable[[], None]] = {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, x),
        "reduce_per_chunk": per_chunk,
        "hf_zero_chunked": lambda: comm.reduce_scatter(shard, x, "bench").wait(),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(x, shard),
        "hf_zero_chunked_all_gather": lambda: comm.all_gather(x, shard, "bench").wait(),
    }
    times = {}
    for name, run in forms.items():
        if name in ("reduce_scatter_tensor", "hf_zero_chunked", "reduce_per_chunk"):  # exact enough: fp32 sums
            x.copy_(base)
            run()
            got = shard if name != "reduce_per_chunk" else x.chunk(world)[rank]
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
                raise AssertionError(f"{name}: the reduce-scatter is not the sum of the ranks' inputs")
        samples = []
        for i in range(3 + reps):
            x.copy_(base)
            dist.barrier()
            t0 = time.perf_counter()
            run()
            dist.barrier()
            if i >= 3:
                samples.append((time.perf_counter() - t0) * 1e3)
        times[name] = statistics.median(samples)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=5_300_000)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(f"[gloo_reduce_scatter] {args.numel:,} fp32 elements, worlds {args.worlds}, median of {args.reps} calls",
          flush=True)
    result = {"numel": args.numel, "reps": args.reps, "cpus": os.cpu_count(), "torch": torch.__version__,
              "machine": platform.machine(), "loadavg_before": os.getloadavg(), "ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = os.path.join(tmp, f"w{world}.json")
            mp.spawn(_worker, args=(world, os.path.join(tmp, f"store{world}"), args.numel, args.reps, out),
                     nprocs=world)
            with open(out) as f:
                result["ms"][str(world)] = json.load(f)
            row = "  ".join(f"{k} {v:.2f}" for k, v in result["ms"][str(world)].items())
            print(f"W={world}: {row} (ms)", flush=True)
    result["loadavg_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
