"""GPU check for ZeRO-R and offload: one model, world size 1, each option on and off.

    python examples/gpu_check.py                 # on a CUDA machine (nccl, one process)
    python examples/gpu_check.py --device cpu    # a smoke run anywhere (memory columns are CUDA-only)

For each configuration it trains a few steps and prints peak allocated memory, reserved-minus-allocated (what the
caching allocator holds but does not use: fragmentation, which M_D's contiguous buffers should keep flat),
the compute-device bytes held between the last forward and its backward (activation checkpoints: CPU
checkpointing should drop them), the bytes the engine placed in host memory, and tokens/s. A JSON line follows the
table.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

CONFIGS: List[Dict[str, Any]] = [
    {"name": "stage3", "stage": 3},
    {"name": "stage3 +ckpt", "stage": 3, "ckpt": ("on", False)},
    {"name": "stage3 +ckpt cpu", "stage": 3, "ckpt": ("on", True)},
    {"name": "stage3 +ckpt partitioned", "stage": 3, "ckpt": ("partitioned", False)},
    {"name": "stage2 +offload opt", "stage": 2, "offload_optimizer": "cpu"},
    {"name": "stage3 +offload opt+params", "stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    {"name": "stage2", "stage": 2},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(layers: int, width: int):
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=8192, n_positions=1024, n_embd=width, n_layer=layers, n_head=max(1, width // 64),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def run_config(cfg: Dict[str, Any], args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.engine.activations import enable_activation_checkpointing

    cuda = device.type == "cuda"
    model = build_model(args.layers, args.width).to(device)
    if "ckpt" in cfg:
        enable_activation_checkpointing(model, *cfg["ckpt"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zero = ZeroConfig(stage=cfg["stage"], mixed_precision="bf16" if cuda else "no",
                      offload_optimizer=cfg.get("offload_optimizer", "none"),
                      offload_params=cfg.get("offload_params", "none"))
    engine = shard_model(model, opt, zero, device=device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 8192, (args.batch_size, args.seq_len), generator=gen).to(device)
    held, start = 0, None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        before = torch.cuda.memory_allocated() if cuda else 0
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = engine.model(input_ids=x, labels=x).loss
        if cuda:
            held = torch.cuda.memory_allocated() - before  # activations (checkpoints) kept for the backward
        engine.backward(loss)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    row = {"config": cfg["name"], "tokens_per_s": args.steps * x.numel() / elapsed,
           "offloaded_bytes": engine.memory_stats()["offloaded"], "loss": float(loss)}
    if cuda:
        row.update(peak_allocated=torch.cuda.max_memory_allocated(),
                   fragmentation=torch.cuda.memory_reserved() - torch.cuda.memory_allocated(),
                   held_between_fwd_bwd=held)
    engine.close()
    del engine, model, opt
    if cuda:
        torch.cuda.empty_cache()
    return row


def _mib(x: Any) -> str:
    return f"{'-':>9s}" if x is None else f"{x / 2**20:9.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    if args.device is None:
        parser.error("no CUDA device here: run on a GPU machine, or pass --device cpu for a smoke run")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        rows = [run_config(cfg, args, device) for cfg in CONFIGS]
    finally:
        dist.destroy_process_group()
    print(f"{'config':28s} {'tok/s':>9s} {'peak MiB':>9s} {'frag MiB':>9s} {'fwd->bwd':>9s} {'host MiB':>9s}")
    for r in rows:
        print(f"{r['config']:28s} {r['tokens_per_s']:9.1f} {_mib(r.get('peak_allocated'))} "
              f"{_mib(r.get('fragmentation'))} {_mib(r.get('held_between_fwd_bwd'))} {_mib(r['offloaded_bytes'])}")
    print(json.dumps({"device": str(device), "settings": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
