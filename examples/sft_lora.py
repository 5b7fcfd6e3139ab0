"""LoRA SFT of SmolLM2-135M on Shakespeare through trl.SFTTrainer on hf_zero (stage 3 by default).

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/sft_lora.py [--tiny]

The base model is read straight into shards (hf_zero.from_pretrained), PEFT puts LoRA adapters on q/v, and the
trainer class is hf_zero.zero_trainer(trl.SFTTrainer). It ends like the main job: the loss curve, the eval
perplexity before and after, the adapter saved in PEFT's own layout (gathered from the shards) and reloaded with
PeftModel.from_pretrained and checked equal, and a merged export (merge_and_unload under the gathered
parameters) that from_pretrained loads, whose logits are checked against the reloaded adapter's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import hf_zero  # first: a distributed launch on CPU becomes a gloo world
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data_utils  # noqa: E402  (the helper module beside this script)
from finetune_causal_lm import sparkline  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama saved once from scratch (seconds)")
    p.add_argument("--zero_stage", type=int, choices=[1, 2, 3], default=3)
    p.add_argument("--max_steps", type=int, default=None)
    p.add_argument("--block_size", type=int, default=None)
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=None)
    p.add_argument("--output_dir", default="runs/sft_lora")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--eval_steps", type=int, default=None, help="evaluate every N steps (default: at the end only)")
    p.add_argument("--quantized_frozen_weights", choices=["none", "int8"], default="none",
                   help="keep the frozen base's stage-3 shards as int8 codes + scales and all-gather the codes")
    args = p.parse_args(argv)
    defaults = dict(max_steps=8, block_size=64, learning_rate=5e-3) if args.tiny else dict(
        max_steps=12, block_size=128, learning_rate=1e-3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Optional[List[str]] = None) -> Dict:
    args = parse_args(argv)
    # the launch's gloo world (a plain PartialState under a CPU launch would make every rank its own world)
    state = hf_zero.HfZeroAccelerator()
    out = Path(args.output_dir)
    cache = data_utils.default_cache_dir()
    files = data_utils.shakespeare_files(data_utils.TINY_PLAYS if args.tiny else None)
    with state.main_process_first():
        raw = data_utils.load_text_dataset(None, "text", files=files)
    if args.tiny:
        tokenizer = AutoTokenizer.from_pretrained(data_utils.tiny_tokenizer_dir(state, cache, raw, "text"))
        config = data_utils.tiny_llama_config(tokenizer, args.block_size)
        base_dir = data_utils.tiny_model_dir(state, cache, config, args.seed)
    else:
        base_dir = data_utils.default_model_dir(state, cache)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with state.main_process_first():
        blocks = data_utils.tokenize_and_pack(raw, tokenizer, "text", args.block_size)
    train_set, eval_set = data_utils.split_blocks(blocks, 0.05, 32)

    model = hf_zero.from_pretrained(AutoModelForCausalLM, base_dir, torch_dtype=torch.float32)
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=["q_proj", "v_proj"],
                      lora_dropout=0.0, task_type="CAUSAL_LM")
    sft = SFTConfig(output_dir=str(out), max_steps=args.max_steps, per_device_train_batch_size=4,
                    per_device_eval_batch_size=8, gradient_accumulation_steps=2, learning_rate=args.learning_rate,
                    warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                    # evaluated right after prepare() read the weights (a meta model cannot be evaluated before)
                    eval_strategy="steps", eval_steps=args.eval_steps or args.max_steps, eval_on_start=True,
                    seed=args.seed, disable_tqdm=not state.is_main_process, max_length=args.block_size,
                    dataloader_drop_last=True)
    trainer = hf_zero.zero_trainer(SFTTrainer)(
        model=model, args=sft, train_dataset=train_set, eval_dataset=eval_set, processing_class=tokenizer,
        peft_config=lora, zero_plugin=hf_zero.ZeroPlugin(stage=args.zero_stage,
                                                         quantized_frozen_weights=args.quantized_frozen_weights))
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    before, after = evals[0], evals[-1]
    engine = trainer.zero_engine

    # the adapter, in PEFT's layout, gathered from the shards
    adapter_dir = out / "adapter"
    trainer.save_model(str(adapter_dir))
    trained = {k: v for k, v in engine.full_state_dict().items() if "lora_" in k}  # collective; rank 0 only
    # merged: LoRA folded into the base weights while every unit is gathered; rank 0 writes the export
    merged_dir = out / "merged"
    peft_model = trainer.model
    with engine.gathered_parameters():
        merged = peft_model.merge_and_unload()
        if state.is_main_process:
            merged.save_pretrained(merged_dir)
            tokenizer.save_pretrained(merged_dir)
    state.wait_for_everyone()

    summary: Dict = {}
    if state.is_main_process:
        reloaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), str(adapter_dir))
        got = {k.replace(".default.", "."): v for k, v in reloaded.state_dict().items() if "lora_" in k}
        want = {k.replace(".default.", "."): v for k, v in trained.items()}
        adapter_equal = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        probe = torch.tensor([eval_set[0]["input_ids"][:32]])
        with torch.no_grad():
            logits_merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(probe).logits
            logits_adapter = reloaded(probe).logits
        merged_err = float((logits_merged - logits_adapter).abs().max())
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        # with int8 frozen weights the merged export holds the base the run trained against (dequantized), so its
        # difference to the adapter on the original base is that quantization's error, not a merge error
        summary = {"zero_stage": args.zero_stage, "num_processes": state.num_processes, "losses": losses,
                   "quantized_frozen_weights": args.quantized_frozen_weights,
                   "eval_losses": {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h},
                   "eval_loss_before": before, "eval_loss_after": after, "perplexity_before": math.exp(before),
                   "perplexity_after": math.exp(after), "adapter_files": sorted(os.listdir(adapter_dir)),
                   "adapter_reload_equal": adapter_equal, "merged_logits_max_abs_diff": merged_err,
                   "trainable_params": sum(v.numel() for v in want.values())}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print("\n".join([
            "", "=" * 78, f"hf_zero LoRA SFT summary | ZeRO stage {args.zero_stage} | {state.num_processes} process(es)",
            "=" * 78,
            f"loss curve ({len(losses)} steps, {losses[0]:.3f} -> {losses[-1]:.3f}): {sparkline(losses)}",
            f"eval perplexity: {math.exp(before):.2f} before, {math.exp(after):.2f} after",
            f"adapter ({summary['trainable_params']:,} parameters) saved in PEFT's layout to {adapter_dir}; "
            f"PeftModel.from_pretrained gives the trained tensors: {adapter_equal}",
            f"merged export in {merged_dir}: from_pretrained logits vs the adapter's, max |diff| {merged_err:.2e}"
            + (" (the int8 frozen base's quantization error)" if args.quantized_frozen_weights != "none" else ""),
        ]), flush=True)
    state.wait_for_everyone()
    return summary


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
