"""A plain `shard_model` script (no Accelerate, no Trainer) that ends the way user scripts end, for tests/test_exit.py.

    torchrun --standalone --nproc-per-node 2 exit_shard_model.py --stage 1 --frozen --destroy
    python exit_shard_model.py --spawn 2 --stage 3 --checkpointing

Under torchrun the process group comes from the launcher's environment; with `--spawn N` the script starts N ranks
itself with torch.multiprocessing.spawn (a FileStore in a temporary folder, no port). Each rank trains a tiny stack
of blocks for `--steps` steps and ends: `--destroy` calls dist.destroy_process_group() itself (as the torch docs
ask), otherwise the group is left alive for the interpreter's exit. No os._exit: interpreter teardown with gloo's
threads is what the test exercises.

`--hpz K` (stage 3): hpZ's secondary groups of K ranks, which hf_zero makes with dist.new_group.
`--checkpointing`: activation checkpoints partitioned over a model-parallel group (a second process group over
every rank) and kept on the CPU (P_a+cpu). `--api accelerate` (torchrun only): the same model through
HfZeroAccelerator, which makes the process group itself; the script just returns. `--exit-report DIR`: every rank
writes the threads it still runs once every other exit hook has run (`threads_rank<R>.json`; registered first, so
it runs last), and how many of the engine and of the process groups hf_zero made for it are still alive then.
A spawned rank (start method "spawn") returns from its function into multiprocessing's spawn_main, which ends
with sys.exit: the interpreter finalizes as after a plain script, atexit hooks first (hf_zero's, the report).
With `--spawn`, the parent prints one line `EXIT_CODES [c0, c1, ...]` (a negative code is the signal that ended
a rank) and exits 1 if any rank failed.
"""
import argparse
import atexit
import json
import os
import sys
import tempfile
import weakref

import torch
import torch.distributed as dist
from torch import nn

# hf_zero before the process group, as a script imports it: torch.distributed.nn.functional (which torch._dynamo
# imports when the optimizer is built) then binds its `group=group.WORLD` defaults to None instead of the world group,
# which they would otherwise hold into finalization (upstream's bug; hf_zero/engine/exit.py, docs/engine.md)
import hf_zero  # noqa: F401


class Block(nn.Module):
    """Follows Transformers' convention: with `gradient_checkpointing` set it runs through
    `_gradient_checkpointing_func`, which enable_activation_checkpointing installs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.gradient_checkpointing = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(self._forward, x)
        return self._forward(x)


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# weak references to what the script drops when train() returns: the engine and the process groups hf_zero made
# for it (its Comms'); the exit report says which are still alive once every other exit hook has run
WATCHED: dict = {"engine": [], "groups": []}


def watch(engine) -> None:
    WATCHED["engine"].append(weakref.ref(engine))
    WATCHED["groups"] += [weakref.ref(c.group) for c in engine.topology.comms() if c.group is not None]


def report_threads_at_exit(out_dir: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))

    def report() -> None:
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended meanwhile
                pass
        # no gc.collect() here: what a collection would still free is what finalization would free, with gloo's
        # threads running
        alive = {what: sum(ref() is not None for ref in refs) for what, refs in WATCHED.items()}
        with open(os.path.join(out_dir, f"threads_rank{rank}.json"), "w") as f:
            json.dump({"threads": sorted(names), "alive": alive,
                       "watched": {what: len(refs) for what, refs in WATCHED.items()}}, f)

    atexit.register(report)


def train_accelerate(args: argparse.Namespace) -> None:
    from hf_zero import HfZeroAccelerator, ZeroPlugin

    accelerator = HfZeroAccelerator(zero_plugin=ZeroPlugin(stage=args.stage, reduce_bucket_size=1024))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1 + accelerator.process_index)
    for _ in range(args.steps):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"EXIT_SCRIPT rank={accelerator.process_index} trained loss={loss.item():.4f}", flush=True)


def train(args: argparse.Namespace) -> None:
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.engine import enable_activation_checkpointing

    torch.manual_seed(0)
    model = Net()
    if args.frozen:
        model.embed.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if args.checkpointing:
        mp_group = dist.new_group(list(range(dist.get_world_size())))
        enable_activation_checkpointing(model, "partitioned", cpu=True, model_parallel_group=mp_group)
    engine = shard_model(model, optimizer, ZeroConfig(stage=args.stage, reduce_bucket_size=1024,
                                                      hpz_partition_size=args.hpz))
    watch(engine)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        engine.backward(loss)
        engine.optimizer.step()
    print(f"EXIT_SCRIPT rank={dist.get_rank()} trained loss={loss.item():.4f}", flush=True)
    if args.destroy:
        dist.destroy_process_group()


def spawned(rank: int, world: int, store_dir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if args.exit_report:
        report_threads_at_exit(args.exit_report)
    train(args)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--api", choices=["engine", "accelerate"], default="engine")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--frozen", action="store_true", help="freeze the first layer (a frozen flat group)")
    p.add_argument("--checkpointing", action="store_true", help="partitioned activation checkpoints on the CPU")
    p.add_argument("--hpz", type=int, default=None, help="stage 3: hpZ's secondary groups of this many ranks")
    p.add_argument("--destroy", action="store_true", help="call dist.destroy_process_group() at the end")
    p.add_argument("--spawn", type=int, default=0, help="start this many ranks with torch.multiprocessing.spawn")
    p.add_argument("--exit-report", default=None, help="folder for threads_rank<R>.json")
    args = p.parse_args()
    if args.spawn:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="hfz_exit_") as store_dir:
            ctx = mp.start_processes(spawned, args=(args.spawn, store_dir, args), nprocs=args.spawn, join=False,
                                     start_method="spawn")
            for proc in ctx.processes:
                proc.join()
            codes = [proc.exitcode for proc in ctx.processes]
        print(f"EXIT_CODES {json.dumps(codes)}", flush=True)
        sys.exit(0 if all(c == 0 for c in codes) else 1)
    torch.set_num_threads(1)
    if args.exit_report:  # before anything else registers an exit hook, so that it runs last
        report_threads_at_exit(args.exit_report)
    if args.api == "accelerate":
        return train_accelerate(args)
    dist.init_process_group("gloo")
    train(args)


if __name__ == "__main__":
    main()
