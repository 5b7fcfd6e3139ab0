"""One rank of a W-rank run killed while a background checkpoint save is in flight (tests/test_async_save.py).

    python async_save_kill.py --rank R --world W --store FILE --dir DIR

Trains a tiny GPT-2 at stage 1 for one step, saves DIR/ckpt (step 1) and writes rank 0's full weights at that
point to DIR/first.safetensors, trains one more step and starts an asynchronous save of DIR/ckpt (step 2); the
training thread trains on (then creates DIR/trained.R and prints "trained on") and waits for the save. Rank 0's
background write puts its partition file into DIR/ckpt.tmp-ID, creates DIR/paused with its pid and blocks there
until the test kills it.
"""
import argparse
import contextlib
import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import models  # noqa: E402  (tests/models.py)

p = argparse.ArgumentParser()
p.add_argument("--rank", type=int, required=True)
p.add_argument("--world", type=int, required=True)
p.add_argument("--store", required=True)
p.add_argument("--dir", required=True)
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(args.store, args.world), rank=args.rank,
                        world_size=args.world, timeout=datetime.timedelta(seconds=60))

import safetensors.torch as st  # noqa: E402

from hf_zero import ZeroConfig, shard_model  # noqa: E402
from hf_zero.checkpoint import save_checkpoint  # noqa: E402

ckpt = os.path.join(args.dir, "ckpt")
model = models.make_model("gpt2")
engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=1))
batches = models.make_batches(3, 2)


def train(step: int) -> None:
    for j, mb in enumerate(batches[step]):
        with engine.no_sync() if j == 0 else contextlib.nullcontext():
            x = models.rank_slice(mb, args.rank, args.world)
            logits = engine.model(input_ids=x).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            engine.backward(loss / 2)
    engine.optimizer.step()


train(0)
save_checkpoint(engine, ckpt, step=1)
first = engine.full_state_dict()
if args.rank == 0:
    st.save_file({k: v.clone().contiguous() for k, v in first.items()}, os.path.join(args.dir, "first.safetensors"))
train(1)

if args.rank == 0:
    real_save = st.save_file

    def save_and_pause(tensors, path, *a, **kw):
        real_save(tensors, path, *a, **kw)
        if ".tmp-" in os.path.basename(os.path.dirname(str(path))):
            with open(os.path.join(args.dir, "paused"), "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait()  # until the test kills this process

    st.save_file = save_and_pause

handle = save_checkpoint(engine, ckpt, step=2, async_save=True)
train(2)
with open(os.path.join(args.dir, f"trained.{args.rank}"), "w"):  # the save is in flight and training went on
    pass
print("trained on", flush=True)
handle.result()
print("the background save finished: the test expected a kill", file=sys.stderr)
sys.exit(3)
