"""A user's training script, launched on one or several hosts: trains a tiny GPT-2 once per ZeRO configuration.

    accelerate launch ... multihost_train.py --api accelerate --configs '[{"stage":1},{"stage":3}]' --out DIR

Each configuration (a dict of `ZeroPlugin` keyword arguments, passed through as is) trains the same model from the
same seed on the same data, one after another in this one launch: 3 optimizer steps, gradient accumulation 2,
clipping at 1.0, fp32 AdamW. `--api accelerate` builds one HfZeroAccelerator per configuration (Accelerate's state
is a process-wide singleton that every Accelerator shares; `free_memory()` releases the previous one's engine);
`--api trainer` builds one ZeroTrainer per configuration on a tiny `datasets.Dataset`.

Global rank 0 writes, under --out, `results.json` (one entry per configuration: config, losses, grad norms, world
size, and per rank its hostname and the engine's comm_stats() of the last optimizer step) and the final full
weights of configuration i as `weights_<i>.safetensors`. With --exit-report every rank also writes, into --out on
its own host, the threads it still runs once every exit hook has run (`exit_threads_rank<R>.json`).

The script ends as a user's script ends (no os._exit): `accelerator.end_training()` and falling off the end, or with
`--ending return` just falling off the end (the process group is then closed by HfZeroAccelerator's exit hook), so
interpreter teardown with the process group is part of what a launch exercises.
"""
import argparse
import atexit
import json
import os
import socket

import hf_zero  # noqa: F401  (first, so that any Accelerate state a Trainer creates is a gloo world on CPU)
import torch
import torch.distributed as dist
from hf_zero import HfZeroAccelerator, ZeroPlugin
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GPT2Config, get_cosine_schedule_with_warmup

STEPS, GRAD_ACCUM, MICRO_BATCH, SEQ = 3, 2, 2, 16


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(cfg)


def sub(a, b):
    return {k: {f: n - b.get(k, {}).get(f, 0) for f, n in v.items()} for k, v in a.items()}


def gather_to_rank0(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def train_accelerate(config):
    accelerator = HfZeroAccelerator(gradient_accumulation_steps=GRAD_ACCUM, zero_plugin=ZeroPlugin(**config))
    model = tiny_gpt2()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, eps=1e-6)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1, STEPS)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 101, (STEPS * GRAD_ACCUM * MICRO_BATCH * accelerator.num_processes, SEQ), generator=g)
    loader = DataLoader(TensorDataset(data), batch_size=MICRO_BATCH, shuffle=False)  # split by rank by prepare
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    engine = accelerator.zero_engine
    losses, norms = [], []
    before = after = engine.comm_stats()
    model.train()
    for (x,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            losses.append(accelerator.gather(loss.detach()).mean().item())
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            before, after = after, engine.comm_stats()
    last_step_comm = sub(after, before)
    state = accelerator.get_state_dict(model)
    record = dict(losses=losses, norms=norms, world_size=accelerator.num_processes)
    accelerator.free_memory()  # the next configuration's accelerator shards a fresh model
    return accelerator, record, last_step_comm, state


def train_trainer(config, out_dir):
    from datasets import Dataset
    from hf_zero import ZeroTrainer
    from transformers import TrainerCallback, TrainingArguments

    model = tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (64, SEQ), generator=g)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    targs = TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GRAD_ACCUM, max_grad_norm=1.0, learning_rate=3e-3, adam_epsilon=1e-6,
        weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True, disable_tqdm=True,
    )
    snapshots = []

    class CommPerStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(trainer.zero_engine.comm_stats())

    trainer = ZeroTrainer(model=model, args=targs, train_dataset=ds, zero_plugin=ZeroPlugin(**config),
                          callbacks=[CommPerStep()])
    trainer.train()  # prepare (sharding) happens in here; the engine's ledger starts at zero after it
    snapshots.insert(0, {})
    last_step_comm = sub(snapshots[-1], snapshots[-2])
    state = trainer.accelerator.get_state_dict(trainer.model)
    history = trainer.state.log_history
    record = dict(losses=[h["loss"] for h in history if "loss" in h],
                  norms=[h["grad_norm"] for h in history if "grad_norm" in h],
                  world_size=trainer.args.world_size)
    trainer.accelerator.free_memory()
    return trainer.accelerator, record, last_step_comm, state


def report_threads_at_exit(out_dir):
    """Registered before any Accelerator, so it runs after every other exit hook (atexit is last in, first out),
    just before the interpreter finalizes: write which threads this rank still runs then (Linux)."""
    rank = os.environ.get("RANK", "0")

    def report():
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:  # the thread ended meanwhile
                pass
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"exit_threads_rank{rank}.json"), "w") as f:
            json.dump(sorted(names), f)

    if os.path.isdir("/proc/self/task"):
        atexit.register(report)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--api", choices=["accelerate", "trainer"], default="accelerate")
    p.add_argument("--configs", default='[{"stage": 3}]', help="JSON list of ZeroPlugin keyword-argument dicts")
    p.add_argument("--out", required=True)
    p.add_argument("--ending", choices=["end_training", "return"], default="end_training",
                   help="end with accelerator.end_training() (destroys the process group), or just return and leave "
                        "the group to HfZeroAccelerator's exit hook, as a Trainer script does")
    p.add_argument("--exit-report", action="store_true",
                   help="write, per rank, the threads still running after the exit hooks (exit_threads_rank<R>.json)")
    args = p.parse_args()
    if args.exit_report:
        report_threads_at_exit(args.out)
    configs = json.loads(args.configs)
    results, accelerator = [], None
    for i, config in enumerate(configs):
        if args.api == "accelerate":
            accelerator, record, comm, state = train_accelerate(config)
        else:
            accelerator, record, comm, state = train_trainer(config, os.path.join(args.out, f"trainer_{i}"))
        per_rank = gather_to_rank0({"rank": dist.get_rank(), "hostname": socket.gethostname(),
                                    "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "comm_last_step": comm})
        if dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            name = f"weights_{i}.safetensors"
            save_file({k: v.contiguous().clone() for k, v in state.items()}, os.path.join(args.out, name))
            results.append(dict(config=config, api=args.api, weights=name, ranks=per_rank, **record))
            with open(os.path.join(args.out, "results.json.tmp"), "w") as f:
                json.dump(results, f, indent=1)
            os.replace(os.path.join(args.out, "results.json.tmp"), os.path.join(args.out, "results.json"))
        accelerator.print(f"MULTIHOST_TRAIN config {i} {json.dumps(config)} done: losses {record['losses']}")
    accelerator.wait_for_everyone()
    accelerator.print("MULTIHOST_TRAIN finished")
    if args.ending == "end_training":
        accelerator.end_training()


if __name__ == "__main__":
    main()
