"""`hf-zero bench --lockstep`: the systems side by side in one process group, interleaved step by step.

The default bench runs one system after another, each in its own processes, so a ratio between two rows includes
whatever the machine did in between: on a shared 2-core host the same system moves by ~5 points from one run to
the next, more than the per-step overheads it is meant to show. Here every system is built in the same ranks from
the same weights and sees the same batches; each timed round runs one step of every system, in an order that
rotates with the round, each step between two barriers. A system's time is the median of its steps, and its ratio
to DDP the median over rounds of DDP's step time over its own in that round, which cancels drift slower than a
round.

Every system's model lives in every rank at once: this is for small models (the gpt2-5m preset). DeepSpeed's
systems are left out (DeepSpeed keeps process-wide state, its comm backend and accelerator: one engine per
process), as are --compile, --profile, --plot and the two-host bench (benchmarks/two_hosts.py).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Dict, List, Optional

from .base import Settings, WorkerContext, init_worker_group
from .runner import build_config
from .spawn import error_summary, run_group, worker_done, worker_failed
from .systems import SYSTEMS, base_system

BASELINE = "ddp"


def unsupported(system: str) -> Optional[str]:
    """Why `system` cannot run interleaved with others, or None."""
    base, compiled = base_system(system)
    if compiled:
        return "--compile rows are not interleaved (each compiles its own graphs)"
    if base.startswith("deepspeed"):
        return "DeepSpeed keeps process-wide state (one engine per process): run it without --lockstep"
    return None


def _quantiles(values: List[float]) -> Dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"p25": q[0], "median": statistics.median(values), "p75": q[2]}


def _worker(rank: int, world: int, port: int, systems: List[str], settings: Settings, out_dir: str) -> None:
    try:
        import torch
        import torch.distributed as dist

        from ...integrations.hf_models import causal_lm_from_config, quiet

        quiet()
        device = init_worker_group(rank, world, port, settings.threads_per_rank, settings.timeout_s)
        s = settings
        config = build_config(s.model_config)
        gen = torch.Generator().manual_seed(s.seed * 1000 + rank)  # each rank its own slice of the data
        rounds = s.warmup + s.steps
        data = torch.randint(0, int(config.vocab_size), (rounds, s.grad_accum, s.batch_size, s.seq_len),
                             generator=gen).to(device)
        trainers = {}
        for name in systems:
            torch.manual_seed(s.seed)  # every system starts from the same weights
            model = causal_lm_from_config(config).to(device)
            model.train()
            ctx = WorkerContext(rank, world, device, dataclasses.replace(s))  # a trainer may change its context
            trainers[name] = SYSTEMS[name].build(model, ctx)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        losses: Dict[str, List[float]] = {name: [] for name in systems}
        times: Dict[str, List[float]] = {name: [] for name in systems}
        for r in range(rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for name in order:
                trainer = trainers[name]
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                trainer.zero_grad()
                loss = None
                for i in range(s.grad_accum):
                    loss = trainer.micro_step(data[r, i], final=(i == s.grad_accum - 1))
                trainer.optimizer_step()
                sync()
                dist.barrier()
                if r >= s.warmup:
                    times[name].append(time.perf_counter() - t0)
                losses[name].append(float(loss))
        worker_done(rank, out_dir, {"times": times, "losses": losses})
    except BaseException:
        worker_failed(rank, out_dir)


def run_lockstep(systems: List[str], settings: Settings) -> List[Dict[str, Any]]:
    """Spawn the ranks once, interleave `systems` (DDP added first when missing) and return a row per system:
    median and quartile ms per step, `x_ddp` (the median of the per-round ratios), the step losses; an error row
    for every system when the run failed."""
    if BASELINE not in systems:
        systems = [BASELINE, *systems]
    world = settings.num_processes
    result, error = run_group(_worker, lambda rank, port, out_dir: (rank, world, port, systems, settings, out_dir),
                              world, settings.timeout_s, settings.threads_per_rank, "hfz_bench_lockstep_")
    if result is None:
        return [{"system": name, "status": "error: " + error_summary(error), "error": error,
                 "hf_zero": SYSTEMS[name].hf_zero} for name in systems]
    base = result["times"][BASELINE]
    rows = []
    for name in systems:
        own = result["times"][name]
        q = _quantiles([t * 1e3 for t in own])
        rows.append({"system": name, "status": "ok", "hf_zero": SYSTEMS[name].hf_zero,
                     "step_ms_median": q["median"], "step_ms_p25": q["p25"], "step_ms_p75": q["p75"],
                     "x_ddp": statistics.median(b / t for b, t in zip(base, own)),
                     "steps_per_s": 1e3 / q["median"], "losses": result["losses"][name]})
    return rows


def format_lockstep_table(rows: List[Dict[str, Any]]) -> str:
    """The rows as a text table: ms per step (median and quartiles) and x DDP."""
    header = f"{'system':<16} {'ms/step':>9} {'p25-p75':>15} {'x DDP':>6}  status"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['system']:<16} {'':>9} {'':>15} {'':>6}  {r['status']}")
            continue
        quartiles = f"{r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f}"
        lines.append(f"{r['system']:<16} {r['step_ms_median']:>9.1f} {quartiles:>15} {r['x_ddp']:>6.3f}  ok")
    return "\n".join(lines)
