"""Which dtype should stage-2/3 gradient buckets be reduce-scattered in under bf16? A measurement.

Trains one small Llama under bf16 mixed precision (bf16 compute copy, fp32 master and fp32 gradient shards) at
ZeRO stage 2 on N gloo ranks, twice: buckets reduce-scattered in fp32 (`reduce_dtype="fp32"`) and in bf16
(`"compute"`). Beside them, the same recipe in one process on the whole batch, where no cross-rank sum exists
(the reference). Prints per-step losses and gradient norms of each run, their largest deviation from the
reference, and the reduce-scatter bytes per step from hf_zero's ledger; then one JSON line.

    python examples/reduce_dtype_check.py --world-size 4 --steps 8
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg)


def _batches(steps: int, rows: int, seq: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (rows, seq), generator=gen) for _ in range(steps)]


def reference(steps: int, rows: int, seq: int, lr: float):
    """One process, whole batch: bf16 compute copy, fp32 master and gradients, AdamW on the master."""
    master = _model()
    compute = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr)
    losses, norms = [], []
    for x in _batches(steps, rows, seq):
        with torch.no_grad():
            for m, c in zip(master.parameters(), compute.parameters()):
                c.copy_(m)
        loss = compute(input_ids=x, labels=x).loss
        loss.backward()
        for m, c in zip(master.parameters(), compute.parameters()):
            m.grad = c.grad.float()
            c.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms}


def _worker(rank: int, world: int, store: str, out: str, steps: int, rows: int, seq: int, lr: float) -> None:
    from hf_zero import ZeroConfig, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    results = {}
    for reduce_dtype in ("fp32", "compute"):
        model = _model()
        engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=lr),
                             ZeroConfig(stage=2, mixed_precision="bf16", reduce_dtype=reduce_dtype))
        losses, norms, rs_bytes = [], [], []
        per = rows // world
        for x in _batches(steps, rows, seq):
            engine.reset_comm_stats()
            mine = x[rank * per:(rank + 1) * per]
            loss = model(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            if not losses:  # step 0: same weights and data in both runs, so only the reduction differs
                engine.optimizer.prepare_grads()
                shard0 = torch.cat([g.grad_shard.float() for g in engine.groups if g.plan.trainable])
            norms.append(float(engine.clip_grad_norm_(1.0)))
            engine.optimizer.step()
            rs_bytes.append(engine.comm_stats()["reduce_scatter"]["bytes"])
            t = loss.detach().float().reshape(1)
            dist.all_reduce(t)
            losses.append(float(t) / world)  # noqa: the mean over ranks of equal-sized slices
        engine.close()
        results[reduce_dtype] = {"losses": losses, "norms": norms, "reduce_scatter_bytes": rs_bytes[-1],
                                 "step0_grad_shard": shard0.tolist()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    rows = 2 * args.world_size
    ref = reference(args.steps, rows, args.seq_len, args.lr)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(args.world_size, os.path.join(tmp, "store"), out, args.steps, rows, args.seq_len,
                                args.lr), nprocs=args.world_size)
        with open(out) as f:
            runs = json.load(f)
    print(f"bf16, ZeRO stage 2, {args.world_size} gloo ranks, {args.steps} steps (reference: one process)")
    print(f"{'step':>4} {'ref loss':>10} {'fp32 loss':>10} {'bf16 loss':>10} {'ref norm':>9} {'fp32 norm':>9} "
          f"{'bf16 norm':>9}")
    for i in range(args.steps):
        print(f"{i:>4} {ref['losses'][i]:>10.5f} {runs['fp32']['losses'][i]:>10.5f} "
              f"{runs['compute']['losses'][i]:>10.5f} {ref['norms'][i]:>9.4f} {runs['fp32']['norms'][i]:>9.4f} "
              f"{runs['compute']['norms'][i]:>9.4f}")
    g32, g16 = (torch.tensor(runs[k].pop("step0_grad_shard")) for k in ("fp32", "compute"))
    grad_err = float((g16 - g32).norm() / g32.norm())
    summary = {"world_size": args.world_size, "steps": args.steps, "step0_grad_rel_err_bf16_vs_fp32": grad_err}
    print(f"step-0 gradient, rank 0's shard: bf16 sum vs fp32 sum relative error {grad_err:.2e}")
    for name, run in runs.items():
        dl = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
        dn = max(abs(a - b) / b for a, b in zip(run["norms"], ref["norms"]))
        summary[name] = {"max_loss_dev": dl, "max_norm_rel_dev": dn, "reduce_scatter_bytes": run["reduce_scatter_bytes"]}
        print(f"reduce_dtype={name:7s}: max |loss - ref| {dl:.2e}, max norm rel. dev. {dn:.2e}, "
              f"reduce-scatter {run['reduce_scatter_bytes']:,} B/step")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
