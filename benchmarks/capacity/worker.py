"""The rank side of a trial (`python -m benchmarks.capacity --worker JOB --rank R`): join the group, read
the runtime footprint, build the system (trainers.py), train the job's steps, and report each rank's peak RSS,
model states and step times to rank 0's result file (spawn.py's worker_done / worker_failed)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from hf_zero.tools.bench.base import Settings, Trainer, WorkerContext, init_worker_group
from hf_zero.tools.bench.load import read_status
from hf_zero.tools.bench.spawn import worker_done, worker_failed

from .cgroups import own_cgroup_usage
from .systems import SYSTEMS
from .trainers import build_trainer
from .units import GIB


def _comm(trainer: Trainer) -> Optional[Tuple[int, int]]:
    """hf_zero's ledger so far: (elements, paper counting; bytes on the wire, each collectives strategy's own: a
    quantizing strategy books its codes and scales), data collectives only; None for the peers."""
    engine = getattr(trainer, "engine", None)
    if engine is None or not hasattr(engine, "comm_stats_by_strategy"):
        return None
    elements = int(engine.comm_stats()["total"]["elements"])
    wire = sum(int(kinds["total"]["bytes"]) for kinds in engine.comm_stats_by_strategy().values())
    return elements, wire


def _train_one(job: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """One rank of one trial: join the group, build the system's model, train job["steps"] steps, report."""
    system = SYSTEMS[job["system"]]
    if system.family == "deepspeed":
        from hf_zero.tools.bench.deepspeed import prepare_process

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    from hf_zero.integrations.hf_models import quiet

    quiet()
    if job["mode"] == "lora":
        import peft  # noqa: F401  (imported before the runtime footprint is read)
    device = init_worker_group(rank, job["world"], job["port"], job["threads"], job["timeout_s"])
    settings = Settings(model_config=job["model_config"], model_name=f"capacity-{job['layers']}", steps=job["steps"],
                        warmup=0, batch_size=job["batch_size"], seq_len=job["seq_len"], grad_accum=1,
                        mixed_precision="bf16" if (system.family == "deepspeed" and job["dtype"] == "bf16") else "no",
                        num_processes=job["world"], lr=job["lr"], seed=job["seed"], timeout_s=job["timeout_s"],
                        threads_per_rank=job["threads"])
    ctx = WorkerContext(rank, job["world"], device, settings)
    if system.family == "deepspeed":
        prepare_process(ctx)
        import deepspeed  # noqa: F401
    runtime = read_status()["VmRSS"]  # the interpreter, torch, the libraries and the process group: no model yet
    runtime_charged = own_cgroup_usage() if job.get("cgroup_per_rank") else None  # what the limit counts of it
    t0 = time.perf_counter()
    trainer = build_trainer(job, ctx)
    build_s = time.perf_counter() - t0
    after_build = read_status()
    print(f"[capacity rank {rank}] built in {build_s:.1f}s, RSS {after_build['VmRSS'] / GIB:.2f} GiB, peak "
          f"{after_build['VmHWM'] / GIB:.2f} GiB", file=sys.stderr, flush=True)
    vocab = int(job["model_config"]["vocab_size"])
    gen = torch.Generator().manual_seed(int(job["seed"]) * 1000 + rank)
    data = torch.randint(0, vocab, (job["steps"], job["batch_size"], job["seq_len"]), generator=gen)
    steps: List[Dict[str, Any]] = []
    for i in range(job["steps"]):
        before = _comm(trainer)
        t = time.perf_counter()
        trainer.zero_grad()
        loss = trainer.micro_step(data[i].to(device), final=True)
        trainer.optimizer_step()
        seconds = time.perf_counter() - t
        after = _comm(trainer)
        steps.append({"seconds": seconds, "loss": float(loss),
                      "comm_elements": None if before is None else after[0] - before[0],
                      "comm_bytes": None if before is None else after[1] - before[1]})
        print(f"[capacity rank {rank}] step {i}: {seconds:.1f}s, loss {float(loss):.3f}, peak RSS "
              f"{read_status()['VmHWM'] / GIB:.2f} GiB", file=sys.stderr, flush=True)
    mine: Dict[str, Any] = {"rank": rank, "runtime_rss": runtime, "runtime_charged": runtime_charged,
                            "build_s": build_s,
                            "rss_after_build": after_build["VmRSS"], "peak_rss": read_status()["VmHWM"],
                            "state_bytes": trainer.state_bytes(), "steps": steps}
    engine = getattr(trainer, "engine", None)
    if system.family == "hf_zero":
        mine["memory_stats"] = {k: int(v) for k, v in engine.memory_stats().items()}
        mine["comm_stats_total"] = {k: int(v) for k, v in engine.comm_stats()["total"].items()}
        mine["psi"] = int(engine.plan.num_trainable)
    everyone: List[Any] = [None] * job["world"]
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def worker_main(job_path: str, rank: int) -> None:
    """A rank process (`python -m benchmarks.capacity --worker JOB --rank R`)."""
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = _train_one(job, rank)
    except BaseException:
        worker_failed(rank, job["out_dir"])  # writes the traceback and exits 1
        raise
    worker_done(rank, job["out_dir"], result)

