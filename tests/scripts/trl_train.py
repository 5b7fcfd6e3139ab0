"""LoRA training of a tiny Llama through TRL (--trainer sft: SFTTrainer, dpo: DPOTrainer, whose reference forward
is the base with the adapter disabled): stock (--backend ddp) or on hf_zero (--backend zero, the class from
hf_zero.zero_trainer). Writes log.json (losses, grad norms) and saves the adapter with trainer.save_model."""
import argparse
import json
import os
import sys

import torch

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=["ddp", "zero"], required=True)
p.add_argument("--stage", type=int, default=2)
p.add_argument("--out", required=True)
p.add_argument("--trainer", choices=["sft", "dpo"], default="sft")
p.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: none)")
p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
p.add_argument("--max-steps", type=int, default=4)
p.add_argument("--dump-resumed", action="store_true",
               help="when training begins (after the resume), write the adapter as the engine holds it")
args = p.parse_args()
if args.backend == "zero":
    import hf_zero  # noqa: F401  (first: a gloo world on CPU)

from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

vocab = {f"w{i}": i for i in range(100)}
vocab.update({"<pad>": 100, "<eos>": 101})
tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=102, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, pad_token_id=100, eos_token_id=101, bos_token_id=None,
                  tie_word_embeddings=False, initializer_range=0.2)
model = AutoModelForCausalLM.from_config(cfg)
g = torch.Generator().manual_seed(1)


def words(n):
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 100, (n,), generator=g))


if args.trainer == "sft":
    trainer_class, config_class = SFTTrainer, SFTConfig
    data = {"text": [words(12) for _ in range(48)]}
    # said, not inherited: SFT + LoRA with gradient checkpointing is what the tests pin (TRL 1.16's default)
    extra = {"max_length": 16, "gradient_checkpointing": True}
else:
    trainer_class, config_class = DPOTrainer, DPOConfig
    data = {"prompt": [words(6) for _ in range(48)], "chosen": [words(4) for _ in range(48)],
            "rejected": [words(4) for _ in range(48)]}
    extra = {"max_length": 16}
sft = config_class(output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                # adam_epsilon 1e-3: with 1e-8 Adam turns summation-order noise in near-zero gradient elements into
                # visible steps (docs/architecture.md, "Numerics in tests"); the runs are exact otherwise
                max_grad_norm=1.0, learning_rate=2e-2, adam_epsilon=1e-3, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                disable_tqdm=True, seed=0, dataloader_drop_last=True, **extra)
lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
kwargs = dict(model=model, args=sft, train_dataset=Dataset.from_dict(data), processing_class=tokenizer,
              peft_config=lora)
if args.backend == "zero":
    from hf_zero import ZeroPlugin, zero_trainer

    trainer = zero_trainer(trainer_class)(zero_plugin=ZeroPlugin(stage=args.stage), **kwargs)
else:
    trainer = trainer_class(**kwargs)
if args.dump_resumed:
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    class DumpResumed(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):  # after the checkpoint's shards were loaded
            full = trainer.zero_engine.full_state_dict()  # collective
            if full:
                save_file({k: v.contiguous() for k, v in full.items() if "lora_" in k},
                          os.path.join(args.out, "resumed_adapter.safetensors"))

    trainer.add_callback(DumpResumed())
trainer.train(resume_from_checkpoint=args.resume)
trainer.save_model(os.path.join(args.out, "final"))
if trainer.args.should_save:
    logs = trainer.state.log_history
    with open(os.path.join(args.out, "log.json"), "w") as f:
        json.dump({"losses": [h["loss"] for h in logs if "loss" in h],
                   "norms": [h["grad_norm"] for h in logs if "grad_norm" in h]}, f)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
