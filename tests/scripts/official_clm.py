"""A causal-LM fine-tuning script shaped like Transformers' examples/pytorch/language-modeling/run_clm_no_trainer.py,
changed only by the import line (`--backend zero`). What it keeps of the original: AdamW over decay / no-decay
groups, Transformers' `get_scheduler`, `accelerator.accumulate`, `init_trackers` / `log` / `end_training`,
`--checkpointing_steps` with `accelerator.save_state("step_N")` and `--resume_from_checkpoint` with
`skip_first_batches`, an eval loop with `gather_for_metrics` for the perplexity, and the last lines: every rank calls
`unwrap_model(model).save_pretrained(output_dir, is_main_process=..., save_function=accelerator.save)`, then
`end_training()` (moved after the save: see there).
The model is a tiny GPT-2 or Llama built from a config and the data is random token ids (nothing is downloaded).
"""
import argparse
import json
import math
import os

import torch
from accelerate.tracking import GeneralTracker
from accelerate.utils import set_seed
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, default_data_collator, get_scheduler

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=["ddp", "zero"], required=True)
p.add_argument("--model", default="gpt2")
p.add_argument("--output_dir", required=True)
p.add_argument("--num_train_epochs", type=int, default=2)
p.add_argument("--gradient_accumulation_steps", type=int, default=2)
p.add_argument("--checkpointing_steps", default=None)
p.add_argument("--resume_from_checkpoint", default=None)
p.add_argument("--with_tracking", action="store_true")
args = p.parse_args()

if args.backend == "zero":
    from hf_zero import HfZeroAccelerator as Accelerator
else:
    from accelerate import Accelerator


class JsonTracker(GeneralTracker):
    """A custom tracker (Accelerate's public GeneralTracker API): the logged values, as JSON lines."""

    name = "json"
    requires_logging_directory = False

    def __init__(self, path):
        super().__init__()
        self.path = path

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values):
        with open(self.path, "a") as f:
            f.write(json.dumps({"config": values}) + "\n")

    def log(self, values, step=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


os.makedirs(args.output_dir, exist_ok=True)
log_with = [JsonTracker(os.path.join(args.output_dir, "tracker.jsonl"))] if args.with_tracking else None
accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, log_with=log_with,
                          project_dir=args.output_dir)
set_seed(0)
if args.model == "gpt2":
    config = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
else:
    config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(config)

g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 101, (48, 16), generator=g)
train_dataset = Dataset.from_dict({"input_ids": ids[:40].tolist(), "labels": ids[:40].tolist()})
eval_dataset = Dataset.from_dict({"input_ids": ids[40:].tolist(), "labels": ids[40:].tolist()})  # 8 rows
train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator, batch_size=2)
eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=3)

no_decay = ["bias", "layer_norm.weight", "ln_", "norm.weight"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=3e-3, eps=1e-6)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=1,
                             num_training_steps=max_train_steps * accelerator.num_processes)

model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
checkpointing_steps = int(args.checkpointing_steps) if args.checkpointing_steps is not None else None

if args.with_tracking:
    accelerator.init_trackers("clm_no_trainer", {"lr": 3e-3, "epochs": args.num_train_epochs})

completed_steps, starting_epoch, resume_step = 0, 0, None
if args.resume_from_checkpoint:
    accelerator.load_state(args.resume_from_checkpoint)
    path = os.path.basename(args.resume_from_checkpoint.rstrip("/"))
    resume_step = int(path.replace("step_", "")) * args.gradient_accumulation_steps
    starting_epoch = resume_step // len(train_dataloader)
    completed_steps = resume_step // args.gradient_accumulation_steps
    resume_step -= starting_epoch * len(train_dataloader)

results = {"train_losses": [], "perplexity": [], "eval_loss": [], "lr": []}
for epoch in range(starting_epoch, args.num_train_epochs):
    model.train()
    total_loss = 0.0
    if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
        active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
    else:
        active_dataloader = train_dataloader
    for step, batch in enumerate(active_dataloader):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        results["train_losses"].append(accelerator.gather(loss.detach()).mean().item())
        if accelerator.sync_gradients:
            completed_steps += 1
            results["lr"].append(lr_scheduler.get_last_lr()[0])
        if checkpointing_steps and completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
            accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
        if completed_steps >= max_train_steps:
            break

    model.eval()
    losses = []
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
    losses = torch.cat(losses)
    eval_loss = torch.mean(losses)
    perplexity = math.exp(eval_loss)
    results["perplexity"].append(perplexity)
    results["eval_loss"].append(eval_loss.item())
    results["eval_rows"] = losses.numel()
    if args.with_tracking:
        accelerator.log({"perplexity": perplexity, "eval_loss": eval_loss.item(), "epoch": epoch,
                         "step": completed_steps}, step=completed_steps)

accelerator.wait_for_everyone()
unwrapped_model = accelerator.unwrap_model(model)
unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                save_function=accelerator.save)
if accelerator.is_main_process:
    with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
        json.dump(results, f)
# last, not before the save as in run_clm_no_trainer.py: Accelerate 1.16's end_training() destroys the process group,
# after which the example's own wait_for_everyone() fails under stock DDP too
accelerator.end_training()
