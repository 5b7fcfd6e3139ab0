"""One trial: one size of one system in one mode on N ranks, run under the budget (`run_trial`: the job file, the
ranks launched through `run_ranks`) and how it ended (`Trial`: fits, OOM-killed, over, timeout, refused,
unsupported, error)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hf_zero.tools.bench.spawn import error_summary, first_error

from ..procs import ROOT
from .budget import run_ranks
from .cgroups import CgroupSupport
from .systems import SYSTEMS, parse_system
from .weights import RandomCheckpoint, model_config


@dataclass
class RunOptions:
    """What every trial of a run shares (the command line's values)."""

    shape: Dict[str, int]
    budget: int
    steps: int = 2
    seq_len: int = 16
    batch_size: int = 1
    lora_rank: int = 8
    lr: float = 1e-4
    seed: int = 0
    threads: int = 1
    timeout_s: float = 600.0
    cgroups: str = "per-rank"
    support: Optional[CgroupSupport] = None
    workdir: str = ""
    malloc_mmap_threshold: Optional[int] = None  # glibc's MALLOC_MMAP_THRESHOLD_ in the ranks (None: glibc's own)


@dataclass
class Trial:
    """One size of one system under the budget."""

    system: str
    mode: str
    world: int
    layers: int
    status: str  # "fits", "oom" (killed for going over), "over" (unenforced: peak above the budget), "timeout",
    # "refused" (a rank raised out of memory), "unsupported" (the system cannot run here: the error says why), "error"
    wall_s: float
    enforcement: str
    peak_rss: Optional[int] = None  # max over ranks of VmHWM
    cgroup_peak: Optional[int] = None  # max over ranks of the cgroup's max usage
    runtime_rss: Optional[int] = None  # max over ranks: RSS before the model was built
    runtime_charged: Optional[int] = None  # max over ranks: the rank's cgroup usage then (per-rank cgroups only)
    state_bytes: Optional[int] = None  # max over ranks, as the system counts its model states
    step_s: Optional[float] = None  # the last step's seconds (max over ranks)
    comm_bytes: Optional[int] = None  # the last step's bytes on the wire (hf_zero's ledger, max over ranks)
    comm_elements: Optional[int] = None  # the same step's elements, paper counting
    oom_ranks: List[int] = field(default_factory=list)
    error: Optional[str] = None
    ranks: Optional[List[Dict[str, Any]]] = None
    reached: List[str] = field(default_factory=list)  # per rank: how far it got ("building the model", "in step 1")

    @property
    def fits(self) -> bool:
        return self.status == "fits"


def _progress(out_dir: str, world: int) -> List[str]:
    """How far each rank got, from the markers the worker prints: "building the model" (not built yet), "in step k"
    (built, k - 1 steps done)."""
    out = []
    for r in range(world):
        text = ""
        with contextlib.suppress(OSError), open(os.path.join(out_dir, f"rank{r}.log"), "rb") as f:
            text = f.read().decode(errors="replace")
        marks = [line for line in text.splitlines() if line.startswith(f"[capacity rank {r}]")]
        steps = sum(1 for m in marks if " step " in m)
        out.append("building the model" if not any(" built in " in m for m in marks) else f"in step {steps + 1}")
    return out


# A rank that raised one of these ran out of memory (the size does not fit) ...
_OUT_OF_MEMORY = ("MemoryError", "out of memory")
# ... or met something the system cannot do on this machine at any size (the search stops there).
_UNSUPPORTED = ("NotImplementedError", "not supported", "not compiled", "Builder", "op_builder", "CUDA", "cuda")


def run_trial(name: str, mode: str, world: int, layers: int, opts: RunOptions,
              checkpoint: Optional[RandomCheckpoint]) -> Trial:
    """Run `name` (system[:dtype]) at `layers` layers on `world` ranks under the budget; how it ended."""
    import datetime

    import torch.distributed as dist

    system_name, dtype = parse_system(name)
    system = SYSTEMS[system_name]
    out_dir = tempfile.mkdtemp(prefix="hfz_capacity_", dir=opts.workdir or None)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=opts.timeout_s))
    job = {"system": system_name, "dtype": dtype, "mode": mode, "layers": layers, "world": world,
           "model_config": model_config(opts.shape, layers), "port": store.port, "steps": opts.steps,
           "seq_len": opts.seq_len, "batch_size": opts.batch_size, "lora_rank": opts.lora_rank, "lr": opts.lr,
           "seed": opts.seed, "threads": opts.threads, "timeout_s": opts.timeout_s, "out_dir": out_dir,
           "weights": checkpoint.folder(layers) if system.family == "hf_zero" else None,
           "cgroup_per_rank": opts.cgroups == "per-rank"}
    job_path = os.path.join(out_dir, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    argvs = [[sys.executable, "-m", "benchmarks.capacity", "--worker", job_path, "--rank", str(r)]
             for r in range(world)]
    # the ranks run `python -m benchmarks.capacity`: the checkout's root on their path, whatever the working directory
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env = {"OMP_NUM_THREADS": str(opts.threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(path)}
    if opts.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(opts.malloc_mmap_threshold)
    if system.family == "deepspeed":
        env["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
    try:
        outcome = run_ranks(argvs, opts.budget, opts.timeout_s, cgroups=opts.cgroups, support=opts.support,
                            env=env, log_dir=out_dir)
        del store
        trial = Trial(name, mode, world, layers, "error", outcome.wall_s, outcome.enforcement,
                      oom_ranks=outcome.oom_ranks, reached=_progress(out_dir, world))
        peaks = [p for p in outcome.cgroup_peaks if p is not None]
        trial.cgroup_peak = max(peaks) if peaks else None
        result_path = os.path.join(out_dir, "result.json")
        if outcome.status == "ok" and os.path.exists(result_path):
            with open(result_path) as f:
                ranks = json.load(f)["ranks"]
            trial.ranks = ranks
            trial.peak_rss = max(r["peak_rss"] for r in ranks)
            trial.runtime_rss = max(r["runtime_rss"] for r in ranks)
            charged = [r.get("runtime_charged") for r in ranks]
            trial.runtime_charged = max(charged) if all(c is not None for c in charged) else None
            trial.state_bytes = max(r["state_bytes"] for r in ranks)
            trial.step_s = max(r["steps"][-1]["seconds"] for r in ranks)
            comm = [r["steps"][-1]["comm_bytes"] for r in ranks]
            trial.comm_bytes = max(comm) if all(c is not None for c in comm) else None
            elements = [r["steps"][-1]["comm_elements"] for r in ranks]
            trial.comm_elements = max(elements) if all(c is not None for c in elements) else None
            trial.status = "fits" if (opts.cgroups != "off" or trial.peak_rss <= opts.budget) else "over"
        elif outcome.status == "oom":
            trial.status = "oom"
            where = "; ".join(f"rank {r} {trial.reached[r]}" for r in outcome.oom_ranks)
            trial.error = f"OOM-killed by the kernel ({where}; {outcome.enforcement})"
        elif outcome.status == "timeout":
            trial.status = "timeout"
            trial.error = f"did not finish within {opts.timeout_s:.0f}s"
        else:
            error = first_error(out_dir, world)
            if error is None:
                tail = ""
                for r in range(world):
                    with contextlib.suppress(OSError), open(os.path.join(out_dir, f"rank{r}.log"), "rb") as f:
                        tail += f"rank {r}: " + f.read()[-1500:].decode(errors="replace") + "\n"
                error = f"exit codes {outcome.exit_codes}\n{tail}"
            trial.error = error
            raised = error_summary(error)  # the exception itself: a traceback's file paths name torch/cuda too
            if any(s in raised for s in _OUT_OF_MEMORY):
                trial.status = "refused"
            elif any(s in raised for s in _UNSUPPORTED):
                trial.status = "unsupported"
            else:
                trial.status = "error"
        return trial
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)

