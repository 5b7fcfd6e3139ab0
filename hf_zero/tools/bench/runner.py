"""hf-zero bench: train one causal LM under DDP, FSDP2, torch's ZeroRedundancyOptimizer, hf_zero stages 0-3 (and,
on request, its hierarchical options HSDP and hpZ and its two forms of collectives) and DeepSpeed ZeRO-1/2/3.

Every system runs in its own freshly spawned group of worker processes (gloo on CPU, nccl on CUDA), so peak memory
is per system. Each trains the same model (built from a config, dropout off, same seed) on the same deterministic
random tokens for `--warmup` untimed and `--steps` timed optimizer steps, and rank 0 reports, as the maximum over
ranks:

- tokens/s: global tokens (world x batch x seq-len x grad-accum per step) per second over the timed steps;
- model-state bytes per rank, measured (hf_zero: `engine.memory_stats()["model_states"]`; the torch systems: bytes of
  the parameter, .grad and optimizer-state tensors the rank holds, local shards for DTensors; DeepSpeed: the storages
  of its parameter, gradient, master and optimizer-state partitions, see deepspeed.py) beside the paper's
  formula (`hf_zero.tools.estimate.formulas.model_state_bytes`);
- peak memory per rank (CPU: VmHWM, the peak RSS; CUDA: torch.cuda.max_memory_allocated);
- elements communicated per step, measured (hf_zero: its collective ledger, data kinds only; DDP: a comm hook
  counting 2x each all-reduced bucket; DeepSpeed: every torch.distributed collective, scalars left out) beside the
  formula (`hf_zero.tools.estimate.formulas.comm_elements_per_step`; hf_zero's rows: `hierarchical_comm_elements`,
  with the root unit and the last block resident at stage 3); hf_zero's rows also split them into intra-host and inter-host, measured
  (the ledger) and by the formula for the hosts the run had (the bench runs on one host: everything intra).

The hierarchical systems (zero1-hsdp, zero2-hsdp, zero3-hsdp: `shard_group_size=K`; zero3-hpz:
`hpz_partition_size=K`) take K from `--ranks-per-host` (default N//2 for an even N >= 4; otherwise, or for a K that
is 1, N or no divisor of N, the row is skipped with the reason). They are not in `all` (four more worker groups);
`--systems hierarchical` runs the four.

The collectives systems (zero1-3-chunked, zero1-3-flat: `ZeroConfig.collectives`) run a stage with its
all-gathers and reduce-scatters issued per chunk (broadcasts and reduces, gloo's "auto") or flat
(all_gather_into_tensor / reduce_scatter_tensor, NCCL's "auto"), whatever the backend; not in `all`
either, `--systems collectives` runs the six, the two forms of each stage side by side.

ZeRO++'s quantized communication (zero3-qwz: quantized_weights="int8"; zero3-hpz-qwz: hpZ + int8 weights;
zero3-hpz-qwz-qgz: + quantized_gradients="int4"; zero2-qgz: int4 gradients at stage 2) and DeepSpeed's ZeRO++
(deepspeed_zero3-hpz: zero_hpz_partition_size=K; deepspeed_zero3-hpz-qwz-qgz: + zero_quantized_weights /
zero_quantized_gradients, skipped with the reason where its quantizer op does not load, as on CPU) are not in
`all`; `--systems zeropp` runs them with zero3, zero3-hsdp and deepspeed_zero3. Their rows also give the bytes on
the wire per step, intra- and inter-host: measured (hf_zero: the ledger per strategy, whose quantized strategies
book codes and scales; DeepSpeed: the collectives it calls, by whether their group spans hosts) and, for hf_zero,
by the formula (`formula_bytes_for_hosts`: elements x dtype bytes, or W x quantized_nbytes(P / W) for a quantized
all-gather / reduce-scatter of P elements over W ranks). Under the checkout's `python -m benchmarks.two_hosts
--link-rate R` (benchmarks/two_hosts.py, root) every system runs on two namespace hosts over a rate-limited link,
and rows say the rate.

Systems live in the SYSTEMS registry (systems.py: name -> SystemSpec, spec.py, with a builder); add peers there.
A peer from an optional extra (DeepSpeed: `pip install deepspeed`) that cannot be imported gets a row with status
"skipped" and the reason, never an error. The formulas a row is compared with are in formulas.py. This module
trains and measures one system on one rank (`train_worker`) and runs it (`run_system`: one spawned group of
workers), with the model presets and configs. The command line, the table and --json are in cli.py; `--plot
out.png` draws throughput and bytes per rank per system (plot.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .base import Settings, WorkerContext, init_worker_group
from .formulas import (RANKS_PER_HOST_FLAG, formula_bytes_for_hosts, formula_split_for_hosts, group_size,
                       resolve_group_size)
from .spawn import error_summary, run_group, worker_done, worker_failed
from .spec import Counts, Split, SystemSpec
from .systems import COMPILED, SYSTEMS, base_system
from ..presets import PRESETS

# what the bench's other modules and the tests import from here (the registry's and the formulas' names among them,
# re-exported)
__all__ = ["COMPILED", "DEFAULT_TIMEOUT_S", "PRESETS", "RANKS_PER_HOST_FLAG", "SYSTEMS", "base_system", "build_config",
           "load_model_config", "log", "max_positions", "resolve_group_size", "run_system", "skipped_row",
           "train_worker"]

DEFAULT_TIMEOUT_S = 1800




def log(msg: str) -> None:
    print(f"[hf-zero bench] {msg}", file=sys.stderr, flush=True)


def load_model_config(args: argparse.Namespace) -> Tuple[Dict[str, Any], str]:
    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
        if "model_type" not in cfg:
            raise ValueError(f"{args.config}: a config.json needs a model_type (e.g. \"gpt2\", \"llama\")")
        return cfg, os.path.abspath(args.config)
    return dict(PRESETS[args.preset]), args.preset


def build_config(model_config: Dict[str, Any]):
    """A transformers config from a dict, with every dropout probability set to 0 and the KV cache off."""
    from ...integrations.hf_models import config_from_dict, quiet

    quiet()
    config = config_from_dict(model_config)
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and not isinstance(value, bool) and (
                "dropout" in key or "pdrop" in key) and hasattr(config, key):
            setattr(config, key, 0.0)
    config.use_cache = False
    return config


def max_positions(config) -> Optional[int]:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# ====================================================================================================== worker
def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: kB


def _resident(model) -> int:
    """The elements hf_zero's stage 3 keeps gathered from the forward through the backward under the default
    reshard_after_forward ("auto"): the root unit (everything outside the repeated blocks; a weight tied across
    units counts there) and the last block. Unpadded, from the planner's pure layout on one rank."""
    from ... import ZeroConfig
    from ...engine.planning import plan_model

    plan = plan_model(model, 1, ZeroConfig(stage=3))
    return sum(plan.groups[i].numel for i in plan.resident_groups())


def _per_step(after: Dict[str, float], before: Optional[Dict[str, float]], steps: int) -> Dict[str, float]:
    """The timed steps' elements per step, kinds that sent nothing left out."""
    out = {k: (v - (before or {}).get(k, 0)) / steps for k, v in after.items()}
    return {k: v for k, v in out.items() if v}


def _max_by_kind(per_rank: List[Dict[str, float]]) -> Dict[str, float]:
    return {k: max(r.get(k, 0) for r in per_rank) for r in per_rank for k in r}


def _host_size(hosts: List[str]) -> Optional[int]:
    """Ranks per host when every host ran as many (consecutive blocks or not: the split formulas only need K)."""
    counts = {h: hosts.count(h) for h in hosts}
    return next(iter(counts.values())) if len(set(counts.values())) == 1 else None


def _split_fields(everyone: List[Dict[str, Any]], formula: Optional[Split], key: str = "comm_split",
                  what: str = "elements") -> Dict[str, Any]:
    """The row's intra/inter-host fields of `what` (elements; bytes from `comm_bytes_split`): measured (max over
    ranks) and the formula's split for the run's hosts."""
    out: Dict[str, Any] = {}
    if all(r.get(key) is not None for r in everyone):
        by_kind = {w: _max_by_kind([r[key][w] for r in everyone]) for w in ("intra", "inter")}
        out[f"comm_{what}_measured_split_by_kind"] = by_kind
        for w in ("intra", "inter"):
            out[f"comm_{what}_measured_{w}"] = max(sum(r[key][w].values()) for r in everyone)
    if formula is not None:
        out[f"comm_{what}_formula_split_by_kind"] = formula
        for w in ("intra", "inter"):
            out[f"comm_{what}_formula_{w}"] = sum(formula[w].values())
    return out


def _link_tx_bytes() -> Optional[int]:
    """Bytes this host has sent over its end of the link so far (the kernel's counter of GLOO_SOCKET_IFNAME, one
    interface: the namespace hosts' veth end), or None where there is no such single interface."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not ifname or "," in ifname or "/" in ifname:
        return None
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _link_fields(everyone: List[Dict[str, Any]], steps: int) -> Dict[str, Any]:
    """What really crossed the link per step: each host's transmitted bytes over the timed steps (the kernel's
    counter of its veth end, headers included; the widest window its ranks saw), summed over the hosts, so both
    directions. Unlike the ledger's per-rank count this depends on gloo's algorithms and on how many of a
    host's ranks receive the same data."""
    per_host: Dict[str, List[int]] = {}
    for r in everyone:
        if r.get("link_tx") is None:
            return {}
        before, after = r["link_tx"]
        lo_hi = per_host.setdefault(r["host"], [before, after])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], before), max(lo_hi[1], after)
    by_host = {h: (hi - lo) / steps for h, (lo, hi) in per_host.items()}
    return {"link_bytes_per_step": sum(by_host.values()), "link_bytes_per_step_by_host": by_host}


def _hierarchical_fields(spec: SystemSpec, counts: Counts, settings: Settings, recipe) -> Dict[str, Any]:
    """hf_zero rows: the option and its K; hpZ: the secondary shard's formula, P (Ψ' - r) / K bytes (not a model
    state: it lives from a unit's forward to its backward)."""
    k = group_size(spec.option, settings)
    out: Dict[str, Any] = {"option": spec.option, "group_size": k}
    if spec.option == "hpz":
        out["hpz_secondary_formula_bytes"] = recipe.param * (counts.psi + counts.frozen - counts.resident) / k
    return out


def _train(system: str, ctx: WorkerContext) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from ...integrations.hf_models import causal_lm_from_config, quiet
    from ..estimate.formulas import model_state_bytes

    quiet()
    s = ctx.settings
    base, compiled = base_system(system)
    spec = SYSTEMS[base]
    config = build_config(s.model_config)
    torch.manual_seed(s.seed)  # every rank and every system starts from the same weights
    model = causal_lm_from_config(config).to(ctx.device)
    model.train()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)  # distinct tensors: tied weights once
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # counted apart (never reduced)
    counts = Counts(psi, frozen, _resident(model), ctx.world_size)
    vocab = int(config.vocab_size)

    gen = torch.Generator().manual_seed(s.seed * 1000 + ctx.rank)  # each rank its own slice of the data
    n_micro = (s.warmup + s.steps) * s.grad_accum
    data = torch.randint(0, vocab, (n_micro, s.batch_size, s.seq_len), generator=gen).to(ctx.device)

    trainer = spec.build(model, ctx)
    if compiled:
        import torch._dynamo

        torch._dynamo.reset()
        trainer.compile(s.compile_backend)

    def sync() -> None:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    batch_iter = iter(data)
    losses: List[float] = []

    def one_step() -> None:
        trainer.zero_grad()
        loss = None
        for i in range(s.grad_accum):
            loss = trainer.micro_step(next(batch_iter), final=(i == s.grad_accum - 1))
        trainer.optimizer_step()
        losses.append(float(loss))

    for _ in range(s.warmup):
        one_step()
    sync()
    dist.barrier()
    tx_before = _link_tx_bytes() if s.hosts > 1 else None
    comm_before, split_before, bytes_before = trainer.comm_elements(), trainer.comm_split(), trainer.comm_bytes_split()
    with _profiled(s.profile_dir, system, ctx) as phases:
        t0 = time.perf_counter()
        for _ in range(s.steps):
            one_step()
        sync()
        elapsed = time.perf_counter() - t0
    tx_after = None
    if tx_before is not None:
        dist.barrier()  # every rank's timed collectives are on the wire
        tx_after = _link_tx_bytes()
    comm_after, split_after, bytes_after = trainer.comm_elements(), trainer.comm_split(), trainer.comm_bytes_split()
    comm = None if comm_after is None else _per_step(comm_after, comm_before, s.steps)
    split = None if split_after is None else {
        w: _per_step(split_after[w], (split_before or {}).get(w), s.steps) for w in ("intra", "inter")}
    split_bytes = None if bytes_after is None else {
        w: _per_step(bytes_after[w], (bytes_before or {}).get(w), s.steps) for w in ("intra", "inter")}

    mine = {"elapsed": elapsed, "state_bytes": trainer.state_bytes(), "peak_bytes": _peak_bytes(ctx.device),
            "comm": comm, "comm_split": split, "comm_bytes_split": split_bytes, "host": socket.gethostname(),
            "link_tx": None if tx_after is None else (tx_before, tx_after),
            "loss": losses[-1] if losses else float("nan")}
    everyone: List[Dict[str, Any]] = [None] * ctx.world_size  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)

    recipe = spec.recipe(s)
    comm_formula = spec.comm_formula(counts, s)
    comm_measured = None
    if all(r["comm"] is not None for r in everyone):
        comm_measured = max(sum(r["comm"].values()) for r in everyone)
        comm_by_kind = _max_by_kind([r["comm"] for r in everyone])
    else:
        comm_by_kind = None
    hosts = [r["host"] for r in everyone]
    # The hosts the run had (host_size: ranks on each), which the formula's intra/inter split is for.
    extra: Dict[str, Any] = {"num_hosts": len(set(hosts)), "host_size": _host_size(hosts)}
    if spec.hf_zero:
        formula_split = formula_split_for_hosts(spec, counts, s, extra["host_size"])
        extra.update(_split_fields(everyone, formula_split), **_hierarchical_fields(spec, counts, s, recipe))
        extra.update(_split_fields(everyone, formula_bytes_for_hosts(spec, counts, s, extra["host_size"]),
                                   "comm_bytes_split", "bytes"))
        if spec.options:
            extra["zero_options"] = dict(spec.options)
    elif any(r.get("comm_bytes_split") is not None for r in everyone):  # a peer that books bytes per host
        extra.update(_split_fields(everyone, None, "comm_bytes_split", "bytes"))
    if s.hosts > 1:
        extra.update(link_rate=s.link_rate, hosts_requested=s.hosts, **_link_fields(everyone, s.steps))
    # HSDP partitions the model states K ways; hpZ's secondary shard is not a model state (plain stage 3 over N).
    state_n = group_size(spec.option, s) if spec.option == "hsdp" else ctx.world_size
    elapsed_max = max(r["elapsed"] for r in everyone)
    return {
        "system": system,
        "status": "ok",
        "hf_zero": spec.hf_zero,
        "psi": psi,
        "psi_frozen": frozen,
        "psi_resident": counts.resident,
        "world_size": ctx.world_size,
        "elapsed_s": elapsed_max,
        "tokens_per_s": s.tokens_per_step * s.steps / elapsed_max if elapsed_max > 0 else float("inf"),
        "steps_per_s": s.steps / elapsed_max if elapsed_max > 0 else float("inf"),
        "state_bytes_measured": max(r["state_bytes"] for r in everyone),
        "state_bytes_formula": model_state_bytes(psi, state_n, spec.state_stage, recipe, frozen),
        "state_formula": {"stage": spec.state_stage, "partition": state_n, "recipe": asdict(recipe)},
        "peak_bytes": max(r["peak_bytes"] for r in everyone),
        "peak_kind": "cuda_max_memory_allocated" if ctx.device.type == "cuda" else "VmHWM",
        "comm_elements_measured": comm_measured,
        "comm_elements_measured_by_kind": comm_by_kind,
        "comm_elements_formula": sum(comm_formula.values()),
        "comm_elements_formula_by_kind": comm_formula,
        "loss_last_step": max(r["loss"] for r in everyone),
        "note": spec.note,
        **extra,
        **trainer.row_extras(),
        **(_compile_fields(s.compile_backend) if compiled else {}),
        **({"phases_ms_per_step": {k: v / s.steps for k, v in phases.items()}, "step_ms": elapsed * 1e3 / s.steps}
           if s.profile_dir else {}),
    }


@contextlib.contextmanager
def _profiled(profile_dir: Optional[str], system: str, ctx: "WorkerContext") -> Iterator[Dict[str, float]]:
    """--profile: torch.profiler around the timed steps; a Chrome trace per rank in `profile_dir`, and the dict
    filled afterwards with the total milliseconds of each `hf_zero.*` range (engine/profiling.py) on this rank."""
    phases: Dict[str, float] = {}
    if profile_dir is None:
        yield phases
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield phases
    os.makedirs(profile_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(profile_dir, f"{system}-rank{ctx.rank}.json"))
    for event in prof.key_averages():
        if event.key.startswith("hf_zero."):
            phases[event.key] = event.cpu_time_total / 1e3  # microseconds -> ms
    ordered = sorted(phases.items())
    phases.clear()
    phases.update(ordered)


def _compile_fields(backend: str) -> Dict[str, Any]:
    """How dynamo split the compiled model on this rank: graph breaks (with their reasons) and graphs compiled."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return {"compile_backend": backend, "graph_breaks": int(sum(breaks.values())),
            "graph_break_reasons": {k[:200]: int(v) for k, v in breaks.items()},
            "graphs_compiled": int(counters["stats"].get("unique_graphs", 0))}


def train_worker(rank: int, world_size: int, port: int, system: str, settings: Settings, out_dir: str,
                 master_addr: str = "127.0.0.1") -> None:
    """One rank of one system (a spawned process): join the group over the store at master_addr:port, train and
    measure; rank 0 writes the row to `out_dir`, a failing rank its traceback (spawn.py)."""
    try:
        device = init_worker_group(rank, world_size, port, settings.threads_per_rank, settings.timeout_s,
                                   master_addr)
        ctx = WorkerContext(rank, world_size, device, settings)
        result = _train(system, ctx)
    except BaseException:
        worker_failed(rank, out_dir)
    worker_done(rank, out_dir, result)


# ====================================================================================================== parent
def run_system(system: str, settings: Settings) -> Dict[str, Any]:
    """Spawn `settings.num_processes` workers for one system and return rank 0's row (or an error row)."""
    world = settings.num_processes
    row, error = run_group(train_worker, lambda rank, port, out_dir: (rank, world, port, system, settings, out_dir),
                           world, settings.timeout_s, settings.threads_per_rank, f"hfz_bench_{system}_")
    if row is None:
        row = {"system": system, "status": "error: " + error_summary(error), "error": error,
               "hf_zero": SYSTEMS[base_system(system)[0]].hf_zero}
    return row


def skipped_row(system: str, reason: str) -> Dict[str, Any]:
    """The row of a system that did not run here (an optional peer that is not installed)."""
    spec = SYSTEMS[base_system(system)[0]]
    return {"system": system, "status": "skipped", "reason": reason, "hf_zero": spec.hf_zero, "note": spec.note}
