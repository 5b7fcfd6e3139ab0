"""accel_train.py's loop with clip_grad_norm_ on EVERY micro-batch (inside accumulate(), not only when
sync_gradients), as many training scripts write it; stock Accelerate (--backend ddp) or hf_zero (--backend zero).
The hf_zero run differs from the stock one by the import alone. Used by tests/test_clip_every_microbatch.py.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GPT2Config

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=["ddp", "zero"], required=True)
p.add_argument("--batches", type=int, default=8, help="micro-batches per rank")
p.add_argument("--grad-accum", type=int, default=3)
p.add_argument("--clip-every-micro-batch", action="store_true", help="else only when sync_gradients")
p.add_argument("--max-norm", type=float, default=1.0)
p.add_argument("--out", required=True)
args = p.parse_args()

if args.backend == "zero":
    from hf_zero import HfZeroAccelerator as Accelerator
else:
    from accelerate import Accelerator

accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = AutoModelForCausalLM.from_config(cfg)
decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=3e-3, eps=1e-6)
g = torch.Generator().manual_seed(1)
data = torch.randint(0, 101, (args.batches * 2 * accelerator.num_processes, 16), generator=g)
loader = DataLoader(TensorDataset(data), batch_size=2, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
steps = [0]
optimizer.optimizer.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))  # real steps only

losses, norms = [], []
model.train()
for i, (x,) in enumerate(loader):
    with accelerator.accumulate(model):
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        losses.append(accelerator.gather(loss.detach()).mean().item())
        if args.clip_every_micro_batch or accelerator.sync_gradients:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), args.max_norm)))
        optimizer.step()
        optimizer.zero_grad()

state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in state.items() if "lm_head" not in k},
              os.path.join(args.out, "weights.safetensors"))
    with open(os.path.join(args.out, "log.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "optimizer_steps": steps[0],
                   "num_processes": accelerator.num_processes}, f)
accelerator.end_training()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # gloo's threads now and then abort the interpreter's teardown (see accel_train.py)
