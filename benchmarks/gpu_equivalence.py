"""hf_zero on a CUDA GPU against plain PyTorch training on the same GPU: one JSON line per case, then a summary.

    python -m benchmarks.gpu_equivalence [--json out.json]

World size 1 over NCCL (one GPU): stages 0-3 in fp32, stage 3 under each reshard_after_forward policy, with
activation checkpointing (on GPU and CPU-kept), with CPU offload of optimizer and parameters (pinned host copies,
the step on the host), and bf16 mixed precision against the same recipe written by hand (bf16 compute copy, fp32
master and AdamW). Then the backend torch picks when none is given ("cpu:gloo,cuda:nccl") with a model already on
the GPU, and 2 gloo ranks sharing the GPU (gloo's CUDA collectives). Each case trains a tiny GPT-2 for 3 steps of
2 micro-batches and reports the largest difference of any weight from the reference (`max_abs`) and whether it is
within the tolerance (exact recipes: 1e-5 relative; a CPU optimizer step or bf16: looser, stated per case).

Not a test of speed: tiny model, deterministic algorithms on.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

STEPS, ACCUM, BATCH, SEQ, VOCAB = 3, 2, 4, 32, 512


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=3, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


def _batches(device) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(ACCUM)]
            for _ in range(STEPS)]


def reference(device, bf16: bool = False) -> Dict[str, torch.Tensor]:
    """Plain training on the full micro-batches: AdamW; bf16: a bf16 compute copy, fp32 master weights and AdamW
    states, gradients accumulated in fp32 on the master."""
    master = _model().to(device)
    model = copy.deepcopy(master).to(torch.bfloat16) if bf16 else master
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for step in _batches(device):
        for x in step:
            (model(input_ids=x, labels=x).loss / ACCUM).backward()
            if bf16:
                for m, c in zip(master.parameters(), model.parameters()):
                    m.grad = c.grad.float() if m.grad is None else m.grad + c.grad.float()
                    c.grad = None
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if bf16:
            with torch.no_grad():
                for m, c in zip(master.parameters(), model.parameters()):
                    c.copy_(m)
    return {k: v.detach().float().cpu() for k, v in master.state_dict().items()}


def engine_run(device, rank: int = 0, world: int = 1, ckpt: Optional[tuple] = None, **options) -> Dict[str, Any]:
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.engine.activations import enable_activation_checkpointing

    model = _model().to(device)
    if ckpt is not None:
        enable_activation_checkpointing(model, *ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = shard_model(model, opt, ZeroConfig(**options), device=device)
    per = BATCH // world
    for step in _batches(device):
        for j, x in enumerate(step):
            x = x[rank * per:(rank + 1) * per]
            ctx = engine.no_sync() if j < ACCUM - 1 else _null()
            with ctx:
                engine.backward(engine.model(input_ids=x, labels=x).loss / ACCUM)
        engine.clip_grad_norm_(1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    state = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
    out = {"state": state, "device": str(engine.device), "collectives": sorted(engine.collectives),
           "param_devices": sorted({str(g.shard.device) for g in engine.groups}),
           "master_devices": sorted({str(g.master.device) for g in engine.groups if g.master is not None}),
           "pinned": any(g.master is not None and g.master.is_pinned() for g in engine.groups)}
    engine.close()
    return out


def loaded_run(device, folder: str, **options) -> Dict[str, Any]:
    """hf_zero.from_pretrained (a model on meta) sharded with no device given: the engine's placement chooses
    (engine/placement.py), then the same training as engine_run."""
    import hf_zero
    from transformers import AutoModelForCausalLM

    model = hf_zero.from_pretrained(AutoModelForCausalLM, folder, dtype=torch.float32)
    engine = hf_zero.shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-3), hf_zero.ZeroConfig(**options))
    for step in _batches(device):
        for j, x in enumerate(step):
            with engine.no_sync() if j < ACCUM - 1 else _null():
                engine.backward(engine.model(input_ids=x.to(engine.device), labels=x.to(engine.device)).loss / ACCUM)
        engine.clip_grad_norm_(1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    state = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
    out = {"state": state, "device": str(engine.device), "backend_config": dist.get_backend_config(),
           "collectives": sorted(engine.collectives)}
    engine.close()
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def compare(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], rtol: float) -> Dict[str, Any]:
    keys = [k for k in want if k in got]
    missing = sorted(set(want) - set(got))
    diffs = {k: float((got[k] - want[k]).abs().max()) for k in keys}
    scale = max(float(v.abs().max()) for v in want.values())
    worst = max(diffs, key=diffs.get)
    return {"max_abs": diffs[worst], "worst": worst, "scale": scale, "missing": missing,
            "ok": not missing and diffs[worst] <= rtol * scale}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, stage: int, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.use_deterministic_algorithms(True, warn_only=True)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = engine_run(torch.device("cuda", 0), rank, world, stage=stage)
        state = {k: v.numpy() for k, v in out["state"].items()} if rank == 0 else None  # no shared-memory fds
        queue.put((rank, "ok", state, out["collectives"]))
    except Exception:
        queue.put((rank, "error", traceback.format_exc()[-3000:], None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gloo_two_ranks(stage: int, want) -> Dict[str, Any]:
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, port, stage, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r for r in results if r[1] == "error"]
    if errors:
        return {"ok": False, "error": errors[0][2]}
    state = {k: torch.from_numpy(v) for k, v in next(r[2] for r in results if r[0] == 0).items()}
    return {**compare(state, want, 1e-5), "collectives": results[0][3]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write every case's result here")
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu: a smoke run of this script")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --device cpu for a smoke run)")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    import hf_zero
    rows: List[Dict[str, Any]] = []
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "hf_zero": hf_zero.__file__,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
    print(json.dumps(info), flush=True)

    def case(name: str, fn, rtol: float = 1e-5, want=None):
        t0 = time.perf_counter()
        try:
            got = fn()
            row = {"case": name, **compare(got.pop("state"), want, rtol), **got}
            if cuda and row.get("device", "cuda").split(":")[0] != "cuda":
                row.update(ok=False, error=f"the engine computed on {row['device']}, not the GPU")
        except Exception:
            row = {"case": name, "ok": False, "error": traceback.format_exc()[-3000:]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)

    fp32 = reference(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if cuda:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    for stage in range(4):
        case(f"nccl stage {stage} fp32", lambda s=stage: engine_run(device, stage=s), want=fp32)
    for policy in (True, False):
        case(f"nccl stage 3 reshard_after_forward={policy}",
             lambda p=policy: engine_run(device, stage=3, reshard_after_forward=p), want=fp32)
    case("nccl stage 3 + activation checkpointing", lambda: engine_run(device, ckpt=("on", False), stage=3),
         want=fp32)
    case("nccl stage 3 + checkpoints kept on CPU", lambda: engine_run(device, ckpt=("on", True), stage=3), want=fp32)
    # the host step (torch's fused CPU AdamW) rounds differently from the GPU's: a few ulps per step
    case("nccl stage 3 + offload optimizer and params", lambda: engine_run(
        device, stage=3, offload_optimizer="cpu", offload_params="cpu"), rtol=1e-4, want=fp32)
    case("nccl stage 2 + offload optimizer", lambda: engine_run(device, stage=2, offload_optimizer="cpu"),
         rtol=1e-4, want=fp32)
    bf16 = reference(device, bf16=True)
    for stage in (2, 3):  # bf16 rounding of the compute copy: both sides the same recipe, kernels may differ
        case(f"nccl stage {stage} bf16", lambda s=stage: engine_run(device, stage=s, mixed_precision="bf16"),
             rtol=1e-2, want=bf16)
    dist.destroy_process_group()

    os.environ.update(MASTER_PORT=str(_free_port()))
    dist.init_process_group(rank=0, world_size=1)  # no backend: torch picks one per device
    info["default_backend"] = str(dist.get_backend())
    case(f"default backend ({info['default_backend']}) stage 3", lambda: engine_run(device, stage=3), want=fp32)
    # a meta model loading into shards with no device given: under the default backend ("cpu:gloo,cuda:nccl",
    # which get_backend calls "undefined") it must land on the GPU (it landed on the CPU before engine/placement.py)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        _model().save_pretrained(folder)
        for stage in (0, 3):
            case(f"default backend, from_pretrained on meta, no device given, stage {stage}",
                 lambda s=stage: loaded_run(device, folder, stage=s), want=fp32)
    dist.destroy_process_group()

    for stage in (1, 2, 3) if cuda else ():
        t0 = time.perf_counter()
        row = {"case": f"2 gloo ranks on one GPU, stage {stage}", **gloo_two_ranks(stage, fp32)}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)

    summary = {"info": info, "passed": sum(r["ok"] for r in rows), "cases": len(rows),
               "failed": [r["case"] for r in rows if not r["ok"]]}
    print(json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
