"""A plain Accelerate training script; run with stock Accelerate (--backend ddp) or hf_zero (--backend zero).

The hf_zero run differs from the stock one by the import alone; the test compares their losses and weights.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, get_cosine_schedule_with_warmup

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=["ddp", "zero"], required=True)
p.add_argument("--model", default="gpt2")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--grad-accum", type=int, default=2)
p.add_argument("--out", required=True)
p.add_argument("--save-at", type=int, default=0, help="save_state after this many optimizer steps")
p.add_argument("--resume", default=None, help="load_state from this folder and skip the steps it covers")
p.add_argument("--push", default=None, help="accelerator.push_to_hub(model, REPO) at the end (hf_zero only)")
args = p.parse_args()

if args.backend == "zero":
    from hf_zero import HfZeroAccelerator as Accelerator
else:
    from accelerate import Accelerator

accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
torch.manual_seed(0)
if args.model == "gpt2":
    cfg = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
else:
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(cfg)
decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=3e-3, eps=1e-6)
scheduler = get_cosine_schedule_with_warmup(optimizer, 1, args.steps)
g = torch.Generator().manual_seed(1)
per_step = args.grad_accum * 2 * accelerator.num_processes
data = torch.randint(0, 101, (args.steps * per_step, 16), generator=g)
loader = DataLoader(TensorDataset(data), batch_size=2, shuffle=False)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

losses, norms = [], []
model.train()
# layers that recompute in the backward, and whether their checkpoints go to the CPU (hf_zero's P_a+cpu store)
checkpointed = [[type(m).__name__, bool(getattr(getattr(m._gradient_checkpointing_func, "keywords", {}).get("store"),
                                                  "cpu", False))]
                for m in accelerator.unwrap_model(model).modules()
                if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")
                and type(m).__name__.endswith(("Block", "DecoderLayer"))]
done = 0
if args.resume:
    accelerator.load_state(args.resume)
    done = json.load(open(os.path.join(args.resume, "steps.json")))["steps"]
    loader = accelerator.skip_first_batches(loader, done * args.grad_accum)
for i, (x,) in enumerate(loader):
    with accelerator.accumulate(model):
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        step_loss = accelerator.gather(loss.detach()).mean().item()
        if accelerator.sync_gradients:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    losses.append(step_loss)
    if accelerator.sync_gradients:
        done += 1
        if done == args.save_at:
            state_dir = accelerator.save_state(os.path.join(args.out, "state"))
            if accelerator.is_main_process:
                json.dump({"steps": done}, open(os.path.join(state_dir, "steps.json"), "w"))

if args.backend == "zero":
    accelerator.save_model(model, os.path.join(args.out, "saved"))  # consolidated, from the shards
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(os.path.join(args.out, "saved"))
    if args.push:
        accelerator.push_to_hub(model, args.push, commit_message="pushed by accel_train")
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in state.items() if "lm_head" not in k or args.model != "gpt2"},
              os.path.join(args.out, "weights.safetensors"))
    with open(os.path.join(args.out, "log.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "num_processes": accelerator.num_processes,
                   "lr": scheduler.get_last_lr(), "checkpointed_layers": checkpointed}, f)
accelerator.end_training()
# Close the process group before exit: gloo's threads abort the interpreter now and then when it is left alive
# (seen with stock Accelerate too; HfZeroAccelerator closes it at exit by itself).
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
# Even then, torch's gloo/store threads sometimes abort the interpreter's teardown ("terminate called without an
# active exception", seen with stock Accelerate DDP at 3 ranks in CI). Everything is written: leave without it.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
