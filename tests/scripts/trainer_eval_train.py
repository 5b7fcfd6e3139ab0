"""Train a tiny causal LM with in-loop evaluation (eval_strategy="steps", also before the first step) and
gradient checkpointing on: the stock Trainer (--backend ddp) or ZeroTrainer (--backend zero). The eval set does not
divide into the ranks' batches, so Accelerate pads the last eval batch. Writes log.json (training losses, grad
norms, eval losses with their steps, whether the layers were checkpointed) and the final weights (save_model)."""
import argparse
import json
import os
import sys

import torch
import torch.utils.checkpoint
from datasets import Dataset
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=["ddp", "zero"], required=True)
p.add_argument("--stage", type=int, default=3)
p.add_argument("--model", choices=["gpt2", "llama"], default="llama")
p.add_argument("--out", required=True)
args = p.parse_args()

torch.manual_seed(0)
if args.model == "gpt2":  # tied embeddings
    cfg = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
else:  # untied lm_head
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, tie_word_embeddings=False, initializer_range=0.2)
model = AutoModelForCausalLM.from_config(cfg)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 101, (64, 16), generator=g)
eval_ids = torch.randint(0, 101, (10, 16), generator=g)  # 10 rows: not a multiple of 2 (batch) x world size
train_ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
eval_ds = Dataset.from_dict({"input_ids": eval_ids.tolist(), "labels": eval_ids.tolist()})
targs = TrainingArguments(
    output_dir=args.out, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=2, eval_on_start=True,
    gradient_checkpointing=True, max_grad_norm=1.0, learning_rate=3e-3, adam_epsilon=1e-6, weight_decay=0.1,
    lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[], seed=0,
    use_cpu=True, disable_tqdm=True,
)

# count the checkpointed forwards (training) and the evaluation forwards' checkpoint calls (there must be none)
checkpoint_calls = {"train": 0, "eval": 0}
real_checkpoint = torch.utils.checkpoint.checkpoint


def counting_checkpoint(*a, **kw):
    checkpoint_calls["train" if torch.is_grad_enabled() else "eval"] += 1
    return real_checkpoint(*a, **kw)


import transformers.modeling_utils  # noqa: E402

transformers.modeling_utils.checkpoint = counting_checkpoint  # what activation_checkpointing_enable partials over

kwargs = dict(model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds)
if args.backend == "zero":
    from hf_zero import ZeroPlugin, ZeroTrainer

    trainer = ZeroTrainer(zero_plugin=ZeroPlugin(stage=args.stage), **kwargs)
else:
    trainer = Trainer(**kwargs)
trainer.train()
trainer.save_model(os.path.join(args.out, "final"))
if trainer.args.should_save:
    logs = trainer.state.log_history
    with open(os.path.join(args.out, "log.json"), "w") as f:
        json.dump({"losses": [h["loss"] for h in logs if "loss" in h],
                   "norms": [h["grad_norm"] for h in logs if "grad_norm" in h],
                   "eval_losses": [h["eval_loss"] for h in logs if "eval_loss" in h],
                   "eval_steps": [h["step"] for h in logs if "eval_loss" in h],
                   "checkpoint_calls": checkpoint_calls, "world": trainer.args.world_size}, f)
if torch.distributed.is_initialized():  # see trainer_train.py: gloo's threads may abort the teardown otherwise
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
