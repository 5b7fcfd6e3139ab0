"""`hf-zero bench --load`: from a folder `save_pretrained` wrote to a sharded model ready to train, per system.

The model (a preset or `--config`, seeded) is saved once with `save_pretrained(folder, max_shard_size=...)` into
several safetensors files (in a spawned process, so the parent stays small), or `--load-folder` names an existing
folder. Then every system runs in its own freshly spawned group of workers (gloo on CPU) and each rank:

1. imports everything its system needs, builds the process group (and DeepSpeed's, FSDP2's mesh) and builds the
   model once on the meta device (imports the modeling code): none of that is counted;
2. reads VmRSS (the baseline), resets its peak RSS (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0), starts
   the clock after a barrier;
3. loads: the folder -> a sharded model and its optimizer ("ready to train": sharded, AdamW built, no step);
4. stops the clock after a barrier (every rank ready) and reads VmHWM (the peak RSS while loading) and VmRSS,
   then VmRSS again after glibc's `malloc_trim(0)` ("live after": what is still allocated; without the trim,
   glibc keeps freed chunks of up to 32 MiB in its heap, which VmRSS and VmHWM count);
5. then, untimed: checks the loaded weights against the files (rank 0 compares every tensor of the files with
   the gathered model) and the buffers against a freshly built model's.

`--malloc-mmap-threshold BYTES` sets glibc's MALLOC_MMAP_THRESHOLD_ in the workers: buffers of at least BYTES are
then mmap'd and given back when freed, so the peak is the live peak rather than glibc's retention.

The systems:

- hf_zero stages 0-3: `hf_zero.from_pretrained(AutoModelForCausalLM, folder, torch_dtype=float32)` (parameters
  on meta) + `shard_model(model, AdamW, ZeroConfig(stage=k))`: stage 3 reads only the rank's byte ranges,
  stages 0-2 one flat group at a time (every rank ends with a full copy);
- fsdp2, the torchtitan way: the model built under `torch.device("meta")`, `fully_shard` on each decoder layer
  and the root, `to_empty(device)`, the non-persistent buffers recomputed (rotary `inv_freq` and
  `original_inv_freq` with the module's own rope function, as Transformers' `_init_weights` does), then
  `set_model_state_dict(model, full_sd, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`
  where only rank 0 reads the safetensors files (the other ranks pass {}); tied names (GPT-2's lm_head) are
  filled in on rank 0 from the tensor the files hold under the other name;
- deepspeed_zero3: Transformers' own path, `HfDeepSpeedConfig(ds_config)` alive (so `is_deepspeed_zero3_enabled`)
  then `AutoModelForCausalLM.from_pretrained(folder)`: the model is built under `deepspeed.zero.Init`, rank 0
  reads the files and every module's parameters are loaded under `GatheredParameters(modifier_rank=0)`; then
  `deepspeed.initialize(model, AdamW, ds_config)`. deepspeed_zero1/2: plain `from_pretrained` on every rank, then
  `deepspeed.initialize`. The config is the training bench's (`deepspeed.deepspeed_config`).

Reported per system (maximum over ranks unless said): wall seconds, peak RSS (VmHWM after), RSS above the
baseline (VmHWM after - VmRSS before), model-state bytes per rank (hf_zero: `memory_stats()["model_states"]`;
FSDP2: local shards of parameters, .grad and optimizer states; DeepSpeed: deepspeed.model_state_bytes),
parameter bytes per rank, and for hf_zero the rank's shard bytes and the largest unit's bytes
(`plan.largest_unit_numel()`), so "peak above baseline <= model states + largest unit" can be read off at stage 3
(hf_zero's model states before the first step are the parameter shard and the zeroed gradient shard, which
shard_model allocates; the fp32 master is the shard itself; Adam's states come with the first step).

The peers need Transformers' own loading path (`AutoModelForCausalLM`, `HfDeepSpeedConfig`): load_systems.py
reaches it through integrations/hf_models.py.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from .base import Settings, WorkerContext, cpu_count, extensions_dir, init_worker_group, write_json_line
from .load_systems import DeepSpeedLoad, FSDP2Load, HfZeroLoad, Loaded, LoadJob, weight_files
from .runner import build_config, load_model_config, log
from .spawn import error_summary, first_error, spawn, worker_done, worker_failed
from ..presets import LOAD_PRESETS


HF_ZERO_LOAD = {f"zero{k}": k for k in range(4)}
DEEPSPEED_LOAD = {f"deepspeed_zero{k}": k for k in range(1, 4)}
LOAD_SYSTEMS: Dict[str, str] = {
    **{name: f"hf_zero.from_pretrained (meta) + shard_model(AdamW, stage {k})" for name, k in HF_ZERO_LOAD.items()},
    "fsdp2": "meta model, fully_shard(layers, root), to_empty, buffers recomputed, set_model_state_dict("
             "full_state_dict, broadcast_from_rank0): rank 0 reads the files",
    "deepspeed_zero1": "transformers from_pretrained on every rank + deepspeed.initialize(AdamW, stage 1)",
    "deepspeed_zero2": "transformers from_pretrained on every rank + deepspeed.initialize(AdamW, stage 2)",
    "deepspeed_zero3": "HfDeepSpeedConfig + transformers from_pretrained (zero.Init, rank 0 reads, "
                       "GatheredParameters(modifier_rank=0) per module) + deepspeed.initialize(AdamW)",
}
DEFAULT_LOAD_SYSTEMS = ("zero0", "zero1", "zero2", "zero3", "fsdp2", "deepspeed_zero3")
WEIGHT_TOLERANCE = 0.0  # the files are fp32 and every system loads fp32: bit-equal


def resolve_model_config(args: argparse.Namespace) -> Tuple[Dict[str, Any], str]:
    """The model config of a preset (the bench's or LOAD_PRESETS) or of --config."""
    if args.config is None and args.preset in LOAD_PRESETS:
        return dict(LOAD_PRESETS[args.preset]), args.preset
    return load_model_config(args)


# ====================================================================================================== memory
def read_status() -> Dict[str, int]:
    """VmRSS and VmHWM of this process in bytes (0 where /proc is not there)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when this kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_after_malloc_trim() -> Optional[int]:
    """VmRSS after glibc's malloc_trim(0) (freed heap memory handed back to the kernel): the memory still live;
    None where there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return read_status()["VmRSS"]


# ====================================================================================================== helpers
def _make(system: str, job: LoadJob, ctx: WorkerContext, config) -> Loaded:
    if system in HF_ZERO_LOAD:
        return HfZeroLoad(job, HF_ZERO_LOAD[system], ctx.device, config)
    if system == "fsdp2":
        return FSDP2Load(job, ctx.device, config)
    if system in DEEPSPEED_LOAD:
        return DeepSpeedLoad(job, DEEPSPEED_LOAD[system], ctx, config)
    raise ValueError(f"no load path for {system!r}")


# ====================================================================================================== worker
def _measure(system: str, ctx: WorkerContext, job: LoadJob) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ...integrations.hf_models import causal_lm_from_config, config_from_path, quiet

    quiet()
    config = config_from_path(job.folder)
    with torch.device("meta"):  # imports the modeling code now, not inside the timed part
        causal_lm_from_config(config)
    loader = _make(system, job, ctx, config)
    loader.prepare()
    gc.collect()
    dist.barrier()
    before = read_status()
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    loader.load()
    dist.barrier()
    wall = time.perf_counter() - t0
    after = read_status()
    mine: Dict[str, Any] = {"wall_s": wall, "rss_before": before["VmRSS"], "hwm_before": before["VmHWM"],
                            "rss_after": after["VmRSS"], "hwm_after": after["VmHWM"], "hwm_reset": reset,
                            "phases_s": dict(getattr(loader, "phases", {})), **loader.stats()}
    mine["peak_above_baseline"] = after["VmHWM"] - before["VmRSS"]
    trimmed = rss_after_malloc_trim()  # after the readings above: what of RSS after loading is still live
    mine["rss_after_trim"] = trimmed
    mine["live_above_baseline"] = None if trimmed is None else trimmed - before["VmRSS"]
    if job.verify:
        mine.update(loader.verify(ctx.rank))
    everyone: List[Dict[str, Any]] = [None] * ctx.world_size  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    return _row(system, ctx.world_size, everyone, job)


def _row(system: str, world: int, everyone: List[Dict[str, Any]], job: LoadJob) -> Dict[str, Any]:
    def most(key: str) -> Optional[int]:
        values = [r[key] for r in everyone if r.get(key) is not None]
        return max(values) if values else None

    rank0 = everyone[0]
    row: Dict[str, Any] = {
        "system": system, "status": "ok", "hf_zero": system in HF_ZERO_LOAD, "world_size": world,
        "wall_s": most("wall_s"), "peak_bytes": most("hwm_after"),
        "peak_above_baseline_bytes": most("peak_above_baseline"),
        "baseline_rss_bytes": most("rss_before"), "rss_after_bytes": most("rss_after"),
        "live_above_baseline_bytes": most("live_above_baseline"),
        "peak_kind": "VmHWM" + (" (reset before loading)" if all(r["hwm_reset"] for r in everyone) else
                                " (NOT reset: includes the peak before loading)"),
        "state_bytes": most("state_bytes"), "param_bytes": most("param_bytes"), "grad_bytes": most("grad_bytes"),
        "per_rank": [{k: v for k, v in r.items() if not k.startswith(("weights_", "buffers_"))} for r in everyone],
        "files": len(job.files), "note": LOAD_SYSTEMS[system],
    }
    for key in ("shard_bytes", "largest_unit_numel", "largest_unit_bytes", "padding_numel", "psi", "peer_version",
                "rotary_modules_recomputed"):
        if key in rank0:
            row[key] = most(key) if key != "peer_version" else rank0[key]
    if "shard_bytes" in row:
        row["bound_bytes"] = row["state_bytes"] + row["largest_unit_bytes"]  # model states + one gathered unit
    if job.verify:
        for key in ("weights_checked", "weights_max_abs_diff", "weights_missing", "buffers_checked",
                    "buffers_max_abs_diff", "buffers_bad"):
            row[key] = rank0.get(key)
        ok = (not row["weights_missing"] and row["weights_checked"] and row["weights_max_abs_diff"] <= WEIGHT_TOLERANCE
              and not row["buffers_bad"] and row["buffers_max_abs_diff"] <= 1e-6)
        row["weights_ok"] = bool(ok)
        if not ok:
            row["status"] = (f"error: loaded weights differ from the files (max |diff| {row['weights_max_abs_diff']}, "
                             f"missing {row['weights_missing']}, buffers max |diff| {row['buffers_max_abs_diff']}, "
                             f"bad buffers {row['buffers_bad']})")
    return row


def _worker(rank: int, world: int, port: int, system: str, job: LoadJob, out_dir: str) -> None:
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # libraries log to stdout; `--json -` owns the parent's
    try:
        device = init_worker_group(rank, world, port, job.threads_per_rank, job.timeout_s)
        settings = Settings(model_config={}, model_name=job.folder, steps=1, warmup=0, batch_size=1, seq_len=1,
                            grad_accum=1, mixed_precision="no", num_processes=world, lr=job.lr, seed=0,
                            timeout_s=job.timeout_s, threads_per_rank=job.threads_per_rank)
        result = _measure(system, WorkerContext(rank, world, device, settings), job)
    except BaseException:
        worker_failed(rank, out_dir)
    worker_done(rank, out_dir, result)


# ====================================================================================================== parent
def run_load_system(system: str, job: LoadJob) -> Dict[str, Any]:
    """Spawn `job.world_size` workers that load the folder with `system`; rank 0's row (or an error row)."""
    import torch.distributed as dist

    world = job.world_size
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=job.timeout_s))
    out_dir = tempfile.mkdtemp(prefix=f"hfz_load_{system}_")
    try:
        port = store.port
        env = {"MALLOC_MMAP_THRESHOLD_": str(job.malloc_mmap_threshold)} if job.malloc_mmap_threshold else None
        procs, timed_out = spawn(_worker, lambda r: (r, world, port, system, job, out_dir), world,
                                  job.timeout_s, job.threads_per_rank, env)
        del store  # the workers are gone: the rendezvous can close
        result_path = os.path.join(out_dir, "result.json")
        error = first_error(out_dir, world)
        if error is None and os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        if error is None:
            error = (f"timed out after {job.timeout_s:.0f}s" if timed_out
                     else f"no result; worker exit codes {[p.exitcode for p in procs]}")
        return {"system": system, "status": "error: " + error_summary(error), "error": error,
                "hf_zero": system in HF_ZERO_LOAD, "world_size": world}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _save_worker(model_config: Dict[str, Any], folder: str, seed: int, max_shard_size: Optional[int],
                 out_dir: str) -> None:
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # Transformers' save imports DeepSpeed, which logs to stdout
    try:
        import torch

        from ...integrations.hf_models import causal_lm_from_config, quiet

        quiet()
        config = build_config(model_config)
        torch.manual_seed(seed)
        model = causal_lm_from_config(config)
        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        size = max_shard_size if max_shard_size is not None else max(1, total // 4)  # about 4-5 files
        model.save_pretrained(folder, max_shard_size=size)
        with open(os.path.join(out_dir, "saved.json"), "w") as f:
            json.dump({"param_bytes": total, "numel": total // 4, "max_shard_size": size}, f)
    except BaseException:
        with open(os.path.join(out_dir, "error_rank0.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def save_model(model_config: Dict[str, Any], folder: str, seed: int, max_shard_size: Optional[int],
               timeout_s: float, threads: int) -> Dict[str, Any]:
    """Build the model (seeded) and save_pretrained it into `folder`, in a spawned process."""
    out_dir = tempfile.mkdtemp(prefix="hfz_load_save_")
    try:
        procs, timed_out = spawn(_save_worker, lambda r: (model_config, folder, seed, max_shard_size, out_dir), 1,
                                  timeout_s, threads)
        error = first_error(out_dir, 1)
        if error is not None or timed_out or procs[0].exitcode != 0:
            raise RuntimeError(f"saving the model failed: {error or ('timed out' if timed_out else procs[0].exitcode)}")
        with open(os.path.join(out_dir, "saved.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


# ====================================================================================================== table
def _mib(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.1f}"


def format_load_table(rows: List[Dict[str, Any]]) -> str:
    header = ["system", "world", "wall s", "peak RSS MiB/rank", "above baseline MiB", "live after MiB",
              "model states MiB/rank",
              "params MiB/rank", "shard MiB", "largest unit MiB", "states+unit MiB", "weights", "status"]
    body = []
    for r in rows:
        ok = r.get("status") == "ok"
        cell = (lambda key: _mib(r.get(key)) if ok else "-")
        weights = "-" if not ok else ("ok" if r.get("weights_ok") else ("n/a" if "weights_ok" not in r else "DIFF"))
        status = r.get("status", "")
        if status == "skipped" and r.get("reason"):
            status = f"skipped: {r['reason']}"
        body.append([r["system"], str(r.get("world_size", "-")), f"{r['wall_s']:.2f}" if ok else "-",
                     cell("peak_bytes"), cell("peak_above_baseline_bytes"), cell("live_above_baseline_bytes"),
                     cell("state_bytes"), cell("param_bytes"),
                     cell("shard_bytes"), cell("largest_unit_bytes"), cell("bound_bytes"), weights, status])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    left = {0, len(header) - 1}

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])


# ====================================================================================================== CLI
def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", action="store_true",
                        help="measure loading instead of training: from a save_pretrained folder to a sharded model "
                             "with its optimizer, per system: wall time, peak RSS per rank and above the baseline "
                             f"(systems: {', '.join(LOAD_SYSTEMS)}; default {','.join(DEFAULT_LOAD_SYSTEMS)})")
    parser.add_argument("--load-folder", default=None, metavar="DIR",
                        help="with --load: load this save_pretrained folder (safetensors) instead of saving the "
                             "preset/--config model into a temporary one")
    parser.add_argument("--max-shard-size", type=int, default=None, metavar="BYTES",
                        help="with --load: save_pretrained's max_shard_size (default: a quarter of the weights)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="with --load: set glibc's MALLOC_MMAP_THRESHOLD_ in the workers, so freed buffers of at "
                             "least BYTES go back to the kernel at once and the peak RSS is the live peak (default: "
                             "glibc's dynamic threshold, which keeps freed chunks of up to 32 MiB in the heap)")
    parser.add_argument("--no-verify", action="store_true",
                        help="with --load: skip the (untimed) check of the loaded weights against the files")


def parse_load_systems(text: str) -> List[str]:
    if text.strip().lower() == "all":
        return list(DEFAULT_LOAD_SYSTEMS)
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in LOAD_SYSTEMS]
    if unknown:
        raise ValueError(f"--load: no load path for {unknown}; known: {', '.join(LOAD_SYSTEMS)}")
    if not names:
        raise ValueError("--systems is empty")
    return names


def run_load(args: argparse.Namespace) -> int:
    """`hf-zero bench --load`: the exit code is 1 when an hf_zero system failed, 2 on bad arguments, else 0."""
    try:
        systems = parse_load_systems(args.systems)
        if args.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
        if args.load_folder is not None:
            if not os.path.isdir(args.load_folder):
                raise ValueError(f"--load-folder {args.load_folder}: no such folder")
            model_config, model_name = None, os.path.abspath(args.load_folder)
        else:
            if args.preset is None and args.config is None:
                args.preset = "gpt2"
            model_config, model_name = resolve_model_config(args)
    except (ValueError, OSError) as exc:
        print(f"hf-zero bench: error: {exc}", file=sys.stderr)
        return 2

    import torch

    from .deepspeed import unavailable_reason

    world = args.num_processes
    threads = max(1, cpu_count() // world)
    tmp = None
    try:
        if args.load_folder is not None:
            folder, saved = os.path.abspath(args.load_folder), {}
        else:
            tmp = tempfile.mkdtemp(prefix="hfz_load_model_")
            folder = os.path.join(tmp, "model")
            t0 = time.monotonic()
            saved = save_model(model_config, folder, args.seed, args.max_shard_size, args.timeout, cpu_count())
            log(f"saved {model_name} ({saved['param_bytes'] / 2**20:,.1f} MiB of fp32 weights) in "
                f"{time.monotonic() - t0:.0f}s")
        job = LoadJob(folder=folder, world_size=world, threads_per_rank=threads, timeout_s=args.timeout, lr=args.lr,
                      verify=not args.no_verify, malloc_mmap_threshold=args.malloc_mmap_threshold)
        job.files = [os.path.basename(p) for p in weight_files(folder)]
        log(f"--load: model {model_name}, {len(job.files)} safetensors file(s), world {world} "
            f"({'nccl' if torch.cuda.is_available() else 'gloo'}), {threads} threads per rank")
        rows = []
        with extensions_dir(any(s in DEEPSPEED_LOAD for s in systems)):
            for i, system in enumerate(systems):
                tag = f"[{i + 1}/{len(systems)}] {system}"
                reason = unavailable_reason() if system in DEEPSPEED_LOAD else None
                if reason is not None:
                    log(f"{tag} skipped: {reason}")
                    rows.append({"system": system, "status": "skipped", "reason": reason, "hf_zero": False,
                                 "world_size": world, "note": LOAD_SYSTEMS[system]})
                    continue
                log(f"{tag} ...")
                t0 = time.monotonic()
                row = run_load_system(system, job)
                row["total_s"] = time.monotonic() - t0
                if row["status"] == "ok":
                    log(f"{tag}: {row['wall_s']:.2f}s, peak {row['peak_bytes'] / 2**20:,.1f} MiB/rank "
                        f"({row['total_s']:.0f}s including start-up)")
                else:
                    log(f"{tag} FAILED:\n{row.get('error', row['status'])}")
                rows.append(row)
    except RuntimeError as exc:
        print(f"hf-zero bench: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    to_stdout = args.json != "-"
    print(format_load_table(rows), file=sys.stdout if to_stdout else sys.stderr, flush=True)
    if args.json:
        write_json_line(args.json, {"mode": "load", "model_name": model_name, "model_config": model_config,
                                    "num_processes": world, "systems": systems, "files": job.files,
                                    "saved": saved, "threads_per_rank": threads, "seed": args.seed,
                                    "malloc_mmap_threshold": args.malloc_mmap_threshold}, rows)
    failed = [r["system"] for r in rows if r["status"] != "ok" and r.get("hf_zero")]
    if failed:
        log(f"hf_zero system(s) failed: {', '.join(failed)}")
        return 1
    return 0
