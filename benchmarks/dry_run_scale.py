"""What grows with N: `hf-zero estimate --dry-run` of one model at N = 8, 64, 256, 1024, stages 1-3, HSDP and hpZ.

    python -m benchmarks.dry_run_scale [--params 7.5e9] [--json docs/dry_run_scale.json]

Each case runs in a fresh process (the command line with --json), so its construction time and the process's peak
RSS are its own. Per case: shard_model's and the step's seconds, the process's peak RSS, model states and the
peak of live tensor bytes per rank, the plan's padding, and the ledger's calls and elements per step (intra- and
inter-host). Hosts of 8 ranks; HSDP and hpZ only where there is more than one host. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Dict, List

WORLDS = (8, 64, 256, 1024)
RANKS_PER_HOST = 8


def cases() -> List[Dict[str, Any]]:
    out = []
    for n in WORLDS:
        for stage in (1, 2, 3):
            out.append(dict(n=n, stage=stage, hierarchy="none"))
        if n > RANKS_PER_HOST:
            out += [dict(n=n, stage=3, hierarchy="hsdp"), dict(n=n, stage=3, hierarchy="hpz")]
    return out


def run_case(params: float, case: Dict[str, Any], seq_len: int, micro_batches: int) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "hf_zero.cli", "estimate", "--dry-run", "--params", str(params),
           "--num-processes", str(case["n"]), "--ranks-per-host", str(min(RANKS_PER_HOST, case["n"])),
           "--stage", str(case["stage"]), "--hierarchy", case["hierarchy"], "--seq-len", str(seq_len),
           "--micro-batches", str(micro_batches), "--json"]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    run = json.loads(done.stdout)["runs"][0]
    ledger = run["ledger"]["total"]
    return {
        **case, "wall_s": round(wall, 2), "shard_model_s": run["seconds"]["shard_model"],
        "step_s": run["seconds"]["step"], "python_peak_rss_growth": run["python_peak_rss_growth"],
        "psi": run["psi"], "model_states": run["measured"]["model_states"],
        "formula_model_states": run["formula"]["model_states"], "peak": run["peak"]["total"],
        "gathered_params_peak": run["measured"]["gathered_params_peak"],
        "comm_buffers_peak": run["measured"]["comm_buffers_peak"],
        "hpz_secondary_peak": run["measured"]["hpz_secondary_peak"],
        "padding_elements": run["padding_elements"], "groups": run["groups"],
        "calls": ledger["calls"], "intra_elements": ledger["intra_elements"],
        "inter_elements": ledger["inter_elements"],
    }


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| N | stage | shard_model s | step s | RSS growth MB | model states GB (formula) | peak GB | padding "
            "elements | calls/step | intra / inter elements per step |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        label = f"{r['stage']}" + ("" if r["hierarchy"] == "none" else f" {r['hierarchy']}")
        lines.append(f"| {r['n']} | {label} | {r['shard_model_s']:.2f} | {r['step_s']:.2f} | "
                     f"{r['python_peak_rss_growth'] / 1e6:.0f} | {r['model_states'] / 1e9:.3f} "
                     f"({r['formula_model_states'] / 1e9:.3f}) | {r['peak'] / 1e9:.2f} | {r['padding_elements']:,} | "
                     f"{r['calls']} | {r['intra_elements']:.3g} / {r['inter_elements']:.3g} |")
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=7.5e9)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    todo = cases()
    for i, case in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] N={case['n']} stage {case['stage']} {case['hierarchy']}", file=sys.stderr,
              flush=True)
        rows.append(run_case(args.params, case, args.seq_len, args.micro_batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": args.params, "seq_len": args.seq_len, "micro_batches": args.micro_batches,
                       "ranks_per_host": RANKS_PER_HOST, "rows": rows}, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
