"""What every bench system shares: the run's settings, one worker's context, and the Trainer interface a system
implements (runner.py runs them, trainers.py and deepspeed.py implement them)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional


@dataclass
class Settings:
    """Everything a worker needs (picklable)."""

    model_config: Dict[str, Any]
    model_name: str
    steps: int
    warmup: int
    batch_size: int
    seq_len: int
    grad_accum: int
    mixed_precision: str
    num_processes: int
    lr: float
    seed: int
    timeout_s: float
    threads_per_rank: int = 1
    ranks_per_host: Optional[int] = None  # --ranks-per-host: K of the hierarchical systems (None: the default)
    compile_backend: str = "inductor"  # --compile BACKEND (cli.py's default): what "<system>+compile" rows use
    profile_dir: Optional[str] = None  # --profile DIR: torch.profiler over the timed steps, a trace per rank there
    hosts: int = 1  # 2: the ranks in two namespace hosts (the checkout's benchmarks/two_hosts.py), half on each
    link_rate: Optional[str] = None  # its --link-rate: the rate of the link between those hosts (tc's units)

    @property
    def tokens_per_step(self) -> int:
        return self.num_processes * self.batch_size * self.seq_len * self.grad_accum


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    device: Any
    settings: Settings
    autocast: bool = True


class Trainer:
    """One system's training loop pieces on one rank."""

    def micro_step(self, input_ids, final: bool):
        """Forward and backward of one micro-batch (gradient sync only when `final`); returns the detached loss."""
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Before each step's first micro-batch (set to None), so the gradients exist when measured after the loop."""

    def state_bytes(self) -> int:
        raise NotImplementedError

    def comm_elements(self) -> Optional[Dict[str, float]]:
        """Cumulative elements sent per collective kind (paper counting), or None when not measured."""
        return None

    def comm_split(self) -> Optional[Dict[str, Dict[str, float]]]:
        """The same cumulative elements as {"intra": {kind: n}, "inter": {kind: n}} (a collective over a group that
        spans hosts is inter-host), or None when the system has no such ledger."""
        return None

    def comm_bytes_split(self) -> Optional[Dict[str, Dict[str, float]]]:
        """Cumulative bytes put on the wire as {"intra": {kind: bytes}, "inter": {kind: bytes}} (a quantizing
        strategy sends fewer bytes than its elements' dtype), or None when not measured."""
        return None

    def row_extras(self) -> Dict[str, Any]:
        """Extra fields for the system's row (rank 0's), e.g. a peer's version."""
        return {}

    def compile(self, backend: str) -> None:
        """torch.compile what micro_step calls, after the system has wrapped or sharded the model (the order a
        user's script has: prepare, then compile)."""
        import torch

        self.model = torch.compile(self.model, backend=backend)


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@contextlib.contextmanager
def extensions_dir(needed: bool) -> Iterator[None]:
    """A temporary TORCH_EXTENSIONS_DIR for the workers (inherited), unless the user set one: a peer that
    JIT-compiles an op must not fill ~/.cache; one folder for the whole run, so the systems share one build."""
    if not needed or os.environ.get("TORCH_EXTENSIONS_DIR"):
        yield
        return
    folder = tempfile.mkdtemp(prefix="hfz_bench_torch_extensions_")
    os.environ["TORCH_EXTENSIONS_DIR"] = folder
    try:
        yield
    finally:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)


def local_nbytes(t) -> int:
    """Bytes this rank holds of `t` (a DTensor's local shard; 0 for None)."""
    if t is None:
        return 0
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def init_worker_group(rank: int, world_size: int, port: int, threads: int, timeout_s: float,
                      master_addr: str = "127.0.0.1"):
    """A bench worker's process group (nccl on CUDA, else gloo) over a TCPStore on master_addr:port (hosted by the
    parent, or by host A's launcher in benchmarks/two_hosts.py); its device."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_addr, port, None, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return device


def write_json_line(path: str, settings: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    """The run as one JSON line ({"settings", "rows"}; NaN and inf become null) to `path`, or stdout for "-"."""
    import json
    import math

    import torch

    payload = {"settings": {**settings, "backend": "nccl" if torch.cuda.is_available() else "gloo",
                            "torch": torch.__version__},
               "rows": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                        for r in rows]}
    text = json.dumps(payload)
    if path == "-":
        print(text, flush=True)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
