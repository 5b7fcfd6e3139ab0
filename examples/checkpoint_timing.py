"""Time a sharded save and a resume (load into a fresh engine) of the bench's largest model, per hf_zero tree.

    python examples/checkpoint_timing.py                       # this tree
    python examples/checkpoint_timing.py --trees . /tmp/old    # side by side: each tree in its own process group

Every tree runs the same thing on W gloo ranks (default 2): a Llama of the `hf-zero bench --load --preset
llama270m` shape, AdamW at the given stage, one optimizer step on a few tokens (so the optimizer states exist),
`save_checkpoint` into a temporary folder, then a fresh engine `load_checkpoint`s it. Prints one table and a JSON
line: seconds for the save and for the load (the slowest rank), and each rank's peak RSS growth during the load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

LLAMA270M = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                 tie_word_embeddings=False)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class _PeakRSS:
    """The largest RSS seen while the block runs (sampled every 5 ms), minus the RSS at its start."""

    def __enter__(self) -> "_PeakRSS":
        self.start = self.peak = _rss_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, _rss_mib())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib())
        self.growth = self.peak - self.start


def _worker(rank: int, world: int, store: str, folder: str, stage: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)

    def engine(seed: int):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA270M))
        return shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-4), ZeroConfig(stage=stage))

    eng = engine(0)
    x = torch.randint(0, LLAMA270M["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(rank))
    eng.backward(eng.model(input_ids=x, labels=x).loss)
    eng.optimizer.step()
    dist.barrier()
    t0 = time.perf_counter()
    save_checkpoint(eng, os.path.join(folder, "ckpt"), step=1)
    save_s = time.perf_counter() - t0
    eng.close()
    del eng
    fresh = engine(1)
    dist.barrier()
    with _PeakRSS() as rss:
        t0 = time.perf_counter()
        load_checkpoint(fresh, os.path.join(folder, "ckpt"))
        load_s = time.perf_counter() - t0
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"save_s": save_s, "load_s": load_s, "load_rss_mib": rss.growth}, f)
    dist.barrier()
    dist.destroy_process_group()


def _run_tree(tree: str, world: int, stage: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hfz_ckpt_timing_") as tmp:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--_rank", "R", "--_world", str(world), "--_dir", tmp,
               "--stage", str(stage)]
        procs = [subprocess.Popen([c if c != "R" else str(r) for c in cmd], env=env) for r in range(world)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"{tree}: ranks exited with {codes}")
        ranks = [json.load(open(os.path.join(tmp, f"r{r}.json"))) for r in range(world)]
    return {"tree": tree, "save_s": max(r["save_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
            "load_rss_mib": [round(r["load_rss_mib"], 1) for r in ranks]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="hf_zero source trees to time, one after the other")
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._rank is not None:
        return _worker(args._rank, args._world, os.path.join(args._dir, "store"), args._dir, args.stage, args._dir)
    rows = [_run_tree(t, args.num_processes, args.stage) for t in args.trees]
    print(f"{'tree':<30} {'save s':>8} {'load s':>8}  load peak RSS growth per rank (MiB)")
    for r in rows:
        print(f"{r['tree']:<30} {r['save_s']:8.2f} {r['load_s']:8.2f}  {r['load_rss_mib']}")
    print(json.dumps({"checkpoint_timing": rows, "stage": args.stage, "world": args.num_processes}))


if __name__ == "__main__":
    main()
