"""One rank of a W-rank run that saves a checkpoint twice and is killed during the second save.

    python crash_save.py --rank R --world W --store FILE --dir DIR --pause {between-renames,before-rename,writing}

Trains a tiny GPT-2 at stage 2 for one step, saves DIR/ckpt (step 1) and writes rank 0's full weights at that
point to DIR/first.safetensors, trains one more step and saves DIR/ckpt again (step 2). During that second save the
lowest rank (the disk's leader, which does the renames) reaches the state named by --pause, creates DIR/paused and
blocks there until the test kills it by its pid:

- between-renames: the previous DIR/ckpt was moved aside to ckpt.old-ID, the new folder not yet renamed in;
- before-rename: the new folder DIR/ckpt.tmp-ID is complete, nothing renamed yet;
- writing: the partition file is being written (after safetensors wrote it, before the ranks agree).
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
p.add_argument("--pause", choices=["between-renames", "before-rename", "writing"], required=True)
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(args.store, args.world), rank=args.rank,
                        world_size=args.world, timeout=datetime.timedelta(seconds=60))

from safetensors.torch import save_file  # noqa: E402

from hf_zero import ZeroConfig, shard_model  # noqa: E402
from hf_zero.checkpoint import save_checkpoint  # noqa: E402

ckpt = os.path.join(args.dir, "ckpt")
model = models.make_model("gpt2")
engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=2))
batches = models.make_batches(2, 2)


def train(step: int) -> None:
    for j, mb in enumerate(batches[step]):
        with engine.no_sync() if j == 0 else contextlib.nullcontext():
            out = engine.model(input_ids=models.rank_slice(mb, args.rank, args.world))
            logits = out.logits[:, :-1]
            x = models.rank_slice(mb, args.rank, args.world)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            engine.backward(loss / 2)
    engine.optimizer.step()


train(0)
save_checkpoint(engine, ckpt, step=1)
first = engine.full_state_dict()
if args.rank == 0:
    save_file({k: v.clone().contiguous() for k, v in first.items()}, os.path.join(args.dir, "first.safetensors"))
train(1)


def pause() -> None:
    """Tell the test where we are, then block until it kills this process."""
    with open(os.path.join(args.dir, "paused"), "w") as f:
        f.write(str(os.getpid()))
    threading.Event().wait()


if args.rank == 0:
    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        src_name, dst_name = os.path.basename(str(src)), os.path.basename(str(dst))
        if args.pause == "before-rename" and (".old-" in dst_name or (".tmp-" in src_name and dst_name == "ckpt")):
            pause()  # the first rename of the publishing step, not done
        real_replace(src, dst, *a, **kw)
        if args.pause == "between-renames" and ".old-" in dst_name:
            pause()

    os.replace = replace
    if args.pause == "writing":
        import safetensors.torch as st

        real_save = st.save_file

        def save_and_pause(tensors, path, *a, **kw):
            real_save(tensors, path, *a, **kw)
            if ".tmp-" in os.path.basename(os.path.dirname(str(path))):
                pause()

        st.save_file = save_and_pause

save_checkpoint(engine, ckpt, step=2)
print("the second save finished: the test expected a kill", file=sys.stderr)
sys.exit(3)
