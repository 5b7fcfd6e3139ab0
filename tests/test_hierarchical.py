"""Hierarchical partitioning at world size 4 as 2 x 2, on one host: HSDP (shard_group_size=2, stages 1-3) and
ZeRO++ hpZ (hpz_partition_size=2, stage 3).

Each run trains exactly like plain single-process training (gradient accumulation 2, clipping); its ledger per step
equals the formulas derived here (paper counting, up to padding) and on one host books nothing inter-host; its
model states per rank equal the formulas with K = 2 (HSDP) or add the secondary shard P (Ψ' - r) / K (hpZ).
The same options across two real hosts: tests/test_multihost.py.
"""
import pytest
import torch

import models
from _dist import DistResults
from _recipe import engine_train, reference_train, state_mismatches

from hf_zero import ZeroConfig
from hf_zero.config import ZeroConfigError
from hf_zero.engine.topology import _ranks_per_host

N, K, STEPS, ACCUM = 4, 2, 2, 2
RTOL, ATOL = 1e-5, 1e-6
HSDP = {"shard_group_size": K}
HPZ = {"hpz_partition_size": K}
FLAT = {"collectives": "flat"}  # the NCCL-shaped collectives on gloo: HSDP's chained reduce, hpZ's host gather


def _run(kind, stage, options, **kw):
    return engine_train, dict(kind=kind, stage=stage, steps=STEPS, accum=ACCUM, probe_step=STEPS - 1,
                              zero_options=options, **kw)


def _bad_k(rank, world_size):
    """K = 3 does not divide N = 4: every rank raises the same ZeroConfigError (no rank builds a group)."""
    from hf_zero import shard_model

    model = models.make_model("gpt2")
    try:
        shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3, shard_group_size=3))
    except ZeroConfigError as exc:
        return str(exc)
    return None


def _groups(rank, world_size, options):
    """Which global ranks this rank partitions with, replicates with and gathers its backward with."""
    from hf_zero import shard_model

    model = models.make_model("gpt2")
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3, **options))
    t = engine.topology
    return {"option": t.option, "partition": t.partition.global_ranks,
            "replicas": t.replicas.global_ranks if t.replicas else None,
            "secondary": t.secondary.global_ranks if t.secondary else None}


def scenarios_for(world_size):
    assert world_size == N
    sc = [(f"{kind}-hsdp-s{stage}", *_run(kind, stage, HSDP)) for kind in models.KINDS for stage in (1, 2, 3)]
    sc += [(f"{kind}-hpz", *_run(kind, 3, HPZ)) for kind in models.KINDS]
    sc += [("gpt2-hpz-ckpt", *_run("gpt2", 3, HPZ, checkpointing=True)),
           ("gpt2-hsdp-s3-ckpt", *_run("gpt2", 3, HSDP, checkpointing=True)),
           # a forward with grad that no backward follows keeps hpZ's secondary shards past the step
           ("gpt2-hpz-stray", *_run("gpt2", 3, HPZ, stray_forward=True)),
           ("bad-k", _bad_k, {}),
           ("groups-hsdp", _groups, {"options": HSDP}), ("groups-hpz", _groups, {"options": HPZ}),
           ("groups-k1", _groups, {"options": {"shard_group_size": 1}}),
           ("groups-host", _groups, {"options": {"hpz_partition_size": "host"}})]
    sc += [("gpt2-hsdp-flat-s2", *_run("gpt2", 2, {**HSDP, **FLAT})),
           ("llama-hpz-flat", *_run("llama", 3, {**HPZ, **FLAT}))]
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


CASES = [f"{kind}-hsdp-s{stage}" for kind in models.KINDS for stage in (1, 2, 3)] + \
        [f"{kind}-hpz" for kind in models.KINDS] + ["gpt2-hpz-ckpt", "gpt2-hsdp-s3-ckpt", "gpt2-hpz-stray"] + \
        ["gpt2-hsdp-flat-s2", "llama-hpz-flat"]


# ------------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("name", CASES)
def test_trains_like_single_process(dist_results, name):
    ranks = dist_results(N, name)
    ref = reference_train(name.split("-")[0], steps=STEPS, accum=ACCUM)
    losses = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL)
    for r, res in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(res["norms"], dtype=torch.float64),
                                   torch.tensor(ref["norms"], dtype=torch.float64), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, r=r: f"rank {r}: global grad norm differs\n{m}")
    problems = state_mismatches(ranks[0]["state"], ref["state"], RTOL, ATOL)
    assert not problems, f"{name}: final weights differ from single-process training: {problems[:5]}"


# ------------------------------------------------------------------------------------------------------ groups
def test_groups_are_host_blocks_and_replicas(dist_results):
    hsdp = dist_results(N, "groups-hsdp")
    assert [g["partition"] for g in hsdp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["replicas"] for g in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    hpz = dist_results(N, "groups-hpz")
    assert [g["partition"] for g in hpz] == [[0, 1, 2, 3]] * N
    assert [g["secondary"] for g in hpz] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_k_of_one_or_one_host_is_the_plain_stage(dist_results):
    # K = 1, and "host" on one host (K = N from the hostnames): no subgroup, the plain stage over all ranks
    for name in ("groups-k1", "groups-host"):
        for g in dist_results(N, name):
            assert g == {"option": "none", "partition": [0, 1, 2, 3], "replicas": None, "secondary": None}, name


def test_k_that_does_not_divide_the_world_fails_on_every_rank(dist_results):
    for msg in dist_results(N, "bad-k"):
        assert msg is not None and "does not divide the world size 4" in msg and "shard_group_size=3" in msg


def test_ranks_per_host_from_hostnames():
    assert _ranks_per_host("x", ["a", "a", "b", "b"], [None] * 4) == 2
    assert _ranks_per_host("x", ["a", "a", "b", "b"], [2] * 4) == 2
    with pytest.raises(ZeroConfigError, match="not numbered host by host"):
        _ranks_per_host("hpz_partition_size", ["a", "b", "a", "b"], [2] * 4)
    with pytest.raises(ZeroConfigError, match="different numbers of ranks"):
        _ranks_per_host("x", ["a", "a", "a", "b"], [None] * 4)


# ------------------------------------------------------------------------------------------------------ ledger
class Sizes:
    def __init__(self, kind):
        model = models.make_model(kind)
        self.psi = models.trainable_numel(model)
        self.root = models.resident_numel(model)  # gathered once per micro-batch: the root and the last layer
        self.pad = len(list(model.parameters())) * N  # per pass: <= N padding elements per flat buffer


def ledger_expected(stage, option, s, m=ACCUM):
    """{kind: elements per rank and step}, without padding. HSDP: the plain stage over the K-rank group, plus the
    all-reduce of the Ψ/K gradient shard over the N/K replicas (2Ψ/K per reduction: per micro-batch at stages
    2/3, once at stage 1). hpZ: forward all-gather Ψ over N, backward all-gather Ψ - r over K, reduce-scatter Ψ
    over N, per micro-batch."""
    if option == "hpz":
        return {"all_gather": m * (2 * s.psi - s.root), "reduce_scatter": m * s.psi}
    reductions = 1 if stage == 1 else m
    out = {"all_reduce": reductions * 2 * s.psi / K, "reduce_scatter": reductions * s.psi}
    out["all_gather"] = m * (2 * s.psi - s.root) if stage == 3 else s.psi
    return out


@pytest.mark.parametrize("name", [c for c in CASES if "ckpt" not in c and "stray" not in c])
def test_ledger_matches_formulas_and_one_host_is_intra(dist_results, name):
    kind, option = name.split("-")[:2]
    stage = int(name.split("-s")[-1]) if option == "hsdp" else 3
    s = Sizes(kind)
    want = ledger_expected(stage, option, s)
    reductions = 1 if stage == 1 else ACCUM
    for r, res in enumerate(dist_results(N, name)):
        step = res["comm"][-1]
        for ckind, elements in want.items():
            got = step[ckind]["elements"]
            passes = {"all_reduce": 2 * reductions / K, "reduce_scatter": reductions, "all_gather": 2 * ACCUM}[ckind]
            assert elements <= got <= elements + passes * s.pad, (name, r, ckind, got, elements)
            assert step[ckind]["intra_elements"] == got and step[ckind]["inter_elements"] == 0, (name, r, step)


@pytest.mark.parametrize("name", [c for c in CASES if "flat" in c])
def test_flat_collectives_on_every_group(dist_results, name):
    """collectives="flat" reaches every group the option builds (partition, replicas, host group): the ledger per
    strategy holds all of the step's traffic under "flat"."""
    for r, res in enumerate(dist_results(N, name)):
        assert res["collectives"] == ["flat"], (name, r, res["collectives"])
        assert all(set(by) == {"flat"} and by["flat"] == plain
                   for plain, by in zip(res["comm"], res["comm_by_strategy"])), (name, r, res["comm_by_strategy"])


# ------------------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("name", [c for c in CASES if "ckpt" not in c and "stray" not in c])
def test_memory_per_rank_matches_formulas(dist_results, name):
    kind, option = name.split("-")[:2]
    stage = int(name.split("-s")[-1]) if option == "hsdp" else 3
    s = Sizes(kind)
    # fp32 AdamW: params 4, grads 4 (fp32 accumulation), Adam 8 bytes per element; the master is the shard
    parts = K if option == "hsdp" else N
    want = {1: 8 * s.psi + 8 * s.psi / parts, 2: 4 * s.psi + 12 * s.psi / parts, 3: 16 * s.psi / parts}[stage]
    slack = 16 * s.pad + 8 * len(list(models.make_model(kind).parameters()))
    for r, res in enumerate(dist_results(N, name)):
        stats = res["memory"]["stats"]
        states = sum(int(stats[k]) for k in ("params", "grads", "master", "optimizer_states"))
        assert abs(states - want) <= slack, (name, r, states, want)
        if option == "hpz":
            # the units' secondary shards, all held at the end of the forward: 4 (Ψ - r) / K bytes
            secondary = 4 * (s.psi - s.root) / K
            assert secondary <= stats["hpz_secondary_peak"] <= secondary + 4 * s.pad / K, (r, stats)
            assert stats["hpz_secondary"] == 0, "secondary shards outlived the backward"
        else:
            assert stats["hpz_secondary_peak"] == 0
