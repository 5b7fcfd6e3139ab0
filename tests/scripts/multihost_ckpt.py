"""A user's training script that checkpoints on node-local disks: a tiny GPT-2 at ZeRO stage 3 (by default), 4
optimizer steps of 2 micro-batches, clipping at 1.0, fp32 AdamW, cosine schedule. Launched on one or two hosts.

    accelerate launch ... multihost_ckpt.py --api accelerate --out DIR --save-at 2        # the uninterrupted run
    accelerate launch ... multihost_ckpt.py --api accelerate --out DIR2 --resume DIR/state  # resume from it

`--api accelerate`: an HfZeroAccelerator with `ProjectConfiguration(save_on_each_node=True)` (what docs/checkpoints.md asks
for on disks the hosts do not share). After `--save-at N` steps: `save_state(OUT/state)`, `steps.json` in it from
every host's local main process, `export_pretrained(engine, OUT/export-stepN)` and (main process)
`OUT/weights-stepN.safetensors` (get_state_dict). `--resume DIR`:
`load_state(DIR)` then skip the steps `DIR/steps.json` says were done. At the end: `accelerator.save_model(model,
OUT/saved)` (+ the config from the main process), `export_pretrained(engine, OUT/export)`, and from the main process
`OUT/weights.safetensors` (get_state_dict) and `OUT/log.json` (per micro-batch losses, grad norms, the last lr,
each rank's hostname).

`--api trainer`: a ZeroTrainer with `TrainingArguments(save_on_each_node=True, save_steps=--save-at)` under
OUT/trainer (`--save-at 0`: no checkpoints); `--resume CHECKPOINT` passes it to `train(resume_from_checkpoint=...)`.
The main process writes OUT/weights.safetensors and OUT/log.json (losses and grad norms of the log history).

A failing load prints `MULTIHOST_CKPT error rank=R host=H after S s: <error>` on stderr on every rank, then
raises, so the launcher reports the failure as a user's would.
"""
import argparse
import json
import os
import socket
import sys
import time

import hf_zero  # noqa: F401  (first, so that any Accelerate state a Trainer creates is a gloo world on CPU)
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, get_cosine_schedule_with_warmup

STEPS, GRAD_ACCUM, MICRO_BATCH, SEQ = 4, 2, 2, 16


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(cfg)


def report_failure(what, t0, exc):
    print(f"MULTIHOST_CKPT error rank={dist.get_rank()} host={socket.gethostname()} after "
          f"{time.monotonic() - t0:.1f} s in {what}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def where():
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"rank": dist.get_rank(), "hostname": socket.gethostname(),
                                 "local_rank": int(os.environ.get("LOCAL_RANK", "0"))})
    return out


def write_results(out, state, record):
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in state.items()}, os.path.join(out, "weights.safetensors"))
    with open(os.path.join(out, "log.json"), "w") as f:
        json.dump(record, f, indent=1)


def run_accelerate(args):
    from accelerate.utils import ProjectConfiguration
    from hf_zero import HfZeroAccelerator, ZeroPlugin
    from hf_zero.checkpoint import export_pretrained
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = HfZeroAccelerator(gradient_accumulation_steps=GRAD_ACCUM, zero_plugin=ZeroPlugin(stage=args.stage),
                                    project_config=ProjectConfiguration(save_on_each_node=True))
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
    done = 0
    if args.resume:
        t0 = time.monotonic()
        try:
            accelerator.load_state(args.resume)
        except Exception as exc:
            report_failure("load_state", t0, exc)
            raise
        with open(os.path.join(args.resume, "steps.json")) as f:  # on every host: its local main process wrote it
            done = json.load(f)["steps"]
        loader = accelerator.skip_first_batches(loader, done * GRAD_ACCUM)
    losses, norms = [], []
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
            done += 1
            if done == args.save_at:
                state_dir = accelerator.save_state(os.path.join(args.out, "state"))
                if accelerator.is_local_main_process:
                    with open(os.path.join(state_dir, "steps.json"), "w") as f:
                        json.dump({"steps": done}, f)
                export_pretrained(engine, os.path.join(args.out, f"export-step{done}"), progress=False)
                at_save = accelerator.get_state_dict(model)
                if accelerator.is_main_process:
                    save_file({k: v.contiguous().clone() for k, v in at_save.items()},
                              os.path.join(args.out, f"weights-step{done}.safetensors"))
    saved = os.path.join(args.out, "saved")
    accelerator.save_model(model, saved)  # consolidated, gathered from the shards
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(saved)
    export_pretrained(engine, os.path.join(args.out, "export"), progress=False)
    state = accelerator.get_state_dict(model)
    ranks = where()
    if accelerator.is_main_process:
        write_results(args.out, state, {"losses": losses, "norms": norms, "steps": done, "lr": scheduler.get_last_lr(),
                                        "world_size": accelerator.num_processes, "ranks": ranks})
    accelerator.wait_for_everyone()
    accelerator.print("MULTIHOST_CKPT finished")
    accelerator.end_training()


def run_trainer(args):
    from datasets import Dataset
    from hf_zero import ZeroPlugin, ZeroTrainer
    from transformers import TrainingArguments

    model = tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (64, SEQ), generator=g)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"), max_steps=STEPS, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GRAD_ACCUM, max_grad_norm=1.0, learning_rate=3e-3, adam_epsilon=1e-6,
        weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
        save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or STEPS, save_on_each_node=True,
        report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True, disable_tqdm=True,
    )
    trainer = ZeroTrainer(model=model, args=targs, train_dataset=ds, zero_plugin=ZeroPlugin(stage=args.stage))
    t0 = time.monotonic()
    try:
        trainer.train(resume_from_checkpoint=args.resume)
    except Exception as exc:
        report_failure("train", t0, exc)
        raise
    state = trainer.accelerator.get_state_dict(trainer.model)
    ranks = where()
    history = trainer.state.log_history
    if dist.get_rank() == 0:
        write_results(args.out, state, {"losses": [h["loss"] for h in history if "loss" in h],
                                        "norms": [h["grad_norm"] for h in history if "grad_norm" in h],
                                        "steps": trainer.state.global_step, "world_size": trainer.args.world_size,
                                        "ranks": ranks})
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.print("MULTIHOST_CKPT finished")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--api", choices=["accelerate", "trainer"], default="accelerate")
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--save-at", type=int, default=0, help="checkpoint after this many optimizer steps")
    p.add_argument("--resume", default=None, help="a save_state folder (accelerate) or Trainer checkpoint")
    args = p.parse_args()
    (run_accelerate if args.api == "accelerate" else run_trainer)(args)
    # As tests/scripts/accel_train.py: close the process group, then leave without the interpreter's teardown (gloo's
    # threads abort it now and then; the exit itself is tests/test_multihost.py's subject, not this script's).
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
