"""hf-zero estimate: the paper's table in formula mode, and plan mode byte for byte against engine.memory_stats().

Plan mode is checked on real gloo ranks (N = 1, 2, 3, 4; one spawn per world size): after one optimizer step of
AdamW, every rank's memory_stats() params / grads / master / optimizer_states must equal estimate_plan(...) for that
rank exactly, for the tiny GPT-2 (tied) and Llama at stages 0-3 in fp32, plus Llama in bf16 with
grad_accum_dtype="compute".
"""
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import models
from _dist import DistResults
from hf_zero.config import ZeroConfig
from hf_zero.estimate import (estimate_plan, fits_formula, formula_recipe, formula_report, max_over_ranks,
                              plan_bytes, upper_bound_bytes)
from hf_zero.memory import model_state_bytes, paper_table
from hf_zero.planning import plan_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_SIZES = (1, 2, 3, 4)
STAGES = (0, 1, 2, 3)
BF16_WORLD = 3
KEYS = ("params", "grads", "master", "optimizer_states")
PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # Ψ = 7.5e9, N = 64, K = 12


def _cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hf_zero.cli", "estimate", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


# ------------------------------------------------------------------------------------------------------ formula mode
def test_formula_function_reproduces_paper():
    table = paper_table(7.5e9, 64, 12)
    assert {s: round(v / 1e9, 1) for s, v in table.items()} == PAPER_GB
    report = formula_report(7.5e9, 64, formula_recipe("bf16", 12, "compute"))
    assert {s: round(v["model_states"] / 1e9, 1) for s, v in report["stages"].items()} == PAPER_GB
    # communication: 2Ψ at stages 0-2 (all-reduce = reduce-scatter + all-gather), 3Ψ at stage 3, fp16 bytes
    comm = {s: sum(v["comm_elements"].values()) for s, v in report["stages"].items()}
    assert comm == {0: 15e9, 1: 15e9, 2: 15e9, 3: 22.5e9}
    assert sum(report["stages"][3]["comm_bytes"].values()) == 45e9


def test_formula_cli_reproduces_paper(capsys):
    res = _cli("--params", "7.5e9", "--num-processes", "64", "--optimizer-k", "12", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert {int(s): round(v["model_states"] / 1e9, 1) for s, v in out["stages"].items()} == PAPER_GB
    from hf_zero.cli import main  # the table, in process (one subprocess above is enough)

    assert main(["estimate", "--params", "7.5e9", "--num-processes", "64", "--optimizer-k", "12"]) == 0
    table = capsys.readouterr().out
    for gb in PAPER_GB.values():
        assert f" {gb:.1f} " in table, table


def test_fits_formula_is_the_smallest_n():
    r = formula_recipe("bf16", 12, "compute")
    fits = fits_formula(7.5e9, r, 32e9)
    assert fits[0] is None  # 120 GB never fits in 32 GB
    for stage in (1, 2, 3):
        n = fits[stage]
        assert model_state_bytes(7.5e9, n, stage, r) <= 32e9
        assert n == 1 or model_state_bytes(7.5e9, n - 1, stage, r) > 32e9


# ------------------------------------------------------------------------------------------------------ plan mode
def measure(rank, world_size, kind, stage, mixed_precision="no", grad_accum_dtype="fp32"):
    """One AdamW step through hf_zero; this rank's memory_stats() model-state entries."""
    from hf_zero import shard_model

    model = models.make_model(kind)
    cfg = ZeroConfig(stage=stage, mixed_precision=mixed_precision, grad_accum_dtype=grad_accum_dtype)
    engine = shard_model(model, models.make_optimizer(model), cfg)
    batch = models.rank_slice(models.make_batches(1, 1)[0][0], rank, world_size)
    engine.backward(engine.model(input_ids=batch, labels=batch).loss)
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    stats = engine.memory_stats()
    return {k: int(stats[k]) for k in KEYS + ("model_states",)}


def scenarios_for(world_size):
    sc = [(f"{kind}-fp32-s{stage}", measure, dict(kind=kind, stage=stage)) for kind in models.KINDS for stage in STAGES]
    if world_size == BF16_WORLD:
        sc += [(f"llama-bf16-s{stage}", measure,
                dict(kind="llama", stage=stage, mixed_precision="bf16", grad_accum_dtype="compute"))
               for stage in STAGES]
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def _check(dist_results, world_size, name, kind, cfg):
    measured = dist_results(world_size, name)
    with torch.device("meta"):
        model = models.make_model(kind)  # the planner needs shapes only
    for rank, stats in enumerate(measured):
        want = estimate_plan(model, world_size, cfg, rank=rank)
        assert {k: want[k] for k in KEYS} == {k: stats[k] for k in KEYS}, (
            f"{name} N={world_size} rank {rank}: estimate {want} vs memory_stats {stats}")
        assert want["model_states"] == stats["model_states"]
    plan = plan_model(model, world_size, cfg)
    worst = max_over_ranks(plan, cfg)
    assert worst["model_states"] == max(s["model_states"] for s in measured)
    assert upper_bound_bytes(plan, cfg) >= worst["model_states"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_plan_matches_memory_stats_fp32(dist_results, world_size, kind, stage):
    _check(dist_results, world_size, f"{kind}-fp32-s{stage}", kind, ZeroConfig(stage=stage))


@pytest.mark.parametrize("stage", STAGES)
def test_plan_matches_memory_stats_bf16(dist_results, stage):
    cfg = ZeroConfig(stage=stage, mixed_precision="bf16", grad_accum_dtype="compute")
    _check(dist_results, BF16_WORLD, f"llama-bf16-s{stage}", "llama", cfg)


def test_estimate_plan_accepts_a_config_path(tmp_path):
    cfg = models._config("llama")
    cfg.save_pretrained(tmp_path)
    zc = ZeroConfig(stage=3)
    got = estimate_plan(str(tmp_path), 3, zc)
    assert got == plan_bytes(plan_model(models.make_model("llama"), 3, zc), zc, 0)
    assert set(got) == {"params", "grads", "master", "optimizer_states", "model_states"}


# ------------------------------------------------------------------------------------------------------ large configs
LLAMA_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=11008,
                vocab_size=32000, num_attention_heads=32, num_key_value_heads=32)
LLAMA_1T = dict(model_type="llama", hidden_size=25600, num_hidden_layers=128, intermediate_size=68352,
                vocab_size=32000, num_attention_heads=200, num_key_value_heads=200)


@pytest.mark.parametrize("name,values,n,psi_range", [
    ("7b", LLAMA_7B, 64, (6.7e9, 6.8e9)),
    ("1t", LLAMA_1T, 1024, (0.9e12, 1.1e12)),
])
def test_large_configs_run_in_seconds(tmp_path, name, values, n, psi_range):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(values))
    t0 = time.perf_counter()
    res = _cli("--model", str(path), "--num-processes", str(n), "--fits", "80", "--json")
    elapsed = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr
    assert elapsed < 30, f"{name}: {elapsed:.1f} s"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert psi_range[0] < out["psi"] < psi_range[1]
    for stage, row in out["stages"].items():
        for key in ("rank0", "max"):
            for k in KEYS + ("model_states",):
                assert math.isfinite(row[key][k]) and row[key][k] >= 0, (stage, key, k)
        assert row["max"]["model_states"] >= row["rank0"]["model_states"]
    s3 = out["stages"]["3"]["max"]["model_states"]
    # default bf16 with fp32 gradient accumulation: 2 + 4 + 4 + 8 = 18 bytes per parameter, all over N at stage 3
    assert abs(s3 - 18 * out["psi"] / n) / s3 < 0.01
