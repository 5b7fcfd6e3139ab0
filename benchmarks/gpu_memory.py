"""Issue #43 item 9, on one GPU: the dry run's peak against CUDA's, and hf_zero's step time against plain torch.

    python -m benchmarks.gpu_memory [--json out.json]            # the check: a ~1B Llama, about 5 minutes
    python -m benchmarks.gpu_memory --device cpu --tiny          # a smoke run of this script (no GPU)

A Llama of about 1.1e9 parameters (width 2048, 16 layers, MLP 5504, vocab 32000; random init, no download), bf16
mixed precision, stage 3, one rank over NCCL (a FileStore: no port), micro-batch 4 x 512:

- memory: `torch.cuda.max_memory_allocated()` over hf_zero's steps against the dry run's `peak.total` for the
  same shapes and config (tools/estimate/dry_run.py, fake tensors on the CPU), and against the engine's own
  `memory_stats()` (model states, gradient buckets and their budget). The dry run cannot see kernel workspaces
  (cuBLAS, attention), NCCL's buffers, or the caching allocator's rounding: the gap is printed beside them.
- time: the median step of hf_zero against plain torch on the same model and batches (fp32 parameters under
  `torch.autocast(bfloat16)`, fused AdamW), both after warm-up, each step synchronised.

One JSON object per measurement, then a summary line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

FULL = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=5504, vocab_size=32000,
            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024, tie_word_embeddings=False)
TINY = dict(FULL, hidden_size=64, num_hidden_layers=2, intermediate_size=160, vocab_size=512, num_attention_heads=4,
            num_key_value_heads=4)
WARMUP, STEPS = 2, 5


def _model(values: Dict[str, Any], device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**values)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step, device: torch.device) -> List[float]:
    times = []
    for i in range(WARMUP + STEPS):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def run_hf_zero(values, device, batch, seq) -> Dict[str, Any]:
    from hf_zero import ZeroConfig, shard_model

    model = _model(values, device)
    engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                         ZeroConfig(stage=3, mixed_precision="bf16"), device=device)
    x = torch.randint(0, values["vocab_size"], (batch, seq), device=device)

    def step():
        engine.backward(engine.model(input_ids=x, labels=x).loss)
        engine.clip_grad_norm_(1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _time_steps(step, device)
    out = {"system": "hf_zero stage 3", "median_step_s": statistics.median(times), "steps_s": times,
           "memory_stats": {k: int(v) for k, v in engine.memory_stats().items()}}
    if device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
    engine.close()
    return out


def run_plain(values, device, batch, seq) -> Dict[str, Any]:
    model = _model(values, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(0, values["vocab_size"], (batch, seq), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    times = _time_steps(step, device)
    return {"system": "plain torch (autocast bf16, fused AdamW)", "median_step_s": statistics.median(times),
            "steps_s": times}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu: a smoke run of this script")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of ~1B (smoke runs)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --device cpu --tiny for a smoke run)")
        torch.cuda.set_device(device)
    values = TINY if args.tiny else FULL
    seq = min(args.seq, values["max_position_embeddings"])
    from hf_zero import ZeroConfig
    from hf_zero.tools.estimate.dry_run import dry_run

    dry = dry_run(values, ZeroConfig(stage=3, mixed_precision="bf16"), 1, batch_size=args.batch, seq_len=seq,
                  micro_batches=1)
    rows: List[Dict[str, Any]] = [{"dry_run_peak": dry["peak"]["total"], "dry_run_measured": dry["measured"],
                                   "psi": dry["psi"], "cannot_see": dry.get("cannot_see")}]
    print(json.dumps(rows[-1]), flush=True)
    with tempfile.TemporaryDirectory() as folder:  # the FileStore removes its file when the group is destroyed
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
        try:
            rows.append(run_hf_zero(values, device, args.batch, seq))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "memory_stats"}), flush=True)
        finally:
            dist.destroy_process_group()
    rows.append(run_plain(values, device, args.batch, seq))
    print(json.dumps(rows[-1]), flush=True)
    mine, plain = rows[1], rows[2]
    summary = {"x_plain": plain["median_step_s"] / mine["median_step_s"], "dry_run_peak": rows[0]["dry_run_peak"]}
    if "max_memory_allocated" in mine:
        summary["max_memory_allocated"] = mine["max_memory_allocated"]
        summary["gap_over_dry_run"] = mine["max_memory_allocated"] - rows[0]["dry_run_peak"]
    print(json.dumps({"summary": summary}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
