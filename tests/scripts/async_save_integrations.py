"""Asynchronous saves through HfZeroAccelerator.save_state and ZeroTrainer (tests/test_async_save.py), one rank.

    torchrun --standalone --nproc_per_node 2 async_save_integrations.py --mode accelerate --out DIR
    torchrun --standalone --nproc_per_node 2 async_save_integrations.py --mode trainer --out DIR [--async-save]

Every partition file hf_zero writes goes through safetensors.torch.save_file (called by that name so that tests can
replace it): here a write on a background thread is held at a gate the training thread opens after it trained on,
and a write on the training thread (an ignored async_save) is counted. The folder of a held save cannot be complete
before its gate opens, so "not there yet" is what the save being in flight looks like, whatever the timing.

accelerate: a tiny GPT-2 at stage 3, one step; save_state(DIR/sync) and save_state(DIR/async, async_save=True) of
the same state; its shards held until one more step is done; wait_for_save(); load_state(DIR/async) must give back
the weights of the save (rank 0 writes DIR/result.json).

trainer: ZeroTrainer at stage 2, 4 steps, a checkpoint every step, save_total_limit=1, ZeroPlugin(async_save=...);
checkpoint-N's shards are held until step N + 1 has ended (N < 4: the last one has no next step), where a callback
looks at whether checkpoint-N/zero_shards is there yet. Rank 0 writes the checkpoint folders left in DIR, what the
callback saw and the writes on the training thread to DIR/result.json.
"""
import argparse
import contextlib
import json
import os
import re
import sys
import threading

import safetensors.torch as st
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

GATE_TIMEOUT_S = 300  # a gate nobody opens fails the save (and the run) instead of hanging it
on_training_thread = []  # partition files the training thread wrote (a synchronous save's, or an ignored async one's)
gates = {}  # folder key -> the Event its background write waits for
_real_save_file = st.save_file


def _gated_save_file(key_of):
    """safetensors.torch.save_file, held on a background thread until the gate of `key_of(path)` is set (a path
    whose key is None is not held)."""
    def save_file(tensors, path, *a, **kw):
        if threading.current_thread() is threading.main_thread():
            on_training_thread.append(str(path))
        else:
            key = key_of(str(path))
            if key is not None and not gates.setdefault(key, threading.Event()).wait(GATE_TIMEOUT_S):
                raise RuntimeError(f"the gate of {path} was never opened")
        return _real_save_file(tensors, path, *a, **kw)
    return save_file


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
    held = os.path.join(args.out, "async", "zero_shards")  # its files are written in DIR/async/zero_shards.tmp-ID
    st.save_file = _gated_save_file(lambda path: "async" if path.startswith(held) else None)
    acc.save_state(os.path.join(args.out, "sync"))
    acc.save_state(os.path.join(args.out, "async"), async_save=True)
    in_flight = not os.path.isdir(held)  # its write waits for the gate below
    step(1)  # training goes on while the save is held
    gates.setdefault("async", threading.Event()).set()
    acc.wait_for_save()
    st.save_file = _real_save_file
    changed = acc.zero_engine.full_state_dict()
    acc.load_state(os.path.join(args.out, "async"))
    loaded = acc.zero_engine.full_state_dict()
    if acc.is_main_process:
        same = lambda a, b: set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"changed": not same(before, changed), "loaded_is_before": same(loaded, before),
                       "in_flight": in_flight, "on_training_thread": [p for p in on_training_thread
                                                                      if p.startswith(held)]}, f)


def trainer() -> None:
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    max_steps, seen = 4, {}

    def checkpoint_of(path: str):
        found = re.search(r"checkpoint-(\d+)[/\\]zero_shards\.tmp-", path)
        step = int(found.group(1)) if found else None
        return step if step is not None and step < max_steps else None  # the last one has no next step

    class LookThenOpen(TrainerCallback):
        """At the end of step N + 1: is checkpoint-N's zero_shards there yet? Then let its write go on."""

        def on_step_end(self, targs, state, control, **kwargs):
            previous = state.global_step - 1
            if 1 <= previous < max_steps:
                seen[previous] = os.path.isdir(os.path.join(args.out, f"checkpoint-{previous}", "zero_shards"))
                gates.setdefault(previous, threading.Event()).set()

    st.save_file = _gated_save_file(checkpoint_of)

    model = models.make_model("gpt2")
    ids = torch.randint(0, models.VOCAB, (64, models.SEQ_LEN), generator=torch.Generator().manual_seed(1))
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    targs = TrainingArguments(
        output_dir=args.out, max_steps=max_steps, per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1,
        save_steps=1, save_total_limit=1, report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True,
        disable_tqdm=True)
    t = ZeroTrainer(model=model, args=targs, train_dataset=ds,
                    zero_plugin=ZeroPlugin(stage=2, async_save=args.async_save), callbacks=[LookThenOpen()])
    t.train()
    st.save_file = _real_save_file
    if t.args.process_index == 0:
        left = sorted(os.listdir(args.out))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"left": left, "there_at_next_step": seen, "on_training_thread": on_training_thread}, f)


with contextlib.suppress(FileExistsError):
    os.makedirs(args.out)
accelerate() if args.mode == "accelerate" else trainer()
