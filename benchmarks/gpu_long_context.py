"""Issue #44 item 9, on one GPU: the longest sequence a ~1B Llama trains on with hf_zero's tiled loss, tiled MLP and
activation checkpoints in CPU memory, against plain Transformers with gradient checkpointing.

    python -m benchmarks.gpu_long_context --json gpu_long_context.json   # the check: a ~1B Llama, under 8 minutes
    python -m benchmarks.gpu_long_context --device cpu --tiny            # a smoke run of this script (no GPU)

The model is gpu_memory.py's Llama of about 1.1e9 parameters (width 2048, 16 layers, MLP 5504, vocab 32000; random
init, no download), sdpa attention, batch 1, bf16. Systems (`--systems`):

- plain: Transformers and torch alone: fp32 parameters under `torch.autocast(bfloat16)`, the model's own
  `gradient_checkpointing_enable()`, fused AdamW.
- hf_zero: stage 3 bf16 on one rank (NCCL over a FileStore: no port), `enable_long_sequences` with the tiled loss
  and the tiled MLP, `enable_activation_checkpointing(model, "on", cpu=True)`: what HfZeroAccelerator builds from
  ZeroPlugin(stage=3, tiled_loss_tokens=..., tiled_mlp_tokens=..., activation_checkpointing="on",
  cpu_checkpointing=True).
- hf_zero_offload: hf_zero with offload_optimizer="cpu" as well (not in the default list: the hf_zero systems named
  share the budget plain's search leaves).

Each trial is one fresh subprocess (a CUDA OOM there cannot poison the next trial) that trains `--steps` (2) steps
on one sequence of random tokens and reports fit / oom (torch.OutOfMemoryError, caught) / error / killed (a signal:
the host's OOM killer) / timeout, `torch.cuda.max_memory_allocated()` over the steps, each step's time and loss,
the host's peak RSS (the CPU checkpoints live there), the logits' shape ([1, 1, vocab] where the tiled loss ran)
and the shape of the attention mask the first layer got (None: the kernel's causal mode; a materialised S x S mask
would be a memory bug). The search per system: lengths doubling from `--start` (plain) until a trial does not fit,
then `--bisections` steps between the last fit and the first failure. hf_zero's first trial is the correctness
length `--check-seq`; its doubling then starts at the longest length of that ladder plain fit (shorter ones only
cost time; `--hf-zero-start` picks another). Everything stays within `--budget-s` seconds (default 450,
so the whole script is under 8 minutes; plain's search takes at most `--plain-share`, 0.4, of it and the hf_zero
systems share the rest): a trial whose predicted time (from the system's earlier trials, step time
a*S + b*S^2) exceeds what is left is not started, a trial still running when the budget ends is killed, and the
search reports what it established (`limited_by`: memory, budget, cap or error).

Correctness: at `--check-seq`, step 1's loss of every hf_zero system against plain's (same init, same tokens)
within bf16's tolerance (`--precision fp32`: fp32 throughout, then within 1e-5). The exit status is 1 when that
check fails or could not be made.

Output: one JSON line per trial, one JSON object (`--json`), and a summary line: the longest fitting length per
system, what limited each search, and hf_zero's over plain's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=5504, vocab_size=32000,
            num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False, use_cache=False)
TINY = dict(FULL, hidden_size=64, num_hidden_layers=2, intermediate_size=160, vocab_size=512, num_attention_heads=4,
            num_key_value_heads=4)
SYSTEMS = {
    "plain": "plain Transformers: autocast bf16, gradient_checkpointing_enable(), fused AdamW",
    "hf_zero": "hf_zero stage 3 bf16, 1 rank: tiled loss + tiled MLP, activation checkpoints in CPU memory",
    "hf_zero_offload": "hf_zero as above + offload_optimizer='cpu'",
}
# |hf_zero - plain| / |plain| allowed for step 1's loss: bf16 (plain keeps fp32 weights and residual stream under
# autocast, hf_zero computes with bf16 copies) and fp32 (only the tiles' summation order differs)
TOLERANCE = {"bf16": 1e-2, "fp32": 1e-5}
MARK = "TRIAL "  # the child's result line on stdout
FAILED = ("oom", "killed")  # the trial's outcomes that mean "does not fit"


# ------------------------------------------------------------------------------------------------ one trial (child)
def _model(values: Dict[str, Any], device: Any):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**values)
    torch.manual_seed(0)  # the same init for every system
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    return model


def _watch_mask(model, seen: List[Any]) -> None:
    """Record the attention mask the first attention module is given (None, or its shape)."""
    attention = next(m for n, m in model.named_modules() if n.endswith("self_attn"))

    def hook(module, args, kwargs):
        if not seen:
            mask = kwargs.get("attention_mask")
            seen.append(None if mask is None else list(getattr(mask, "shape", [type(mask).__name__])))

    attention.register_forward_pre_hook(hook, with_kwargs=True)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_trial(system: str, seq: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Train `args.steps` steps of `system` on one sequence of `seq` tokens in this process; the trial's record."""
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    values = dict(TINY if args.tiny else FULL, max_position_embeddings=seq)
    bf16 = args.precision == "bf16"
    tokens = torch.randint(0, values["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    out: Dict[str, Any] = {"system": system, "seq": seq, "status": "error", "losses": [], "step_s": []}
    store = tempfile.TemporaryDirectory()  # the FileStore removes its file when the group is destroyed
    engine = None
    try:
        model = _model(values, device)
        masks: List[Any] = []
        _watch_mask(model, masks)
        if system == "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

            def step() -> Tuple[float, List[int]]:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    output = model(input_ids=tokens, labels=tokens)
                loss, shape = output.loss, list(output.logits.shape)
                del output  # as a training loop drops it: the logits are not held through the backward
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                return loss.item(), shape
        else:
            from hf_zero import ZeroConfig, shard_model
            from hf_zero.engine import enable_activation_checkpointing
            from hf_zero.engine.sequence import SequenceGroups
            from hf_zero.integrations.sequence_parallel import enable_long_sequences

            dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(f"{store.name}/store", 1),
                                    rank=0, world_size=1)
            # HfZeroAccelerator._shard's order: long sequences, then checkpointing, then ZeRO
            enable_long_sequences(model, SequenceGroups.build(1), args.tiled_loss_tokens, args.tiled_mlp_tokens)
            enable_activation_checkpointing(model, "on", cpu=True)
            config = ZeroConfig(stage=3, mixed_precision="bf16" if bf16 else "no",
                                offload_optimizer="cpu" if system == "hf_zero_offload" else "none",
                                tiled_loss_tokens=args.tiled_loss_tokens, tiled_mlp_tokens=args.tiled_mlp_tokens)
            engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config, device=device)

            def step() -> Tuple[float, List[int]]:
                output = engine.model(input_ids=tokens, labels=tokens)
                loss, shape = output.loss, list(output.logits.shape)
                del output
                engine.backward(loss)
                engine.optimizer.step()
                engine.optimizer.zero_grad()
                return loss.item(), shape

        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)  # the steps' peak: the transient of sharding is not training
            out["device_name"] = torch.cuda.get_device_name(device)
        out["setup_s"] = time.perf_counter() - started
        try:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                loss, shape = step()  # .item() waited for the step's kernels
                out["step_s"].append(time.perf_counter() - t0)
                out["losses"].append(loss)
                out["logits_shape"] = shape  # [1, S, vocab], or [1, 1, vocab] where the tiled loss ran
            out["status"] = "fit"
        except torch.OutOfMemoryError as e:
            out["status"], out["message"] = "oom", str(e).splitlines()[0][:300]
        except RuntimeError as e:  # pinned host memory or a library's own allocation, out of memory
            if "out of memory" not in str(e):
                raise
            out["status"], out["message"] = "oom", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        out["attention_mask"] = masks[0] if masks else "not called"
        if cuda:
            out["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
            out["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
        if engine is not None:
            out["model_states"] = int(engine.memory_stats()["model_states"])
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the search stops on an error
        out["message"] = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception as e:  # noqa: BLE001 - after an OOM: the trial's figures are what counts
                out["close_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if dist.is_initialized():
            dist.destroy_process_group()
        store.cleanup()
    out["host_peak_rss"] = _peak_rss()
    return out


# ------------------------------------------------------------------------------------------------ the search (parent)
def predict_s(seq: int, trials: List[Dict[str, Any]], steps: int) -> Optional[float]:
    """Predicted wall time of a trial at `seq` from this system's fitting trials: the last one's setup plus `steps`
    steps of a*S + b*S^2 seconds (a, b >= 0 through the last two lengths; one length: all quadratic, which
    over-predicts, so a trial is skipped early rather than killed late). None before any trial fit."""
    done = sorted((t for t in trials if t.get("status") == "fit" and t.get("step_s")), key=lambda t: t["seq"])
    if not done:
        return None
    last = done[-1]
    s1, t1 = last["seq"], sum(last["step_s"]) / len(last["step_s"])
    below = [t for t in done if t["seq"] < s1]
    if below:
        s0, t0 = below[-1]["seq"], sum(below[-1]["step_s"]) / len(below[-1]["step_s"])
        b = max(0.0, (t1 / s1 - t0 / s0) / (s1 - s0))
        a = max(0.0, t1 / s1 - b * s1)
    else:
        a, b = 0.0, t1 / s1 ** 2
    setup = last.get("wall_s", last.get("setup_s", 0.0)) - sum(last["step_s"])
    return 1.1 * (max(setup, 0.0) + steps * (a * seq + b * seq * seq))


def _inconclusive(record: Optional[Dict[str, Any]]) -> bool:
    """A trial that neither fit nor ran out of memory (skipped for the budget, timed out, failed otherwise)."""
    return record is None or record["status"] not in ("fit",) + FAILED


def _why_stopped(record: Optional[Dict[str, Any]]) -> str:
    return "budget" if record is None or record["status"] == "timeout" else "error"


def search(run: Callable[[int, float], Dict[str, Any]], start: int, cap: int, deadline: float, steps: int = 2,
           bisections: int = 2, granule: int = 1024, trials: Optional[List[Dict[str, Any]]] = None,
           now: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """The longest length in [granule, cap] at which `run(seq, timeout_s)` fits, as far as the time to `deadline`
    allows: doubling from `start` to the first failure (halving down when `start` fails), then `bisections` steps
    between the last fit and the first failure, at multiples of `granule`. `trials`: earlier ones of this system
    (their fits count, their times feed the prediction)."""
    trials = list(trials or [])

    def attempt(seq: int) -> Optional[Dict[str, Any]]:
        left = deadline - now()
        predicted = predict_s(seq, trials, steps)
        if left <= 0 or (predicted is not None and predicted > left):
            trials.append({"seq": seq, "status": "skipped", "predicted_s": predicted, "left_s": left})
            return None
        record = run(seq, left)
        trials.append(record)
        return record

    fits = [t["seq"] for t in trials if t.get("status") == "fit"]
    fit: Optional[int] = max(fits) if fits else None
    fail: Optional[int] = None
    limited_by = "cap"
    seq = start
    while seq <= cap:
        record = next((t for t in trials if t["seq"] == seq and t.get("status") in ("fit",) + FAILED), None)
        record = record or attempt(seq)
        status = record["status"] if record is not None else "skipped"
        if status == "fit":
            fit = max(fit or 0, seq)
            seq *= 2
            continue
        if status in FAILED:
            fail, limited_by = seq, "memory"
        else:
            limited_by = "budget" if status in ("skipped", "timeout") else "error"
        break
    if fit is None and fail is not None:  # the start did not fit: down until something does
        seq = (fail // 2) // granule * granule
        while seq >= granule:
            record = attempt(seq)
            if _inconclusive(record):
                limited_by = _why_stopped(record)
                break
            if record["status"] == "fit":
                fit = seq
                break
            fail, seq = seq, (seq // 2) // granule * granule
    for _ in range(bisections):
        if fit is None or fail is None or limited_by != "memory":
            break
        mid = (fit + fail) // 2 // granule * granule
        if not fit < mid < fail:
            break
        record = attempt(mid)
        if _inconclusive(record):
            limited_by = _why_stopped(record)
            break
        if record["status"] == "fit":
            fit = mid
        else:
            fail = mid
    return {"trials": trials, "longest_fit": fit, "first_fail": fail, "limited_by": limited_by}


def _trial_argv(args: argparse.Namespace, system: str, seq: int) -> List[str]:
    argv = [sys.executable, "-m", "benchmarks.gpu_long_context", "--trial", system, "--seq", str(seq),
            "--device", args.device, "--precision", args.precision, "--steps", str(args.steps),
            "--tiled-loss-tokens", str(args.tiled_loss_tokens), "--tiled-mlp-tokens", str(args.tiled_mlp_tokens)]
    return argv + (["--tiny"] if args.tiny else [])


def spawn_trial(args: argparse.Namespace, system: str, seq: int, timeout_s: float) -> Dict[str, Any]:
    """Run one trial in a fresh process; a timeout kills it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.alloc_conf)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(_trial_argv(args, system, seq), capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        record = {"system": system, "seq": seq, "status": "timeout", "timeout_s": timeout_s}
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
        if lines:
            record = json.loads(lines[-1][len(MARK):])
        else:  # died without a word: a signal (the host's OOM killer: -9) or an uncaught crash
            record = {"system": system, "seq": seq, "status": "killed" if proc.returncode < 0 else "error",
                      "returncode": proc.returncode, "message": proc.stderr[-1500:]}
    record["wall_s"] = time.monotonic() - t0
    print(json.dumps(record), flush=True)
    return record


def loss_check(plain: Dict[str, Any], mine: Dict[str, Any], precision: str) -> Dict[str, Any]:
    """Step 1's loss of an hf_zero system against plain's at the same length, init and tokens."""
    out: Dict[str, Any] = {"seq": plain["seq"], "tolerance_rel": TOLERANCE[precision], "ok": False}
    if plain.get("status") != "fit" or mine.get("status") != "fit":
        out["why"] = f"no loss to compare: plain {plain.get('status')}, {mine['system']} {mine.get('status')}"
        return out
    out["plain_losses"], out["losses"] = plain["losses"], mine["losses"]
    out["diff_rel"] = [abs(m - p) / abs(p) for m, p in zip(mine["losses"], plain["losses"])]
    out["ok"] = out["diff_rel"][0] <= TOLERANCE[precision]
    return out


def describe(summary: Dict[str, Any], systems: List[str], steps: int) -> str:
    """The summary in words: a length the budget, the cap or an error stopped at is a lower bound ('>=')."""
    def length(system: str) -> str:
        fit, why = summary[system], summary["limited_by"][system]
        if fit is None:
            return f"{system} none ({why})"
        return f"{system} {'' if why == 'memory' else '>= '}{fit:,} ({why})"

    words = [f"longest sequence that trains {steps} steps: " + ", ".join(length(s) for s in systems)]
    for system in systems[1:]:
        if f"{system}_over_plain" in summary:
            bound = "=" if summary["limited_by"][system] == "memory" else ">="
            words.append(f"{system} / plain {bound} {summary[f'{system}_over_plain']:.2f}")
    words.append("loss check " + ("ok" if summary["loss_check_ok"] else "FAILED"))
    return "; ".join(words)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (the check), or cpu: a smoke run of this script")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama, lengths 64..256 (smoke runs)")
    parser.add_argument("--systems", default="plain,hf_zero", help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--precision", default="bf16", choices=sorted(TOLERANCE))
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock seconds for all trials")
    parser.add_argument("--steps", type=int, default=2, help="training steps a length must complete")
    parser.add_argument("--start", type=int, help="the first length (default 8192; --tiny 64)")
    parser.add_argument("--max-seq", type=int, help="no length beyond this (default 4194304; --tiny 256)")
    parser.add_argument("--check-seq", type=int, help="the loss check's length (default: --start)")
    parser.add_argument("--hf-zero-start", type=int, help="hf_zero's first search length (default: plain's longest)")
    parser.add_argument("--bisections", type=int, default=2)
    parser.add_argument("--plain-share", type=float, default=0.4, help="the most of the budget plain's search uses")
    parser.add_argument("--tiled-loss-tokens", type=int, help="default 8192; --tiny 32")
    parser.add_argument("--tiled-mlp-tokens", type=int, help="default 8192; --tiny 32")
    parser.add_argument("--alloc-conf", default="expandable_segments:True",
                        help="PYTORCH_CUDA_ALLOC_CONF for every trial (both systems), unless already set")
    parser.add_argument("--trial", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)  # a child: one trial
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.start = args.start or (64 if args.tiny else 8192)
    args.max_seq = args.max_seq or (256 if args.tiny else 1 << 22)
    args.check_seq = args.check_seq or args.start
    tile = 32 if args.tiny else 8192  # tiny: lengths 64..256 cut into 2..8 tiles
    args.tiled_loss_tokens = tile if args.tiled_loss_tokens is None else args.tiled_loss_tokens
    args.tiled_mlp_tokens = tile if args.tiled_mlp_tokens is None else args.tiled_mlp_tokens
    if args.trial:
        print(MARK + json.dumps(run_trial(args.trial, args.seq, args)), flush=True)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if systems[0] != "plain" or any(s not in SYSTEMS for s in systems):
        parser.error(f"--systems starts with plain (the reference), then some of {', '.join(SYSTEMS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # no context is made here: the trials own the GPU
            parser.error("needs a CUDA GPU (or --device cpu --tiny for a smoke run)")
    granule = max(1, args.start // 8)
    end = time.monotonic() + args.budget_s
    results: Dict[str, Any] = {}
    checks: Dict[str, Any] = {}
    for i, system in enumerate(systems):
        # plain's search is cheap (its limit is short) and may use --plain-share of the budget at most; the hf_zero
        # systems share what is left, so plain's search cannot leave them nothing
        left = end - time.monotonic()
        share = min(left, args.plain_share * args.budget_s) if system == "plain" else left / (len(systems) - i)
        deadline = time.monotonic() + share

        def run(seq: int, timeout_s: float, system: str = system) -> Dict[str, Any]:
            return spawn_trial(args, system, seq, timeout_s)

        earlier: List[Dict[str, Any]] = []
        start = args.start
        if system != "plain":
            plain = results["plain"]["trials"]
            reference = next((t for t in plain if t["seq"] == args.check_seq and "losses" in t), None)
            if reference is None:  # --check-seq off plain's ladder
                plain.append(spawn_trial(args, "plain", args.check_seq, deadline - time.monotonic()))
                reference = plain[-1]
            earlier.append(run(args.check_seq, deadline - time.monotonic()))
            checks[system] = loss_check(reference, earlier[-1], args.precision)
            while start * 2 <= (results["plain"]["longest_fit"] or 0):  # on the ladder, at most plain's longest
                start *= 2
            start = args.hf_zero_start or start
        results[system] = search(run, start, args.max_seq, deadline, args.steps, args.bisections, granule, earlier)
        results[system]["description"] = SYSTEMS[system]
    summary: Dict[str, Any] = {s: results[s]["longest_fit"] for s in systems}
    summary["limited_by"] = {s: results[s]["limited_by"] for s in systems}
    for system in systems[1:]:
        if results[system]["longest_fit"] and results["plain"]["longest_fit"]:
            summary[f"{system}_over_plain"] = results[system]["longest_fit"] / results["plain"]["longest_fit"]
    summary["loss_check_ok"] = bool(checks) and all(c["ok"] for c in checks.values())
    print(json.dumps({"summary": summary}), flush=True)
    print(describe(summary, systems, args.steps), flush=True)
    if args.json:
        from importlib.metadata import version

        first = next((t for r in results.values() for t in r["trials"] if "device_name" in t), {})
        environment = {"device_name": first.get("device_name", args.device),
                       "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", args.alloc_conf),
                       **{p: version(p) for p in ("torch", "transformers")}}
        settings = {k: v for k, v in vars(args).items() if k not in ("trial", "seq")}
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "args": settings,
                       "model": TINY if args.tiny else FULL, "systems": results, "loss_check": checks,
                       "summary": summary}, f, indent=1)
    return 0 if summary["loss_check_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
