"""hf-zero estimate: the paper's table in formula mode, and plan mode byte for byte against engine.memory_stats().

Plan mode is checked on real gloo ranks (N = 1, 2, 3, 4; one spawn per world size): after one optimizer step of
AdamW, every rank's memory_stats() params / grads / master / optimizer_states and estimate_plan(...) for that rank
must both equal the count tests/_flat_layout.py makes from first principles (the paper's per-stage bytes over the
model's flat groups, each padded to a multiple of N, counted from named_parameters and the decoder layers, never
from hf_zero's plan_model), for the tiny GPT-2 (tied) and Llama at stages 0-3 in fp32, plus Llama in bf16 with
grad_accum_dtype="compute". Every plan-mode expectation below takes its sizes from that count.
"""
import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
import time
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import models
from _dist import DistResults
from _flat_layout import layout, state_bytes, unit_prefixes, worst_rank_bytes
from hf_zero.config import ZeroConfig
from hf_zero.tools.estimate.activations import (ActivationShape, activation_bytes, activation_saved_tensors,
                                         activation_shape, layer_activation_bytes, paper_layer_bytes)
from hf_zero.tools.estimate.plan import (estimate_plan, fits_formula, formula_recipe, formula_report, max_over_ranks, plan_bytes,
                                          upper_bound_bytes)
from hf_zero.tools.estimate.formulas import model_state_bytes, paper_table, recipe
from hf_zero.engine.planning import plan_model

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


def test_trainable_fraction_counts_frozen_parameters_apart(capsys):
    """Issue #11 item 4: a LoRA-style 1% trainable 7.5B model on N = 64 (paper recipe, K = 12). Frozen weights
    hold only their 2-byte compute copy (all of it at stages 0-2, 1/N at stage 3), are never communicated at
    stages 0-2, and are all-gathered twice per step at stage 3 like the trainable ones."""
    from hf_zero.cli import main

    psi, n = 7.5e9, 64
    t, f = 0.01 * psi, 0.99 * psi
    assert main(["estimate", "--params", str(psi), "--num-processes", str(n), "--optimizer-k", "12",
                 "--trainable-fraction", "0.01", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = {0: 16 * t + 2 * f, 1: 4 * t + 12 * t / n + 2 * f, 2: 2 * t + 14 * t / n + 2 * f, 3: (16 * t + 2 * f) / n}
    comm = {0: {"all_reduce": 2 * t}, 1: {"reduce_scatter": t, "all_gather": t},
            2: {"reduce_scatter": t, "all_gather": t}, 3: {"reduce_scatter": t, "all_gather": 2 * (t + f)}}
    assert out["psi"] == pytest.approx(t) and out["frozen"] == pytest.approx(f)
    for stage in range(4):
        row = out["stages"][str(stage)]
        assert row["model_states"] == pytest.approx(want[stage], rel=1e-12), stage
        assert row["comm_elements"] == pytest.approx(comm[stage], rel=1e-12), stage
    assert main(["estimate", "--params", "1e9", "--num-processes", "8", "--trainable-fraction", "1.5"]) == 2
    assert main(["estimate", "--model", "x.json", "--num-processes", "8", "--trainable-fraction", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--trainable-fraction must be in (0, 1]" in err and "plan mode counts the model's own requires_grad" in err


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


def _precision(cfg):
    return {"mixed_precision": cfg.mixed_precision, "grad_accum_dtype": cfg.grad_accum_dtype}


def _check(dist_results, world_size, name, kind, cfg):
    measured = dist_results(world_size, name)
    with torch.device("meta"):
        model = models.make_model(kind)  # the planner and the count need shapes only
    for rank, stats in enumerate(measured):
        want = state_bytes(model, world_size, cfg.stage, rank, **_precision(cfg))  # independent of hf_zero
        got = estimate_plan(model, world_size, cfg, rank=rank)
        for who, values in (("memory_stats", stats), ("estimate_plan", got)):
            assert {k: values[k] for k in KEYS + ("model_states",)} == want, (
                f"{name} N={world_size} rank {rank}: {who} {values} vs the count {want}")
    worst = worst_rank_bytes(model, world_size, cfg.stage, **_precision(cfg))["model_states"]
    assert worst == max(s["model_states"] for s in measured)
    plan = plan_model(model, world_size, cfg)  # the estimator's own entry points over its plan
    assert max_over_ranks(plan, cfg)["model_states"] == worst
    assert upper_bound_bytes(plan, cfg) >= worst


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
    assert got == state_bytes(models.make_model("llama"), 3, 3, 0)
    assert got == plan_bytes(plan_model(models.make_model("llama"), 3, zc), zc, 0)  # and it is the plan's


# ------------------------------------------------------------------------------------------------------ multiple hosts
# N ranks in hosts of K, per rank and step, paper counting (all-gather / reduce-scatter of Ψ: Ψ, all-reduce: 2Ψ), a
# collective intra-host when its group is inside one host, inter-host when it spans hosts. Expected values are
# written out here from the option's definition, not taken from formulas.py.
def _json(capsys, *args):
    from hf_zero.cli import main

    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _rows(out):
    return {(int(s), o): row for s, options in out["hierarchical"].items() for o, row in options.items()}


def _paper_hosts_expectations(psi, n, k, m=1, t=None, f=0.0):
    """{(stage, option): (model-state bytes, intra elements by kind, inter elements by kind)} for the paper's recipe
    (P = G = 2, K_opt = 12); `t` trainable and `f` frozen elements (t defaults to psi)."""
    t = psi if t is None else t
    w = t + f  # what stage 3 gathers
    return {
        (0, "none"): (16 * t + 2 * f, {}, {"all_reduce": 2 * t}),
        (1, "none"): (4 * t + 12 * t / n + 2 * f, {}, {"reduce_scatter": t, "all_gather": t}),
        (2, "none"): (2 * t + 14 * t / n + 2 * f, {}, {"reduce_scatter": m * t, "all_gather": t}),
        (3, "none"): ((16 * t + 2 * f) / n, {}, {"reduce_scatter": m * t, "all_gather": 2 * m * w}),
        # HSDP: the plain stage over the host's K ranks, plus the all-reduce of the t/K gradient shard across hosts
        (1, "hsdp"): (4 * t + 12 * t / k + 2 * f, {"reduce_scatter": t, "all_gather": t}, {"all_reduce": 2 * t / k}),
        (2, "hsdp"): (2 * t + 14 * t / k + 2 * f, {"reduce_scatter": m * t, "all_gather": t},
                      {"all_reduce": m * 2 * t / k}),
        (3, "hsdp"): ((16 * t + 2 * f) / k, {"reduce_scatter": m * t, "all_gather": 2 * m * w},
                      {"all_reduce": m * 2 * t / k}),
        # hpZ: forward all-gather and reduce-scatter over all N, backward all-gather from the host's secondary
        # shard, which costs 2 bytes x w / K on top of stage 3
        (3, "hpz"): ((16 * t + 2 * f) / n + 2 * w / k, {"all_gather": m * w},
                     {"reduce_scatter": m * t, "all_gather": m * w}),
    }


def _check_rows(rows, want, byte_of=None):
    byte_of = byte_of or {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}
    assert set(rows) == set(want)
    for key, (states, intra, inter) in want.items():
        row = rows[key]
        assert row["model_states"] == pytest.approx(states, rel=1e-12), key
        assert row["comm_elements"]["intra"] == pytest.approx(intra, rel=1e-12), key
        assert row["comm_elements"]["inter"] == pytest.approx(inter, rel=1e-12), key
        assert row["intra_elements"] == pytest.approx(sum(intra.values()), rel=1e-12), key
        assert row["inter_elements"] == pytest.approx(sum(inter.values()), rel=1e-12), key
        assert row["inter_bytes"] == pytest.approx(sum(v * byte_of[k] for k, v in inter.items()), rel=1e-12), key


def test_hosts_formula_7p5b_on_8_hosts_of_8(capsys):
    """The paper's 7.5B on N = 64 in hosts of 8: plain stage 3 sends 3Ψ across hosts, hpZ 2Ψ (Ψ stays inside),
    HSDP 2Ψ/8 at every stage; HSDP's memory is the stage's formula with N = 8, hpZ's is 16Ψ/64 + 2Ψ/8."""
    psi, n, k = 7.5e9, 64, 8
    out = _json(capsys, "--params", "7.5e9", "--num-processes", "64", "--ranks-per-host", "8", "--optimizer-k", "12")
    assert (out["ranks_per_host"], out["hosts"]) == (8, 8)
    rows = _rows(out)
    _check_rows(rows, _paper_hosts_expectations(psi, n, k))
    assert rows[3, "none"]["inter_elements"] == pytest.approx(3 * psi)
    assert rows[3, "hpz"]["inter_elements"] == pytest.approx(2 * psi)
    assert rows[3, "hpz"]["intra_elements"] == pytest.approx(psi)
    assert rows[3, "hsdp"]["inter_elements"] == pytest.approx(2 * psi / 8)
    assert rows[2, "hsdp"]["model_states"] == pytest.approx(2 * psi + 14 * psi / 8)
    assert rows[3, "hpz"]["model_states"] == pytest.approx(16 * psi / 64 + 2 * psi / 8)
    for stage in range(4):  # the plain rows are the plain table's numbers, all of them inter-host
        assert rows[stage, "none"]["model_states"] == out["stages"][str(stage)]["model_states"]
        assert rows[stage, "none"]["comm_elements"]["inter"] == out["stages"][str(stage)]["comm_elements"]


def test_hosts_formula_1t_on_128_hosts_and_micro_batches(capsys):
    """1e12 parameters on N = 1024 in hosts of 8, with 4 micro-batches per step: stages 2/3 reduce (and HSDP
    all-reduces the shard) every micro-batch, stage 1 once per step; stage 3 gathers every micro-batch."""
    psi, n, k, m = 1e12, 1024, 8, 4
    out = _json(capsys, "--params", "1e12", "--num-processes", "1024", "--ranks-per-host", "8", "--optimizer-k", "12",
                "--micro-batches", "4")
    _check_rows(_rows(out), _paper_hosts_expectations(psi, n, k, m))
    one = _rows(_json(capsys, "--params", "1e12", "--num-processes", "1024", "--ranks-per-host", "8"))
    assert one[3, "hpz"]["model_states"] == pytest.approx(16e12 / 1024 + 2e12 / 8)  # 265.6 GB
    assert one[3, "hsdp"]["model_states"] == pytest.approx(16e12 / 8)


def test_hosts_formula_counts_frozen_parameters(capsys):
    """A 1%-trainable 7.5B (LoRA-like): frozen weights are gathered at stage 3 (and by hpZ's secondary shard),
    never reduced; HSDP's cross-host all-reduce carries the trainable shard only."""
    psi, n, k = 7.5e9, 64, 8
    out = _json(capsys, "--params", "7.5e9", "--num-processes", "64", "--ranks-per-host", "8", "--optimizer-k", "12",
                "--trainable-fraction", "0.01")
    _check_rows(_rows(out), _paper_hosts_expectations(psi, n, k, t=0.01 * psi, f=0.99 * psi))


def test_hosts_table(capsys):
    from hf_zero.cli import main

    assert main(["estimate", "--params", "7.5e9", "--num-processes", "64", "--ranks-per-host", "8"]) == 0
    table = capsys.readouterr().out
    assert "Multiple hosts: N = 64 ranks in 8 hosts of K = 8 ranks" in table
    lines = {line.split("  ")[0].strip(): line.split() for line in table.splitlines() if line.startswith("stage ")}
    # the plain table and the hosts table both start rows with "stage 3": the dict keeps the hosts table's row
    assert lines["stage 3 hpZ"][3] == "3.8" and lines["stage 3 hpZ"][-2:] == ["1", "2"]  # GB, intra / inter in Ψ
    assert lines["stage 3"][-2:] == ["0", "3"]
    assert lines["stage 2 HSDP"][3] == "28.1" and lines["stage 2 HSDP"][-1] == "0.25"
    assert main(["estimate", "--params", "7.5e9", "--num-processes", "64"]) == 0
    assert "Multiple hosts" not in capsys.readouterr().out  # the table only when asked for


def test_hosts_default_is_one_host_and_k_1_or_n_is_the_plain_stage(capsys):
    """Without --ranks-per-host, K = N (one host): only the plain stages, everything intra-host. K = 1 or K = N
    turns HSDP and hpZ off (the engine runs them as the plain stage), so only the plain rows are reported."""
    psi = 7.5e9
    out = _json(capsys, "--params", "7.5e9", "--num-processes", "64")
    assert (out["ranks_per_host"], out["hosts"]) == (64, 1)
    rows = _rows(out)
    assert set(rows) == {(s, "none") for s in range(4)}
    assert all(r["inter_elements"] == 0 for r in rows.values())
    assert rows[3, "none"]["intra_elements"] == pytest.approx(3 * psi)
    ones = _rows(_json(capsys, "--params", "7.5e9", "--num-processes", "64", "--ranks-per-host", "1"))
    assert set(ones) == set(rows) and all(r["intra_elements"] == 0 for r in ones.values())
    assert ones[3, "none"]["inter_elements"] == pytest.approx(3 * psi)
    from hf_zero.tools.estimate.formulas import hierarchical_comm_elements, hierarchical_state_bytes

    for k, side in ((64, "intra"), (1, "inter")):
        for option in ("hsdp", "hpz"):
            assert hierarchical_comm_elements(psi, 64, k, 3, option)[side] == {"reduce_scatter": psi,
                                                                                "all_gather": 2 * psi}
            assert hierarchical_state_bytes(psi, 64, k, 3, option) == 16 * psi / 64
    for stage, option in ((2, "hpz"), (0, "hsdp"), (3, "zero++")):
        with pytest.raises(ValueError):
            hierarchical_comm_elements(psi, 64, 8, stage, option)
        with pytest.raises(ValueError):
            hierarchical_state_bytes(psi, 64, 8, stage, option)


@pytest.mark.parametrize("args,needle", [
    (["--ranks-per-host", "6"], "--ranks-per-host 6 does not divide --num-processes 64"),
    (["--ranks-per-host", "128"], "--ranks-per-host 128 is more than --num-processes 64"),
    (["--ranks-per-host", "0"], "--ranks-per-host must be at least 1"),
])
def test_hosts_validation(capsys, args, needle):
    from hf_zero.cli import main

    assert main(["estimate", "--params", "7.5e9", "--num-processes", "64", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    if "6" in args:
        assert "such as 4 or 8" in err and "multiple of 6 (such as 66)" in err


def test_hosts_need_num_processes(capsys):
    from hf_zero.cli import main

    assert main(["estimate", "--params", "7.5e9", "--ranks-per-host", "8", "--fits", "80"]) == 2
    assert "--ranks-per-host K needs --num-processes N" in capsys.readouterr().err


def _padded(groups, keep=lambda g: True):
    return sum(g.padded for g in groups if keep(g))


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_hosts_plan_mode_is_the_planners_layout(variant):
    """Plan mode: HSDP's memory is the stage's over the K ranks of a host (its K-way padding), worst rank; hpZ's is
    stage 3 over N plus 1/K of the padded groups, in the compute dtype, of every unit that reshards (all but the
    resident ones: the root and, by default (reshard_after_forward="auto", as torchtitan does), the last block);
    the traffic counts the padded flat buffers, frozen ones (LoRA's base weights) gathered at stage 3 and never
    reduced, the resident ones gathered once. Sizes and bytes from tests/_flat_layout.py."""
    from hf_zero.tools.estimate.plan import Planner, hierarchical_plan_report

    model = models.make_model("llama", variant)  # 44,450 elements: a K = 3 partition pads
    n, k = 6, 3
    base = ZeroConfig(mixed_precision="bf16")
    report = hierarchical_plan_report(Planner(model, base), n, k)
    for (stage, option), row in _rows({"hierarchical": report}).items():
        p = k if option == "hsdp" else n
        groups = layout(model, 1 if stage == 0 else p, torch.bfloat16)
        worst = worst_rank_bytes(model, p, stage, mixed_precision="bf16")["model_states"]
        t, f = _padded(groups, lambda g: g.trainable), _padded(groups, lambda g: not g.trainable)
        resident_units = {0, len(unit_prefixes(model))}  # the root and the last block
        root = _padded(groups, lambda g: g.unit in resident_units)  # the resident elements
        if option == "hsdp":
            assert sum(g.padded - g.numel for g in groups) > 0 or variant == "lora"
            # the engine's own HSDP layout (N ranks, partitioned K ways) holds the same bytes
            assert worst_rank_bytes(model, n, stage, mixed_precision="bf16", partition=k)["model_states"] == worst
            if "partition_size" in inspect.signature(plan_model).parameters:  # and so does hf_zero's plan of it
                cfg = ZeroConfig(stage=stage, mixed_precision="bf16")
                assert max_over_ranks(plan_model(model, n, cfg, partition_size=k), cfg)["model_states"] == worst
            assert row["model_states"] == worst, (stage, option)
            shard = sum(g.shard for g in groups if g.trainable)
            assert row["comm_elements"]["inter"] == {"all_reduce": 2 * shard}
            gathered = t if stage < 3 else 2 * (t + f) - root
            assert row["comm_elements"]["intra"] == {"reduce_scatter": t, "all_gather": gathered}
        elif option == "hpz":
            secondary = sum(g.padded // k * 2 for g in groups if g.unit not in resident_units)
            assert row["secondary_bytes"] == secondary > 0
            assert row["model_states"] == worst + secondary
            assert row["comm_elements"] == {"intra": {"all_gather": t + f - root},
                                            "inter": {"reduce_scatter": t, "all_gather": t + f}}
        else:
            assert row["model_states"] == worst and row["comm_elements"]["intra"] == {}
            want = {0: {"all_reduce": 2 * t}, 3: {"reduce_scatter": t, "all_gather": 2 * (t + f) - root}}
            assert row["comm_elements"]["inter"] == want.get(stage, {"reduce_scatter": t, "all_gather": t})


def test_hosts_plan_cli_and_wire_bytes(tmp_path, capsys):
    """--model with --ranks-per-host: the HSDP rows are the worst rank of a K-way layout; bytes on the wire:
    all-gathers in bf16, stage-2/3 reductions in fp32 (reduce_dtype's default under bf16), stage 0/1 reductions in
    the fp32 accumulator, and with reduce_dtype="compute" in bf16."""
    from hf_zero.tools.estimate.plan import wire_bytes

    models._config("gpt2").save_pretrained(tmp_path)
    out = _json(capsys, "--model", str(tmp_path), "--num-processes", "4", "--ranks-per-host", "2")
    model = models.make_model("gpt2")
    rows = _rows(out)
    assert set(rows) == {(0, "none"), (1, "none"), (1, "hsdp"), (2, "none"), (2, "hsdp"), (3, "none"), (3, "hsdp"),
                         (3, "hpz")}
    for stage in (1, 2, 3):
        want = worst_rank_bytes(model, 2, stage, mixed_precision="bf16")
        assert {k: rows[stage, "hsdp"]["max"][k] for k in want} == want, stage
        assert rows[stage, "hsdp"]["partition_size"] == 2
        inter = rows[stage, "hsdp"]["comm_elements"]["inter"]["all_reduce"]
        assert rows[stage, "hsdp"]["inter_bytes"] == 4 * inter
        intra = rows[stage, "hsdp"]["comm_bytes"]["intra"]
        rs = rows[stage, "hsdp"]["comm_elements"]["intra"]["reduce_scatter"]
        assert intra["reduce_scatter"] == 4 * rs
    ag = rows[3, "none"]["comm_elements"]["inter"]["all_gather"]
    assert rows[3, "none"]["comm_bytes"]["inter"]["all_gather"] == 2 * ag
    assert out["stages"]["2"]["comm_bytes"]["reduce_scatter"] == 4 * out["stages"]["2"]["comm_elements"][
        "reduce_scatter"]
    for stage, kwargs, want in ((2, {}, 4), (2, {"reduce_dtype": "compute"}, 2), (1, {}, 4),
                                (1, {"grad_accum_dtype": "compute"}, 2), (0, {}, 4)):
        cfg = ZeroConfig(stage=stage, mixed_precision="bf16", **kwargs)
        got = wire_bytes(plan_model(model, 4, cfg), cfg)
        assert got == {"all_gather": 2, "reduce_scatter": want, "all_reduce": want}, (stage, kwargs)


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
    res = _cli("--model", str(path), "--num-processes", str(n), "--fits", "80", "--ranks-per-host", "8", "--json")
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
    # hosts of 8: HSDP sends 2Ψ/8 across hosts, hpZ 2Ψ, plain stage 3 3Ψ less the root unit gathered once
    psi, rows = out["psi"], _rows(out)
    for stage in (1, 2, 3):
        assert rows[stage, "hsdp"]["inter_elements"] == pytest.approx(2 * psi / 8, rel=1e-6)
        states = rows[stage, "hsdp"]["model_states"]
        assert abs(states - model_state_bytes(psi, 8, stage, formula_recipe("bf16", None, "fp32"))) / states < 0.01
    assert rows[3, "hpz"]["inter_elements"] == pytest.approx(2 * psi, rel=1e-6)
    assert 2.9 * psi < rows[3, "none"]["inter_elements"] < 3 * psi
    # hpZ adds a bf16 secondary shard over 8 ranks of every unit that reshards after forward: by default all but the
    # root and the last unit, counted here from the config. Under the default live-parameter budget (1e9 elements)
    # a layer of the 7b config (2e8) is one unit; one of the 1t config (4h² + 3hf = 7.9e9) is split into its
    # projections and norms, and so is the root (2vh + h = 1.6e9) into the embeddings with the final norm (their
    # parent, `model`) and the head, which is then the last unit, kept gathered; the root keeps nothing
    h, f, v = values["hidden_size"], values["intermediate_size"], values["vocab_size"]
    layer = 4 * h * h + 3 * h * f + 2 * h
    resident = v * h if layer > 10**9 else 2 * v * h + h + layer
    assert abs(rows[3, "hpz"]["model_states"] - (s3 + 2 * (psi - resident) / 8)) / s3 < 0.01


# ------------------------------------------------------------------------------------------------------ activations
# The estimate (hf_zero.tools.estimate.activations.activation_bytes, a formula) is checked against two measurements of real tiny HF
# models in train mode on the CPU, with eager or sdpa attention, fp32 or bf16, with and without hf_zero's
# activation checkpointing:
#   - LiveBytes: every tensor storage an aten op creates is counted until it is freed (a weakref finaliser on the
#     storage); "stored" = bytes alive after the forward, with only the loss held; "peak" = the most alive at once
#     during forward + backward, parameter gradients excluded. It sees what checkpointing keeps in Python closures.
#   - saved_tensors_hooks: the unique storages autograd saves for the backward (no checkpointing only: checkpointed
#     layers keep their inputs outside autograd's saved tensors).
# Parameters (and views of them, such as weight.t()) are excluded from both: they are model states.
# Relative tolerances. Measured here (torch 2.13, transformers 5.24): stored within 3% in every case; peak within 8%
# except checkpointed Llama in bf16 with sdpa (+17%: the formula adds the recomputed layer to everything stored,
# while the loss's log-probabilities are already freed when the layers recompute).
STORED_TOLERANCE = 0.10
PEAK_TOLERANCE = 0.25
ACT_BATCH, ACT_SEQ = 2, 128


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, followed op by op; parameter storages are not counted."""

    def __init__(self, params):
        super().__init__()
        self.params = list(params)
        self.skip = {p.untyped_storage().data_ptr() for p in self.params}
        self.sizes = {}
        self.live = self.peak = 0

    def _free(self, key):
        self.live -= self.sizes.pop(key)

    def _grad_bytes(self):
        return sum(self.sizes.get(p.grad.untyped_storage().data_ptr(), 0) for p in self.params if p.grad is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if st.nbytes() and key not in self.sizes and key not in self.skip:
                    self.sizes[key] = st.nbytes()
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.live - self._grad_bytes())
        return out


def saved_tensor_bytes(model, ids):
    """Unique non-parameter storages autograd saves during one forward (and the loss, for the backward)."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    return sum(seen.values()), loss


def act_model(kind, dtype, attention, dropout=0.0, checkpointing=False):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from hf_zero.engine.activations import enable_activation_checkpointing

    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=256, n_positions=ACT_SEQ, n_embd=64, n_layer=3, n_head=4, use_cache=False,
                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    else:  # llama: SwiGLU, RMSNorm, rotary; "llama-gqa" has 2 key/value heads for 4 query heads
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, num_attention_heads=4, intermediate_size=172,
                          num_key_value_heads=2 if kind == "llama-gqa" else 4, num_hidden_layers=3,
                          max_position_embeddings=ACT_SEQ, use_cache=False, attention_dropout=dropout)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention).to(dtype)
    model.train()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable_activation_checkpointing(model)
    return model


def measure_activations(kind, dtype, attention, dropout=0.0, checkpointing=False):
    model = act_model(kind, dtype, attention, dropout, checkpointing)
    ids = torch.randint(0, 256, (ACT_BATCH, ACT_SEQ), generator=torch.Generator().manual_seed(1))
    out = {}
    if not checkpointing:
        out["saved"], loss = saved_tensor_bytes(model, ids)
        del loss
    mode = LiveBytes(model.parameters())
    with mode:
        loss = model(input_ids=ids, labels=ids).loss
        out["stored"] = mode.live
        loss.backward()
    out["peak"] = mode.peak
    return model, out


def _close(got, want, what, tolerance=STORED_TOLERANCE):
    assert abs(got - want) <= tolerance * want, f"{what}: estimate {got:,} vs measured {want:,}"


def test_activation_formula_reduces_to_the_papers():
    """With the paper's assumptions (GPT layer, 4h GeLU MLP, LayerNorm, dropout with 1-byte masks, 16-bit, softmax
    in 16-bit) the term-by-term count is s·b·h·(34 + 5·a·s/h) exactly, plus the LayerNorm statistics
    (2 x 8 bytes per token) the paper does not count."""
    for s, b, h, a in ((2048, 1, 12288, 96), (1024, 8, 768, 12), (128, 2, 64, 4)):
        shape = ActivationShape(layers=1, hidden=h, heads=a, kv_heads=a, head_dim=h // a, intermediate=4 * h,
                                vocab=50257, gated_mlp=False, act_saved=1, rms_norm=False, softmax_fp32=False,
                                attn_dropout=0.1, resid_dropout=0.1, embd_dropout=0.1)
        got = layer_activation_bytes(shape, b, s, dtype_bytes=2, attention="eager", mask_bytes=1)["total"]
        assert got - 2 * 8 * s * b == paper_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


@pytest.mark.parametrize("name,count", [("gelu", 1), ("gelu_pytorch_tanh", 1), ("silu", 1), ("relu", 0),
                                        ("gelu_new", 4)])
def test_activation_function_probe(name, count):
    assert activation_saved_tensors(name) == count


ACT_CASES = [
    ("gpt2", torch.float32, "eager", 0.0), ("gpt2", torch.bfloat16, "eager", 0.0), ("gpt2", torch.float32, "sdpa", 0.0),
    ("gpt2", torch.float32, "eager", 0.1),
    ("llama", torch.float32, "eager", 0.0), ("llama", torch.bfloat16, "eager", 0.0),
    ("llama", torch.bfloat16, "sdpa", 0.0), ("llama-gqa", torch.float32, "eager", 0.0),
    ("llama-gqa", torch.float32, "sdpa", 0.0), ("llama", torch.float32, "eager", 0.1),
]


@pytest.mark.parametrize("kind,dtype,attention,dropout", ACT_CASES,
                         ids=[f"{k}-{str(d)[6:]}-{a}-p{p}" for k, d, a, p in ACT_CASES])
def test_activation_estimate_matches_measurement(kind, dtype, attention, dropout):
    e = torch.empty((), dtype=dtype).element_size()
    mask_bytes = e  # torch's CPU dropout keeps a mask in the input's dtype (the fused GPU kernel: 1 byte)
    estimates, measured = {}, {}
    for ckpt in (False, True):
        model, measured[ckpt] = measure_activations(kind, dtype, attention, dropout, ckpt)
        estimates[ckpt] = activation_bytes(activation_shape(model), ACT_BATCH, ACT_SEQ, e, ckpt, attention, mask_bytes)
    no, ck = estimates[False], estimates[True]
    _close(no["stored"], measured[False]["stored"], "stored, no checkpointing (live bytes)")
    _close(no["stored"], measured[False]["saved"], "stored, no checkpointing (saved tensors)")
    _close(no["peak"], measured[False]["peak"], "peak, no checkpointing", PEAK_TOLERANCE)
    _close(ck["stored"], measured[True]["stored"], "stored, checkpointing")
    _close(ck["peak"], measured[True]["peak"], "peak, checkpointing", PEAK_TOLERANCE)
    ratio = measured[False]["stored"] / measured[True]["stored"]
    assert abs(no["stored"] / ck["stored"] - ratio) <= STORED_TOLERANCE * ratio, "checkpointing's reduction factor"
    assert ratio > 3  # checkpointing really removes most of what the layers keep


def test_activation_report_and_fits_cli(tmp_path, capsys):
    """--batch-size/--seq-len add both activation estimates, and --fits counts the peak on top of the model states."""
    from hf_zero.cli import main

    path = tmp_path / "7b.json"
    path.write_text(json.dumps(LLAMA_7B))
    args = ["estimate", "--model", str(path), "--num-processes", "8", "--batch-size", "1", "--seq-len", "4096",
            "--fits", "80"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    act = out["activations"]
    assert act["dtype_bytes"] == 2 and act["shape"]["gated_mlp"] and act["shape"]["rms_norm"]
    no, ck = act["no_checkpointing"], act["checkpointing"]
    t, h, layers = 4096, 4096, 32
    assert ck["layers"] == layers * 2 * t * h  # one 16-bit layer input per layer
    assert ck["peak"] == ck["stored"] + ck["per_layer"]  # recompute one layer (bigger than the loss's transient)
    assert no["layers"] == layers * no["per_layer"] and no["stored"] > 10 * ck["stored"]
    fits = out["fits"]
    for mode, mins in fits["with_activations"].items():
        for stage, n in mins.items():
            base = fits["min_world_size"][stage]
            assert n is None or (base is not None and n >= base), (mode, stage)
    assert fits["with_activations"]["no_checkpointing"]["3"] is None  # > 80 GB of activations alone
    n3 = fits["with_activations"]["checkpointing"]["3"]
    assert n3 is not None
    from hf_zero.integrations.hf_models import meta_model
    from hf_zero.tools.estimate.plan import Planner

    model, zc = meta_model(str(path)), ZeroConfig(mixed_precision="bf16")
    planner = Planner(model, zc)
    need = lambda n: upper_bound_bytes(planner.plan(3, n), planner.config_for(3)) + ck["peak"]  # noqa: E731
    assert need(n3) <= 80e9 and (n3 == 1 or need(n3 - 1) > 80e9)
    assert main(["estimate", "--params", "7e9", "--num-processes", "8", "--batch-size", "1", "--seq-len", "8"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["estimate", "--model", str(path), "--batch-size", "2", "--seq-len", "16", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # activations only: no N needed
    assert alone["activations"]["checkpointing"]["layers"] == layers * 2 * 32 * h and "fits" not in alone
    assert main(args) == 0  # the table
    table = capsys.readouterr().out
    assert "Activations per device" in table and "Korthikanti" in table and "with activations, checkpointing" in table


def test_missing_or_incomplete_config_is_a_clear_error(tmp_path, capsys):
    from hf_zero.cli import main

    missing = tmp_path / "nope.json"
    assert main(["estimate", "--model", str(missing), "--num-processes", "2"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such config file" in err and "Traceback" not in err
    untyped = tmp_path / "untyped.json"
    untyped.write_text('{"n_embd": 8}')
    assert main(["estimate", "--model", str(untyped), "--num-processes", "2"]) == 2
    err = capsys.readouterr().err
    assert str(untyped) in err and "model_type" in err


# ------------------------------------------------------------------------------------------------------ ZeRO++
# Hand-computed: Ψ = 1000, root r = 200, blocks of 64, 2-byte compute and reduce dtype. quantized_nbytes(n) is
# n codes (int8) or ceil(n / 2) (int4) plus 4 bytes per ceil(n / 64) blocks:
#   int8: q(500) = 500 + 32 = 532, q(400) = 400 + 28 = 428, q(250) = 250 + 16 = 266, q(200) = 200 + 16 = 216
#   int4: q(500) = 250 + 32 = 282, q(250) = 125 + 16 = 141
# N = 2, K = 1 (every group spans hosts; hpZ and HSDP are off); N = 4, K = 2 (two hosts of two).
ZEROPP_SMALL = {
    (2, 1): {
        "stage 3": (0, 2000 + 1600 + 2000),
        "stage 3 hpZ": (0, 5600),
        "stage 3 qwZ": (0, 2 * 532 + 2 * 428 + 2000),
        "stage 3 hpZ + qwZ": (0, 1064 + 856 + 2000),
        "stage 3 hpZ + qwZ + qgZ": (0, 1064 + 856 + 2 * 282),  # K = 1: qgZ in one hop, inter-host
        "stage 3 qgZ": (0, 2000 + 1600 + 564),
        "stage 3 HSDP": (0, 5600),
        "stage 2": (0, 2000 + 2000),  # reduce-scatter per micro-batch, parameter all-gather per step
        "stage 2 qgZ": (0, 2000 + 564),
    },
    (4, 2): {
        "stage 3": (0, 5600),
        "stage 3 hpZ": (800 * 2, 2000 + 2000),
        "stage 3 qwZ": (0, 4 * 266 + 4 * 216 + 2000),
        "stage 3 hpZ + qwZ": (1600, 1064 + 2000),  # the host gather stays in the compute dtype
        # qgZ's two hops: all-to-all of all 1000 elements in the host (4 chunks of 250), then of the host-summed
        # 500 among the 2 ranks of the same local index (2 chunks of 250)
        "stage 3 hpZ + qwZ + qgZ": (1600 + 4 * 141, 1064 + 2 * 141),
        "stage 3 qgZ": (564, 2000 + 1600 + 282),
        "stage 3 HSDP": (5600, 2 * 1000 / 2 * 2),  # the plain stage over K = 2, the 500-element shard all-reduced
        "stage 2": (0, 4000),
        "stage 2 qgZ": (564, 2000 + 282),
    },
}


def _zeropp_kwargs(options, **extra):
    from hf_zero.tools.estimate.plan import zeropp_options

    return dict(zeropp_options(options, 8, 4), **extra)


@pytest.mark.parametrize("n,k", sorted(ZEROPP_SMALL))
def test_zeropp_bytes_small_cases_by_hand(n, k):
    from hf_zero.tools.estimate.formulas import ZEROPP_COMBINATIONS, zeropp_bytes_per_step

    assert set(ZEROPP_COMBINATIONS) == set(ZEROPP_SMALL[n, k])
    for label, (stage, options) in ZEROPP_COMBINATIONS.items():
        got = zeropp_bytes_per_step(1000, n, k, stage, block_size=64, dtype_bytes=2, resident=200,
                                    **_zeropp_kwargs(options))
        intra, inter = ZEROPP_SMALL[n, k][label]
        assert got == {"intra": intra, "inter": inter}, (n, k, label)
        m3 = zeropp_bytes_per_step(1000, n, k, stage, block_size=64, micro_batches=3, resident=200,
                                   **_zeropp_kwargs(options))
        if stage == 3:  # everything per micro-batch
            assert m3 == {"intra": 3 * intra, "inter": 3 * inter}, label
        else:  # the parameter all-gather once per step
            assert m3["inter"] == 3 * (inter - 2000) + 2000 and m3["intra"] == 3 * intra, label


def test_zeropp_rounding_dtypes_and_one_host():
    from hf_zero.tools.estimate.formulas import zeropp_bytes_per_step, zeropp_collectives

    # 1001 / 4 = 250.25 -> 251-element chunks (the engine pads to a multiple of N): int8 q(251) = 251 + 16, forward
    # and backward all-gathers, then the unquantized reduce-scatter
    assert zeropp_bytes_per_step(1001, 4, 1, 3, weights_bits=8, block_size=64)["inter"] == 2 * 4 * 267 + 1001 * 2
    # int4 with an odd chunk: q(501) = 251 + 4 * 8 = 283
    assert zeropp_bytes_per_step(1002, 2, 1, 2, gradients_bits=4, block_size=64)["inter"] == 2 * 283 + 1002 * 2
    # fp32 reductions (hf_zero's default under bf16) double the reduce-scatter only
    assert zeropp_bytes_per_step(1000, 2, 1, 3, reduce_dtype_bytes=4) == {"intra": 0, "inter": 2000 + 2000 + 4000}
    # one host (K = N): everything intra-host, hpZ off, qgZ in one hop
    one = zeropp_collectives(1000, 4, 4, 3, hpz=True, weights_bits=8, gradients_bits=4, block_size=64)
    assert [(c.what, c.side, c.nbytes) for c in one] == [
        ("forward all-gather", "intra", 1064), ("backward all-gather", "intra", 4 * 266), ("qgZ all-to-all", "intra",
                                                                                           564)]


def test_zeropp_bytes_n64_k8_by_hand():
    """Llama-7B's Ψ = 6.74e9 on 8 hosts of 8, blocks of 256: each rank's chunk is 6.74e9 / 64 = 105,312,500
    elements in ceil(105,312,500 / 256) = 411,377 blocks (1,645,508 bytes of scales)."""
    from hf_zero.tools.estimate.formulas import inter_bytes_per_host, zeropp_bytes_per_step, zeropp_collectives

    psi, n, k = 6.74e9, 64, 8
    q8, q4 = 105_312_500 + 1_645_508, 52_656_250 + 1_645_508
    assert zeropp_bytes_per_step(psi, n, k, 3) == {"intra": 0, "inter": 40_440_000_000}
    assert zeropp_bytes_per_step(psi, n, k, 3, hpz=True, resident=262_144_000) == {
        "intra": (psi - 262_144_000) * 2, "inter": 2 * psi * 2}
    assert zeropp_bytes_per_step(psi, n, k, 3, weights_bits=8) == {"intra": 0, "inter": 2 * 64 * q8 + psi * 2}
    full = zeropp_collectives(psi, n, k, 3, hpz=True, weights_bits=8, gradients_bits=4)
    assert [(c.what, c.side, c.nbytes, c.host_ranks) for c in full] == [
        ("forward all-gather", "inter", 64 * q8, 8), ("backward all-gather", "intra", psi * 2, 8),
        ("qgZ all-to-all in host", "intra", 64 * q4, 8), ("qgZ all-to-all across hosts", "inter", 8 * q4, 1)]
    assert 64 * q8 == 6_845_312_512 and 8 * q4 == 434_414_064
    assert inter_bytes_per_host(full, k) == 64 * q8 + 8 * 8 * q4
    assert zeropp_bytes_per_step(psi, n, k, 3, hsdp=True) == {"intra": 3 * psi * 2, "inter": 2 * psi / 8 * 2}


def test_zeropp_paper_ratio():
    """Wang et al. 2023: ZeRO-3 sends 3M across hosts per step, ZeRO++ 0.75M (M = 2Ψ, fp16). With one fp32 scale
    per 256 elements the hosts send 0.765625M, M/64 (2.1%) above the paper's: Ψ/64 bytes of scales on the int8
    forward all-gather and Ψ/64 on the int4 gradients. Per rank the ledger books qgZ's cross-host all-to-all as
    1/K of the host's, so hpZ + qwZ + qgZ is 0.540M per rank (0.18x plain stage 3)."""
    from hf_zero.tools.estimate.formulas import (PAPER_ZEROPP_INTER_M, inter_bytes_per_host, zeropp_bytes_per_step,
                                                 zeropp_collectives)

    psi, k = 7.5e9, 8
    m = 2 * psi
    for n in (64, 1024):
        plain = zeropp_collectives(psi, n, k, 3)
        assert inter_bytes_per_host(plain, k) == zeropp_bytes_per_step(psi, n, k, 3)["inter"] == 3 * m
        assert PAPER_ZEROPP_INTER_M["stage 3"] == 3
        full = zeropp_collectives(psi, n, k, 3, hpz=True, weights_bits=8, gradients_bits=4)
        per_host = inter_bytes_per_host(full, k) / m
        assert per_host == pytest.approx(0.75 + 1 / 64, abs=1e-6)  # 0.765625M
        assert PAPER_ZEROPP_INTER_M["stage 3 hpZ + qwZ + qgZ"] == 0.75
        assert per_host / PAPER_ZEROPP_INTER_M["stage 3 hpZ + qwZ + qgZ"] - 1 == pytest.approx(1 / 48, abs=1e-6)
        per_rank = zeropp_bytes_per_step(psi, n, k, 3, hpz=True, weights_bits=8, gradients_bits=4)["inter"] / m
        assert per_rank == pytest.approx(0.5 + 1 / 128 + (0.25 + 1 / 128) / k, abs=1e-6)  # 0.5400M
        assert per_rank / 3 < 0.3  # issue 22's goal for the measured inter-host bytes: at most 0.3x plain stage 3
        # the parts the paper names: qwZ's forward all-gather 0.5M, hpZ's backward 0 across hosts, qgZ 0.25M
        parts = {c.what: c.nbytes * k / c.host_ranks / m for c in full if c.side == "inter"}
        assert parts == pytest.approx({"forward all-gather": 0.5 + 1 / 128,
                                       "qgZ all-to-all across hosts": 0.25 + 1 / 128}, abs=1e-6)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(stage=1), "stages 2-3"),
    (dict(stage=2, hpz=True), "hpZ is a stage-3 option"),
    (dict(stage=2, weights_bits=8), "needs stage 3"),
    (dict(stage=3, weights_bits=2), r"must be None \(off\), 8 or 4"),
    (dict(stage=3, hpz=True, hsdp=True), "alternatives"),
    (dict(stage=3, hsdp=True, gradients_bits=4), "without quantization"),
    (dict(stage=3, block_size=0), "block_size"),
    (dict(stage=3, resident=2000), "resident"),
    (dict(stage=3, k=3), "must divide"),
])
def test_zeropp_validation(kwargs, needle):
    from hf_zero.tools.estimate.formulas import zeropp_bytes_per_step

    kwargs = dict(kwargs)
    stage, k = kwargs.pop("stage"), kwargs.pop("k", 2)
    with pytest.raises(ValueError, match=needle):
        zeropp_bytes_per_step(1000, 4, k, stage, **kwargs)


def test_zeropp_cli_table_and_json(capsys):
    from hf_zero.cli import main
    from hf_zero.tools.estimate.formulas import ZEROPP_COMBINATIONS

    assert main(["estimate", "--params", "6.74e9", "--zeropp"]) == 0
    text = capsys.readouterr().out
    assert "N = 64 ranks in 8 hosts of K = 8:" in text and "N = 1024 ranks in 128 hosts of K = 8:" in text
    header = [line for line in text.splitlines() if "intra-host GB / rank" in line]
    assert len(header) == 2 and all(h.split("  ")[-1].strip() == "paper (per host)" for h in header)
    rows = [line for line in text.splitlines() if line.startswith("stage ")]
    assert len(rows) == 2 * len(ZEROPP_COMBINATIONS) == 18
    cells = {line[:24].strip(): line[24:].split() for line in rows[:9]}
    assert list(cells) == list(ZEROPP_COMBINATIONS)
    assert cells["stage 3"] == ["0.000", "40.440", "3.0000", "3.0000", "3"]
    assert cells["stage 3 hpZ + qwZ + qgZ"] == ["16.955", "7.280", "0.5400", "0.7656", "0.75"]
    assert cells["stage 3 HSDP"][-1] == "-"
    out = _json(capsys, "--params", "6.74e9", "--zeropp", "--num-processes", "16", "--ranks-per-host", "4",
                "--weights-bits", "4", "--block-size", "128", "--micro-batches", "2")
    assert list(out["worlds"]) == ["16"] and out["ranks_per_host"] == 4 and out["block_size"] == 128
    row = out["worlds"]["16"]["stage 3 hpZ + qwZ + qgZ"]
    from hf_zero.tools.estimate.formulas import zeropp_bytes_per_step

    want = zeropp_bytes_per_step(6.74e9, 16, 4, 3, hpz=True, weights_bits=4, gradients_bits=4, block_size=128,
                                 micro_batches=2)
    assert (row["intra_bytes"], row["inter_bytes"]) == (want["intra"], want["inter"])
    assert sum(c["bytes"] for c in row["collectives"]) == want["intra"] + want["inter"]
    assert main(["estimate", "--params", "1e9", "--zeropp", "--num-processes", "12"]) == 2
    assert "--ranks-per-host 8 does not divide --num-processes 12" in capsys.readouterr().err
    assert main(["estimate", "--params", "1e9", "--zeropp", "--fits", "80", "--trainable-fraction", "0.1"]) == 2
    assert "drop --fits, --trainable-fraction" in capsys.readouterr().err


def test_zeropp_plan_mode_sums_the_groups(tmp_path, capsys):
    """--model: one collective per padded flat group (the engine's), gathers in bf16, reductions in fp32 (the
    default reduce dtype under bf16), the root unit's and, by default (reshard_after_forward="auto"), the last
    block's groups resident."""
    from hf_zero.engine.quantize import quantized_nbytes

    models._config("gpt2").save_pretrained(tmp_path)
    out = _json(capsys, "--model", str(tmp_path), "--zeropp", "--num-processes", "4", "--ranks-per-host", "2",
                "--block-size", "64")
    rows = out["worlds"]["4"]
    model = models.make_model("gpt2")
    groups = layout(model, 4, torch.bfloat16)
    sizes = [g.padded for g in groups]
    back = [g.padded for g in groups if g.unit not in (0, len(unit_prefixes(model)))]  # gathered for the backward
    assert out["psi"] == sum(p.numel() for p in model.parameters()) and all(g.trainable for g in groups)
    assert rows["stage 3"]["inter_bytes"] == 2 * sum(sizes) + 2 * sum(back) + 4 * sum(sizes)
    assert rows["stage 3 hpZ"]["intra_bytes"] == 2 * sum(back)
    q = lambda p, bits: 4 * quantized_nbytes(p // 4, 64, bits)  # noqa: E731
    full = rows["stage 3 hpZ + qwZ + qgZ"]
    hop1 = lambda p: 2 * quantized_nbytes(p // 2, 64, 4)  # noqa: E731  (qgZ inside a host of 2: rows of P/2)
    assert full["intra_bytes"] == 2 * sum(back) + sum(hop1(p) for p in sizes)
    assert full["inter_bytes"] == sum(q(p, 8) for p in sizes) + sum(q(p, 4) // 2 for p in sizes)


def test_quantized_frozen_weights_count_codes_and_scales_at_stage_3():
    """--quantized-frozen-weights: a stage-3 frozen shard is int8 codes plus an fp32 scale per block, in the formula
    (frozen/N x (1 + 4/block)) and in plan mode (quantized_nbytes of each frozen group's shard, as the engine's
    memory_stats counts it: tests/test_zeropp.py); other stages and the trainable states are unchanged."""
    from hf_zero.engine.quantize import quantized_nbytes
    from hf_zero.tools.estimate.plan import Planner, plan_bytes

    r = recipe("bf16")
    plain, quantized = (model_state_bytes(1e6, 4, 3, r, 9e6, block) for block in (None, 256))
    assert plain - quantized == pytest.approx(9e6 / 4 * (2 - (1 + 4 / 256)))
    assert model_state_bytes(1e6, 4, 2, r, 9e6, 256) == model_state_bytes(1e6, 4, 2, r, 9e6)

    model = models.make_model("llama", "lora")
    config = ZeroConfig(stage=3, quantized_frozen_weights="int8", quantization_block_size=64)
    planner = Planner(model, config)
    got = plan_bytes(planner.plan(3, 3), planner.config_for(3))["params"]
    want = sum(quantized_nbytes(g.shard, 64, 8) if not g.trainable else 4 * g.shard for g in layout(model, 3))
    assert got == want
    assert plan_bytes(planner.plan(1, 3), planner.config_for(1))["params"] == sum(
        4 * g.padded for g in layout(model, 3))  # stage 1: the option does not apply


def test_planner_groups_are_the_engines_at_every_stage():
    """The estimator's groups are the engine's own at each stage. Stage 2 caps a trainable group at C_B bytes of its
    gradient bucket in the reduce dtype and stage 1 does not (its full accumulator is reduced in place), so with
    bf16 parameters and fp32 reduction a stage-2 group holds half the elements of a stage-1 one: 8 x Linear(64, 64)
    with reduce_bucket_size 40,000 bytes is 4 groups of at most 8,320 elements at stage 2 (40,000 / 4 rounds down
    to two layers of 4,160), 2 of 16,640 at stages 0-1 (40,000 / 2: four layers). A planner that planned stage 1
    once and reused it for stage 2 reported the latter."""
    from hf_zero.tools.estimate.plan import Planner

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).to(torch.bfloat16)
    config = ZeroConfig(mixed_precision="bf16", reduce_dtype="fp32", reduce_bucket_size=40_000)
    planner = Planner(model, config)
    n = 4
    for stage in (1, 2, 0, 3, 2):  # in an order that reuses each cached plan
        engine = plan_model(model, n, planner.config_for(stage))
        ours = planner.plan(stage, n)
        assert [(g.numel, g.padded_numel, g.shard_numel) for g in ours.groups] == \
               [(g.numel, g.padded_numel, g.shard_numel) for g in engine.groups], stage
        assert ours.partition_size == engine.partition_size, stage
    assert [g.numel for g in plan_model(model, n, planner.config_for(2)).groups] == [8320] * 4
    assert [g.numel for g in plan_model(model, n, planner.config_for(1)).groups] == [16640] * 2


def test_sequence_parallel_activation_count_refuses_what_ulysses_refuses():
    """The count under sequence parallelism takes the settings Ulysses runs (engine/sequence/attention.py): a fused
    kernel, heads and sequence divided by sp, KV heads divided by sp or dividing it; at sp = 1 it is the plain count,
    term for term."""
    shape = ActivationShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=172, vocab=256,
                            gated_mlp=True, act_saved=1, rms_norm=True, softmax_fp32=True)
    assert layer_activation_bytes(shape, 2, 64, 2, "sdpa", sequence_parallel=1) == layer_activation_bytes(
        shape, 2, 64, 2, "sdpa")
    for kwargs, match in ((dict(attention="eager", sequence_parallel=2), "not eager"),
                          (dict(attention="sdpa", sequence_parallel=3), "must divide"),
                          (dict(attention="sdpa", sequence_parallel=0), "at least 1")):
        with pytest.raises(ValueError, match=match):
            activation_bytes(shape, 2, 64, 2, **kwargs)
    odd = ActivationShape(**{**shape.__dict__, "heads": 12, "kv_heads": 3})
    with pytest.raises(ValueError, match="cannot be replicated"):
        activation_bytes(odd, 2, 64, 2, attention="sdpa", sequence_parallel=4)


# ------------------------------------------------------------------------------------- tiled loss and MLP (#44)
TILE_SHAPE = ActivationShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=172, vocab=256,
                             gated_mlp=True, act_saved=1, rms_norm=True, softmax_fp32=True)


def test_tiles_as_long_as_the_sequence_are_the_untiled_count():
    """The tiled MLP's hooks leave a module whole when its input has no more positions than a tile (tiled.py), so
    the count is the untiled one, term for term, with or without sp. The tiled loss always checkpoints: one tile of
    all t tokens keeps no log-probabilities (4·t·V fewer stored bytes) and recomputes them in the backward, so the
    peak is the untiled one (under checkpointing lower, when a recomputed layer is larger than the loss)."""
    b, s, e = 2, 64, 2
    for sp, ckpt in ((1, False), (2, False), (2, True), (4, True)):
        plain = activation_bytes(TILE_SHAPE, b, s, e, ckpt, "sdpa", sequence_parallel=sp)
        assert activation_bytes(TILE_SHAPE, b, s, e, ckpt, "sdpa", sequence_parallel=sp,
                                tiled_mlp_tokens=s // sp) == plain
        assert layer_activation_bytes(TILE_SHAPE, b, s, e, "sdpa", sequence_parallel=sp, tiled_mlp_tokens=10 * s) == \
            layer_activation_bytes(TILE_SHAPE, b, s, e, "sdpa", sequence_parallel=sp)
        t = b * s // sp
        for tile in (t, 10 * t):
            tiled = activation_bytes(TILE_SHAPE, b, s, e, ckpt, "sdpa", sequence_parallel=sp, tiled_loss_tokens=tile)
            assert plain["stored"] - tiled["stored"] == 4 * t * TILE_SHAPE.vocab
            assert tiled["per_layer"] == plain["per_layer"]
            if ckpt:  # the recomputed layers no longer find the log-probabilities stored beside them
                assert tiled["peak"] == plain["peak"] - 4 * t * TILE_SHAPE.vocab + max(
                    0, 12 * t * TILE_SHAPE.vocab - plain["transient"])
            else:
                assert tiled["peak"] == plain["peak"]


def test_tiled_loss_term_does_not_grow_with_the_vocabulary_times_the_sequence():
    """Untiled, the loss's log-probabilities grow as 4·s·b·V (stored) + 8·s·b·V (transient); tiled, nothing of the
    loss is stored and its transient is one tile's 12·T·V whatever the sequence."""
    e, tile = 2, 128
    big_vocab = dataclasses.replace(TILE_SHAPE, vocab=64 * TILE_SHAPE.vocab)
    for s in (1024, 8192):
        small, big = (activation_bytes(shape, 1, s, e, False, "sdpa", tiled_loss_tokens=tile)
                      for shape in (TILE_SHAPE, big_vocab))
        assert small["stored"] == big["stored"]  # no V anywhere in what the forward keeps
        assert big["transient"] == 12 * tile * big_vocab.vocab
        untiled = activation_bytes(big_vocab, 1, s, e, False, "sdpa")
        assert untiled["peak"] - big["peak"] == 12 * (s - tile) * big_vocab.vocab


def test_tiled_mlp_keeps_the_inputs_and_recomputes_one_tile():
    """Per layer the tiled MLP and norms keep their inputs, e·t·h each, by hand; the transient is one tile's MLP (b x
    T positions), on top of the recomputed layer under checkpointing; sp divides the positions the tiles cut."""
    b, s, e, tile = 2, 256, 2, 32
    h, f = TILE_SHAPE.hidden, TILE_SHAPE.intermediate
    for sp in (1, 2):
        t = b * s // sp
        layer = layer_activation_bytes(TILE_SHAPE, b, s, e, "sdpa", sequence_parallel=sp, tiled_mlp_tokens=tile)
        plain = layer_activation_bytes(TILE_SHAPE, b, s, e, "sdpa", sequence_parallel=sp)
        assert layer["mlp"] == e * t * h and layer["norms"] == 2 * e * t * h
        assert plain["mlp"] - layer["mlp"] == e * t * f * 4  # SwiGLU: gate and up outputs, SiLU's input and output
        assert layer["attention"] == plain["attention"] and layer.get("ulysses") == plain.get("ulysses")
        n = b * tile
        one_tile = e * n * h + e * n * f * 4
        no = activation_bytes(TILE_SHAPE, b, s, e, False, "sdpa", sequence_parallel=sp, tiled_mlp_tokens=tile)
        ck = activation_bytes(TILE_SHAPE, b, s, e, True, "sdpa", sequence_parallel=sp, tiled_mlp_tokens=tile)
        assert no["transient"] == max(one_tile, 8 * t * TILE_SHAPE.vocab)
        assert ck["transient"] == max(layer["total"] + one_tile, 8 * t * TILE_SHAPE.vocab)
        untiled = activation_bytes(TILE_SHAPE, b, s, e, False, "sdpa", sequence_parallel=sp)
        final_norm = (4 + e) * t * h + 4 * t - e * t * h  # its fp32 copy and 1/rms, less its input
        assert untiled["stored"] - no["stored"] == 2 * (plain["total"] - layer["total"]) + final_norm
    with pytest.raises(ValueError, match="at least 0"):
        activation_bytes(TILE_SHAPE, b, s, e, tiled_mlp_tokens=-1)
    with pytest.raises(ValueError, match="at least 0"):
        activation_bytes(TILE_SHAPE, b, s, e, tiled_loss_tokens=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_loss_transient_is_one_tiles_as_measured(dtype):
    """The real tiled cross-entropy (engine/sequence/tiled.py) on real tensors, its live bytes followed op by op:
    the forward keeps nothing new (the checkpoints hold views of the hidden states and labels) and holds 8·n·V at
    most (a tile's fp32 logits and log-probabilities); the backward's peak above what it starts with is the count's
    12·n·V, plus, once a tile is done, two gradients the count leaves to others: the head weight's (V·h, a model
    state) and the hidden states' (t·h, the backward's input to the layers)."""
    from hf_zero.tools.estimate.live_bytes import LiveBytes as PhaseBytes
    from hf_zero.engine.sequence.tiled import tiled_cross_entropy_sum

    t, h, v = 256, 32, 1000
    e = torch.empty((), dtype=dtype).element_size()
    shape = dataclasses.replace(TILE_SHAPE, vocab=v, hidden=h)
    torch.manual_seed(0)
    for tile in (64, 100, 256, 1000):
        head = nn.Linear(h, v, bias=False).to(dtype)
        hidden = torch.randn(t, h, dtype=dtype).requires_grad_()
        labels = torch.randint(0, v, (t,))
        count = activation_bytes(shape, 1, t, e, False, "sdpa", tiled_loss_tokens=tile)
        tracker = PhaseBytes()
        with tracker:
            tracker.phase = "forward"
            loss = tiled_cross_entropy_sum(head, hidden, labels, tile)
            new = tracker.live["forward"] - (hidden.numel() * e + v * h * e + labels.numel() * 8)  # views of those
            forward_peak = tracker.phase_peak["forward"]
            kept = tracker.live["forward"]
            tracker.reset_peak()
            tracker.phase = "backward"
            base = tracker.total
            loss.backward()
        n, scalars = min(tile, t), 8
        assert 0 <= new <= scalars
        assert forward_peak - kept == 8 * n * v + scalars
        grads = (v * h + t * h) * e if tile < t else 0  # alive when the second tile's backward peaks
        assert tracker.peak - base - grads == count["transient"] + 4 == 12 * n * v + 4, tile  # + the loss's grad


def test_estimate_cli_takes_sequence_parallelism_and_tiles(tmp_path, capsys):
    """--sequence-parallel-size, --tiled-loss-tokens and --tiled-mlp-tokens (hf-zero config's flags for the ZeroConfig
    options) reach the activation count as ZeroConfig settings; the dry run gets them as --option KEY=VALUE would give
    them; where the run would refuse them (sp with eager attention) or they cannot count (no activations, --zeropp)
    the command says so."""
    from hf_zero.cli import main
    from hf_zero.integrations.hf_models import meta_model

    path = tmp_path / "7b.json"
    path.write_text(json.dumps(LLAMA_7B))
    s, sp, tile = 32768, 8, 2048
    flags = ["--sequence-parallel-size", str(sp), "--tiled-loss-tokens", str(tile), "--tiled-mlp-tokens", str(tile)]
    assert main(["estimate", "--model", str(path), "--batch-size", "1", "--seq-len", str(s), "--attention", "sdpa",
                 "--json"] + flags) == 0
    act = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["activations"]
    assert (act["sequence_parallel"], act["tiled_loss_tokens"], act["tiled_mlp_tokens"]) == (sp, tile, tile)
    shape = activation_shape(meta_model(str(path)))
    for mode, ckpt in (("no_checkpointing", False), ("checkpointing", True)):
        assert act[mode] == activation_bytes(shape, 1, s, 2, ckpt, "sdpa", sequence_parallel=sp,
                                             tiled_loss_tokens=tile, tiled_mlp_tokens=tile)
    assert main(["estimate", "--model", str(path), "--batch-size", "1", "--seq-len", str(s), "--attention", "sdpa"]
                + flags) == 0
    assert f"sequence parallel over {sp} ranks, tiled loss {tile:,} tokens" in capsys.readouterr().out
    # without --attention sp counts the fused kernel it runs (eager is the paper's default, which sp refuses)
    assert main(["estimate", "--model", str(path), "--batch-size", "1", "--seq-len", str(s), "--json"] + flags) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["activations"] == act
    assert main(["estimate", "--model", str(path), "--batch-size", "1", "--seq-len", str(s), "--attention", "eager"]
                + flags) == 2
    assert "not eager attention" in capsys.readouterr().err
    assert main(["estimate", "--model", str(path), "--num-processes", "8", "--tiled-mlp-tokens", "64"]) == 2
    assert "--tiled-mlp-tokens only changes the activations" in capsys.readouterr().err
    assert main(["estimate", "--zeropp", "--params", "7e9", "--tiled-loss-tokens", "64"]) == 2
    assert "drop --tiled-loss-tokens" in capsys.readouterr().err
    assert main(["estimate", "--dry-run", "--model", "tiny", "--num-processes", "2", "--stage", "3", "--seq-len",
                 "256", "--tiled-loss-tokens", "64", "--tiled-mlp-tokens", "32", "--json"]) == 0
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]
    assert (run["long_sequences"]["tiled_loss_tokens"], run["long_sequences"]["tiled_mlp_tokens"]) == (64, 32)
