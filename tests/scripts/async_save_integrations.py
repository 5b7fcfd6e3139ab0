"""Asynchronous saves through HfZeroAccelerator.save_state and ZeroTrainer (tests/test_async_save.py), one rank.

    torchrun --standalone --nproc_per_node 2 async_save_integrations.py --mode accelerate --out DIR
    torchrun --standalone --nproc_per_node 2 async_save_integrations.py --mode trainer --out DIR [--async-save]

accelerate: a tiny GPT-2 at stage 3, one step; save_state(DIR/sync) and save_state(DIR/async, async_save=True) of
the same state; one more step while the second is in flight; wait_for_save(); load_state(DIR/async) must give back
the weights of the save (rank 0 writes DIR/result.json).

trainer: ZeroTrainer at stage 2, 4 steps, a checkpoint every step, save_total_limit=1, ZeroPlugin(async_save=...);
rank 0 writes the checkpoint folders left in DIR to DIR/result.json.
"""
import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import models  # noqa: E402  (tests/models.py)

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["accelerate", "trainer"], required=True)
p.add_argument("--out", required=True)
p.add_argument("--async-save", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)

from hf_zero import HfZeroAccelerator, ZeroPlugin, ZeroTrainer  # noqa: E402


def accelerate() -> None:
    acc = HfZeroAccelerator(zero_plugin=ZeroPlugin(stage=3), gradient_accumulation_steps=1)
    model = models.make_model("gpt2")
    model, opt = acc.prepare(model, models.make_optimizer(model))
    rank, world = acc.process_index, acc.num_processes

    def step(i: int) -> None:
        x = models.rank_slice(models.make_batches(i + 1, 1)[i][0], rank, world)
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()

    step(0)
    before = acc.zero_engine.full_state_dict()
    acc.save_state(os.path.join(args.out, "sync"))
    acc.save_state(os.path.join(args.out, "async"), async_save=True)
    in_flight = not os.path.isdir(os.path.join(args.out, "async", "zero_shards"))
    step(1)
    acc.wait_for_save()
    changed = acc.zero_engine.full_state_dict()
    acc.load_state(os.path.join(args.out, "async"))
    loaded = acc.zero_engine.full_state_dict()
    if acc.is_main_process:
        same = lambda a, b: set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"changed": not same(before, changed), "loaded_is_before": same(loaded, before),
                       "in_flight": in_flight}, f)


def trainer() -> None:
    from datasets import Dataset
    from transformers import TrainingArguments

    model = models.make_model("gpt2")
    ids = torch.randint(0, models.VOCAB, (64, models.SEQ_LEN), generator=torch.Generator().manual_seed(1))
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    targs = TrainingArguments(
        output_dir=args.out, max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1,
        save_steps=1, save_total_limit=1, report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True,
        disable_tqdm=True)
    t = ZeroTrainer(model=model, args=targs, train_dataset=ds,
                    zero_plugin=ZeroPlugin(stage=2, async_save=args.async_save))
    t.train()
    if t.args.process_index == 0:
        left = sorted(os.listdir(args.out))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"left": left}, f)


with contextlib.suppress(FileExistsError):
    os.makedirs(args.out)
accelerate() if args.mode == "accelerate" else trainer()
