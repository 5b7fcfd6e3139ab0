"""One rank of a run that trains a tiny Llama with stock Accelerate + DeepSpeed ZeRO and saves it, or resumes such a
folder with HfZeroAccelerator; tests/test_from_deepspeed_resume.py compares the two continuations.

Launched as plain processes (RANK, WORLD_SIZE, STORE: a FileStore path, no port). Every step uses global batch
`step` of a fixed data set (6 sequences), split evenly over the ranks, so any world size dividing 6 sees the same
global batches. Written to --out (rank 0): the global mean loss of every step run here, and the final fp32
weights (DeepSpeed: its own zero_to_fp32 on a final save; hf_zero: its consolidated state dict).
"""
import argparse
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=["deepspeed", "zero", "trainer"], required=True,
               help="trainer: ZeroTrainer resuming --load, a Trainer checkpoint-N folder")
p.add_argument("--stage", type=int, required=True)
p.add_argument("--first", type=int, default=0, help="the first global step this run takes")
p.add_argument("--steps", type=int, required=True, help="how many optimizer steps to run")
p.add_argument("--save", default=None, help="deepspeed: save_state here after the steps")
p.add_argument("--load", default=None, help="load_state from this folder first")
p.add_argument("--bf16", action="store_true", help="deepspeed: bf16 compute with fp32 master weights")
p.add_argument("--groups", type=int, default=2, choices=[1, 2], help="AdamW parameter groups")
p.add_argument("--hidden", type=int, default=16, help="the model's width (another width: another model)")
p.add_argument("--out", required=True)
args = p.parse_args()

logging.basicConfig(level=logging.WARNING)
logging.getLogger("hf_zero").setLevel(logging.INFO)  # what load_state found, as a user who asks for it sees it
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ["LOCAL_RANK"] = str(rank)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(os.environ["STORE"], world), rank=rank, world_size=world)

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

GLOBAL_BATCH, SEQ, VOCAB = 6, 8, 64
if args.backend == "deepspeed":
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true":
        sys.exit("set ACCELERATE_USE_DEEPSPEED=true")
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=1, gradient_clipping=1.0)
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=GLOBAL_BATCH // world,
                                   train_batch_size=GLOBAL_BATCH)
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16" if args.bf16 else "no")
elif args.backend == "zero":
    from hf_zero import HfZeroAccelerator, ZeroPlugin

    # DeepSpeed steps the scheduler once per optimizer step; Accelerate steps it once per process unless told not to
    accelerator = HfZeroAccelerator(zero_plugin=ZeroPlugin(stage=args.stage), step_scheduler_with_optimizer=False)

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(cfg)
decay = [q for n, q in model.named_parameters() if q.ndim >= 2]
no_decay = [q for n, q in model.named_parameters() if q.ndim < 2]
# Stock Accelerate + DeepSpeed ZeRO-3 (0.19.8) fails a LambdaLR step over two parameter groups ("zip() argument 2
# is longer than argument 1": its optimizer shows one group); stage-3 runs use one group
groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}] if args.groups == 2 \
    else [{"params": decay + no_decay, "weight_decay": 0.1}]
optimizer = torch.optim.AdamW(groups, lr=3e-3, eps=1e-6)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
data = torch.randint(0, VOCAB, (16 * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
per_rank = GLOBAL_BATCH // world
if args.backend == "trainer":
    from datasets import Dataset
    from safetensors.torch import save_file
    from torch.utils.data import SequentialSampler
    from transformers import TrainingArguments

    from hf_zero import ZeroPlugin, ZeroTrainer

    class InOrder(ZeroTrainer):
        def _get_train_sampler(self, *a, **k):  # global step s sees batch s, as the other backends do
            return SequentialSampler(self.train_dataset)

    os.environ["ACCELERATE_USE_CPU"] = "1"
    targs = TrainingArguments(output_dir=os.path.dirname(os.path.abspath(args.load)), per_device_train_batch_size=per_rank,
                              max_steps=args.first + args.steps, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                              report_to=[], use_cpu=True, dataloader_drop_last=True, disable_tqdm=True)
    ds = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    trainer = InOrder(model=model, args=targs, train_dataset=ds, optimizers=(optimizer, scheduler),
                      zero_plugin=ZeroPlugin(stage=args.stage))
    trainer.train(resume_from_checkpoint=args.load)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = trainer.accelerator.get_state_dict(trainer.model)
    if rank == 0:
        save_file({k: v.float().contiguous() for k, v in weights.items()}, args.out + ".safetensors")
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "lr": trainer.lr_scheduler.get_last_lr()}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
if args.load:
    accelerator.load_state(args.load)

losses = []
model.train()
for step in range(args.first, args.first + args.steps):
    batch = data[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH][rank * per_rank:(rank + 1) * per_rank]
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    if args.backend == "zero":
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed clips inside its step
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / world)

def save(folder):
    accelerator.save_state(folder)
    if args.backend == "deepspeed":
        # On CPU, Accelerate's DeepSpeed state counts one process (its backend table has no CPU entry), so every
        # rank writes scheduler.bin and random_states_0.pkl at once and may corrupt them. Write them again, one
        # writer per file, as Accelerate does on GPUs: the folder is then what a GPU run of this script writes.
        from accelerate.checkpointing import save_accelerator_state

        dist.barrier()
        save_accelerator_state(folder, [], [], [scheduler] if rank == 0 else [], [], rank, accelerator.step)
        dist.barrier()


if args.save:
    save(args.save)
if args.backend == "deepspeed":  # DeepSpeed's own consolidation of its final state: the reference weights
    final = args.out + ".final"
    save(final)
    accelerator.wait_for_everyone()
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = {k: v.clone().contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(final).items()}
else:
    weights = accelerator.get_state_dict(model)
if rank == 0:
    from safetensors.torch import save_file

    save_file({k: v.float().contiguous() for k, v in weights.items()}, args.out + ".safetensors")
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "lr": scheduler.get_last_lr()}, f)
dist.barrier()
dist.destroy_process_group()
