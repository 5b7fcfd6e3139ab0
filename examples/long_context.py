#!/usr/bin/env python
"""Train a causal LM on long sequences with Ulysses sequence parallelism and tiling, and print each rank's memory.

An ordinary Accelerate loop (the one hf_zero line is the Accelerator's import); the long-sequence settings are
ZeroPlugin options, as they would be in hf_zero.yaml (`hf-zero config --sequence-parallel-size 2 ...`):

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no examples/long_context.py --seq_len 8192 --sequence_parallel_size 2

With sequence_parallel_size = sp, every sp ranks share one sequence (each holds S/sp tokens of activations and
attends over all S tokens for H/sp heads); the N ranks read N/sp distinct sequences per step. The model is a small
Llama built from its config (random init, random tokens): this shows memory and speed, not a fine-tune.
At the end each rank prints its tokens/s, its peak resident memory and the engine's own peaks; `--json PATH` writes
them (PATH.rank<R>.json).
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from hf_zero import HfZeroAccelerator as Accelerator
from hf_zero import ZeroPlugin


class RandomTokens(Dataset):
    """`count` sequences of `seq_len` random token ids (labels = the ids: every token a target)."""

    def __init__(self, count: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is warm-up, not timed)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--zero_stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--sequence_parallel_size", type=int, default=1)
    p.add_argument("--tiled_loss_tokens", type=int, default=0)
    p.add_argument("--tiled_mlp_tokens", type=int, default=0)
    p.add_argument("--activation_checkpointing", choices=["off", "on"], default="on")
    p.add_argument("--cpu_checkpointing", action="store_true")
    p.add_argument("--json", default=None, help="write each rank's figures to JSON.rank<R>.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    plugin = ZeroPlugin(stage=args.zero_stage, sequence_parallel_size=args.sequence_parallel_size,
                        tiled_loss_tokens=args.tiled_loss_tokens, tiled_mlp_tokens=args.tiled_mlp_tokens,
                        activation_checkpointing=args.activation_checkpointing,
                        cpu_checkpointing=args.cpu_checkpointing)
    accelerator = Accelerator(zero_plugin=plugin)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len, use_cache=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    groups = accelerator.sequence_groups
    data = RandomTokens(args.steps * groups.data_parallel_size, args.seq_len, args.vocab, seed=1)
    loader = DataLoader(data, batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if accelerator.is_main_process:
        print(f"{accelerator.num_processes} ranks = {groups.data_parallel_size} replicas x sp "
              f"{groups.size}; {args.seq_len} tokens per sequence, {args.seq_len // groups.size} per rank; "
              f"stage {args.zero_stage}; tiles: loss {args.tiled_loss_tokens or 'off'}, MLP "
              f"{args.tiled_mlp_tokens or 'off'}", flush=True)
    times, losses = [], []
    for batch in tqdm(loader, disable=not accelerator.is_main_process, desc="steps"):
        start = time.perf_counter()
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    timed = times[1:] or times
    tokens_per_s = args.seq_len * groups.data_parallel_size / (sum(timed) / len(timed))  # all ranks together
    stats = accelerator.zero_engine.memory_stats()
    figures = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
               "sequence_parallel_size": groups.size, "seq_len": args.seq_len, "steps": len(times),
               "step_seconds": times, "tokens_per_s": tokens_per_s, "losses": losses,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "model_states_bytes": stats["model_states"], "gathered_params_peak": stats["gathered_params_peak"],
               "comm_buffers_peak": stats["comm_buffers_peak"], "args": vars(args)}
    print(f"rank {figures['rank']}: {tokens_per_s:,.0f} tokens/s (all ranks), peak RSS "
          f"{figures['peak_rss_bytes'] / 2**30:.2f} GiB, model states {stats['model_states'] / 2**20:.1f} MiB, "
          f"loss {losses[-1]:.3f}", flush=True)
    if args.json:
        with open(f"{args.json}.rank{figures['rank']}.json", "w") as f:
            json.dump(figures, f, indent=1)
    accelerator.end_training()


if __name__ == "__main__":
    main()
