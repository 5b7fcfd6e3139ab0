"""Train a tiny causal LM with the stock Trainer (--backend ddp) or ZeroTrainer (--backend zero)."""
import argparse
import json
import os
import sys

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=["ddp", "zero"], required=True)
p.add_argument("--stage", type=int, default=2)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=4)
p.add_argument("--resume", default=None, help="a checkpoint folder, or 'true': the newest complete one in --out")
p.add_argument("--pause-in-save", type=int, default=None,
               help="rank 0 writes OUT/paused and blocks (until the test kills the run) when the save of "
                    "checkpoint-N is about to rename its shards into place")
p.add_argument("--push", default=None, help="hub_model_id: push_to_hub() at the end")
p.add_argument("--from-folder", default=None, help="load the model from this save_pretrained folder: the stock "
               "from_pretrained (ddp) or hf_zero.from_pretrained, read into shards (zero)")
args = p.parse_args()

torch.manual_seed(0)
cfg = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = AutoModelForCausalLM.from_config(cfg)
if args.from_folder and args.backend == "zero":
    import hf_zero

    model = hf_zero.from_pretrained(AutoModelForCausalLM, args.from_folder, torch_dtype=torch.float32)
elif args.from_folder:
    model = AutoModelForCausalLM.from_pretrained(args.from_folder, dtype=torch.float32)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 101, (64, 16), generator=g)
ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
targs = TrainingArguments(
    output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    max_grad_norm=1.0, learning_rate=3e-3, adam_epsilon=1e-6, weight_decay=0.1, lr_scheduler_type="cosine",
    warmup_steps=1, logging_steps=1, save_steps=2, save_total_limit=3, report_to=[], seed=0, use_cpu=True,
    dataloader_drop_last=True, disable_tqdm=True,
)
if args.backend == "zero":
    from hf_zero import ZeroPlugin, ZeroTrainer

    trainer = ZeroTrainer(model=model, args=targs, train_dataset=ds, zero_plugin=ZeroPlugin(stage=args.stage))
else:
    trainer = Trainer(model=model, args=targs, train_dataset=ds)
if args.pause_in_save is not None and int(os.environ.get("RANK", "0")) == 0:
    import threading

    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        if os.path.basename(os.path.dirname(str(dst))) == f"checkpoint-{args.pause_in_save}":
            with open(os.path.join(args.out, "paused"), "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait()  # until killed
        return real_replace(src, dst, *a, **kw)

    os.replace = replace
trainer.train(resume_from_checkpoint=True if args.resume == "true" else args.resume)
trainer.save_model(os.path.join(args.out, "final"))
if args.push:
    trainer.args.hub_model_id = args.push
    trainer.push_to_hub(commit_message="pushed by trainer_train")
if trainer.args.should_save:
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    with open(os.path.join(args.out, "log.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "world": trainer.args.world_size}, f)
# Close the process group before exit: gloo's threads abort the interpreter now and then when it is left alive
# (seen with stock Accelerate too; HfZeroAccelerator closes it at exit by itself).
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
# Even then, torch's gloo/store threads sometimes abort the interpreter's teardown ("terminate called without an
# active exception", seen with stock Accelerate DDP at 3 ranks in CI). Everything is written: leave without it.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
