"""comm_stats and memory_stats against the ZeRO paper's formulas, and memory_stats against an independent count.

Each run: 2 optimizer steps, gradient accumulation m=3, small buckets.  Ψ is counted from the model; N is the world
size.  "Up to padding": every flat buffer may be padded to a multiple of N, so each pass over the parameters may
move up to (#flat buffers) x N extra elements, and the model states may hold up to that many extra elements at
16 bytes each.  How the engine flattens is its own business (per param group, per unit, per bucket), but a flat
buffer holds at least one parameter tensor, so #flat buffers <= #parameter tensors: that is the bound used.
"""
import pytest
import torch

import models
from _dist import DistResults
from _recipe import ACCUM, engine_train, reference_train

WORLD_SIZES = (2, 3)
STAGES = (0, 1, 2, 3)
STEPS = 2
BUCKET = 8 * 1024  # bytes per reduce / all-gather bucket: several buckets per step, so bucketing is exercised
BF16_WORLD = 2
KINDS_BYTES = {"all_gather", "reduce_scatter", "all_reduce"}
FLAT_WORLD = 3  # the ledger formulas with the flat (NCCL-shaped) collectives too, padding included
FLAT_STAGES = (1, 2, 3)  # stage 0 only all-reduces, which no strategy changes
RESHARD_POLICIES = (True, False)  # stage 3's reshard_after_forward other than the default "auto", at FLAT_WORLD


def scenarios_for(world_size):
    common = dict(steps=STEPS, accum=ACCUM, bucket_size=BUCKET, probe_step=STEPS - 1)
    sc = [(f"{kind}-fp32-s{stage}", engine_train, dict(kind=kind, stage=stage, **common))
          for kind in models.KINDS for stage in STAGES]
    if world_size == BF16_WORLD:
        sc += [(f"llama-bf16-s{stage}", engine_train,
                dict(kind="llama", stage=stage, mixed_precision="bf16", grad_accum_dtype="compute", **common))
               for stage in STAGES]
    if world_size == FLAT_WORLD:
        flat = dict(zero_options={"collectives": "flat"}, **common)
        sc += [(f"{kind}-fp32-s{stage}-flat", engine_train, dict(kind=kind, stage=stage, **flat))
               for kind in models.KINDS for stage in FLAT_STAGES]
        sc += [(f"{kind}-fp32-s3-reshard-{policy}", engine_train,
                dict(kind=kind, stage=3, zero_options={"reshard_after_forward": policy}, **common))
               for kind in models.KINDS for policy in RESHARD_POLICIES]
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


class Sizes:
    """Element counts of a model, as the formulas need them."""

    def __init__(self, kind):
        model = models.make_model(kind)
        self.psi = models.trainable_numel(model)
        self.resident = models.resident_numel(model)  # the root and the last layer (reshard_after_forward "auto")
        self.n_tensors = len(list(model.parameters()))
        self.max_flat_buffers = self.n_tensors  # each flat buffer holds >= 1 parameter tensor


def comm_expected(stage, s: Sizes, n, m=ACCUM):
    """{kind: (lowest, highest)} elements per optimizer step, paper counting, padding allowed on top."""
    pad = s.max_flat_buffers * n  # per pass over all parameters
    if stage == 0:
        return {"all_reduce": (2 * s.psi, 2 * (s.psi + pad))}
    if stage == 1:
        return {"reduce_scatter": (s.psi, s.psi + pad), "all_gather": (s.psi, s.psi + pad)}
    if stage == 2:
        return {"reduce_scatter": (m * s.psi, m * (s.psi + pad)), "all_gather": (s.psi, s.psi + pad)}
    # stage 3: forward and backward all-gather every unit per micro-batch, except that the root unit and the last
    # layer stay gathered from their forward to their backward; one reduce-scatter per micro-batch
    return {"all_gather": (m * (2 * s.psi - s.resident), m * (2 * (s.psi + pad) - s.resident)),
            "reduce_scatter": (m * s.psi, m * (s.psi + pad))}


def memory_expected(stage, psi, n, precision):
    """Model-state bytes per rank (params + grads + master + optimizer states) for AdamW."""
    if precision == "fp32":
        return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
    # bf16 compute copies, bf16 gradient accumulation, fp32 master + fp32 Adam states
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def _get(stats, kind, field):
    return int(stats.get(kind, {}).get(field, 0))


# ------------------------------------------------------------------------------------------------------ comm_stats
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_comm_volume_per_step(dist_results, world_size, kind, stage):
    ranks = dist_results(world_size, f"{kind}-fp32-s{stage}")
    want = comm_expected(stage, Sizes(kind), world_size)
    for r, res in enumerate(ranks):
        assert len(res["comm"]) == STEPS
        assert res["comm"] == ranks[0]["comm"], f"rank {r} counted different collectives than rank 0"
        for step, stats in enumerate(res["comm"]):
            for ckind in sorted(KINDS_BYTES):
                elements, calls, nbytes = (_get(stats, ckind, f) for f in ("elements", "calls", "bytes"))
                lo, hi = want.get(ckind, (0, 0))
                where = f"rank {r} step {step} {ckind}: {stats.get(ckind)}"
                assert lo <= elements <= hi, f"{where}; want elements in [{lo}, {hi}]"
                assert (calls > 0) == (hi > 0), f"{where}; calls inconsistent with elements"
                # fp32 everywhere here; an all-reduce counts 2x its buffer in elements and in bytes alike
                assert nbytes == 4 * elements, f"{where}; want bytes = 4 x elements (fp32)"


def _flat_runs():
    return [(kind, stage) for kind in models.KINDS for stage in FLAT_STAGES]


@pytest.mark.parametrize("kind,stage", _flat_runs())
def test_comm_volume_per_step_flat(dist_results, kind, stage):
    """The flat collectives move what the per-chunk ones move (paper counting): the same ledger, call for call."""
    flat = dist_results(FLAT_WORLD, f"{kind}-fp32-s{stage}-flat")
    chunked = dist_results(FLAT_WORLD, f"{kind}-fp32-s{stage}")
    want = comm_expected(stage, Sizes(kind), FLAT_WORLD)
    for r, res in enumerate(flat):
        assert res["comm"] == chunked[r]["comm"], f"rank {r}: flat booked {res['comm']}, chunked {chunked[r]['comm']}"
        for stats in res["comm"]:
            for ckind, (lo, hi) in want.items():
                assert lo <= _get(stats, ckind, "elements") <= hi, (r, ckind, stats)


@pytest.mark.parametrize("kind,stage", _flat_runs())
def test_ledger_per_strategy_beside_the_kinds(dist_results, kind, stage):
    """comm_stats_by_strategy(): every collective under the strategy that issued it ("chunked" is gloo's "auto",
    "flat" when asked), with the counters of comm_stats (flat and chunked send the logical bytes) and the hop
    split (one host: all intra-host)."""
    for name, strategy in ((f"{kind}-fp32-s{stage}", "chunked"), (f"{kind}-fp32-s{stage}-flat", "flat")):
        for r, res in enumerate(dist_results(FLAT_WORLD, name)):
            assert res["collectives"] == [strategy], (name, r, res["collectives"])
            for plain, by_strategy in zip(res["comm"], res["comm_by_strategy"]):
                assert set(by_strategy) == {strategy}, (name, r, by_strategy)
                assert by_strategy[strategy] == plain, (name, r, by_strategy, plain)
                assert plain["total"]["inter_bytes"] == 0 and plain["total"]["intra_bytes"] == plain["total"]["bytes"]


@pytest.mark.parametrize("policy", RESHARD_POLICIES)
@pytest.mark.parametrize("kind", models.KINDS)
def test_reshard_after_forward_policy_ledger_and_training(dist_results, kind, policy):
    """Stage 3's reshard_after_forward: True all-gathers every unit but the root twice per micro-batch (the paper's
    3Ψ less the root), False once (2Ψ: every parameter stays gathered from its forward into its backward); the
    default "auto" (test_comm_volume_per_step) lies between. Each trains exactly as plain single-process training
    does (gradient norms and final weights)."""
    s, n, m = Sizes(kind), FLAT_WORLD, ACCUM
    pad = s.max_flat_buffers * n
    resident = models.resident_numel(models.make_model(kind), policy)
    ref = reference_train(kind, "full", STEPS, ACCUM)
    for r, res in enumerate(dist_results(n, f"{kind}-fp32-s3-reshard-{policy}")):
        for stats in res["comm"]:
            got = _get(stats, "all_gather", "elements")
            lo, hi = m * (2 * s.psi - resident), m * (2 * (s.psi + pad) - resident)
            assert lo <= got <= hi, (policy, r, got, lo, hi)
            assert s.psi <= _get(stats, "reduce_scatter", "elements") / m <= s.psi + pad, (policy, r, stats)
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
        if r == 0:
            for name, want in ref["state"].items():
                torch.testing.assert_close(res["state"][name], want, rtol=1e-5, atol=1e-6, msg=lambda msg: name)


def test_comm_stats_reset(dist_results):
    """reset_comm_stats() zeroes the counters: the two steps of a run report the same volume, not a running sum."""
    for stage in STAGES:
        comm = dist_results(2, f"llama-fp32-s{stage}")[0]["comm"]
        for ckind in KINDS_BYTES:
            assert _get(comm[1], ckind, "elements") == _get(comm[0], ckind, "elements"), (stage, ckind, comm)


# ---------------------------------------------------------------------------------------------------- memory_stats
def check_memory(res, stage, kind, n, precision):
    mem = res["memory"]
    stats = mem["stats"]
    s = Sizes(kind)
    keys = ("params", "grads", "master", "optimizer_states", "buffers", "total")
    assert set(keys) <= set(stats), f"memory_stats keys {sorted(stats)}"
    assert all(int(stats[k]) >= 0 for k in keys), stats
    model_states = sum(int(stats[k]) for k in ("params", "grads", "master", "optimizer_states"))
    want = memory_expected(stage, s.psi, n, precision)
    # padding: <= N elements per flat buffer at <= 16 bytes of model state each; Adam's 0-d 'step' tensors
    slack = s.max_flat_buffers * n * 16 + 8 * s.n_tensors
    assert abs(model_states - want) <= slack, (
        f"model states {model_states} B ({stats}); formula {want:.0f} B (Ψ={s.psi}, N={n}), allowed ±{slack}")
    assert int(stats["total"]) == model_states + int(stats["buffers"]), f"total is not the sum: {stats}"
    # "buffers" includes the model's buffers (an engine may add its communication buffers to it)
    assert int(stats["buffers"]) >= mem["model_buffer_bytes"], (
        f"buffers {stats['buffers']} B < the model's own buffers {mem['model_buffer_bytes']} B")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_stats_fp32_formula(dist_results, world_size, kind, stage):
    for res in dist_results(world_size, f"{kind}-fp32-s{stage}"):
        check_memory(res, stage, kind, world_size, "fp32")


@pytest.mark.parametrize("stage", STAGES)
def test_memory_stats_bf16_formula(dist_results, stage):
    for res in dist_results(BF16_WORLD, f"llama-bf16-s{stage}"):
        check_memory(res, stage, "llama", BF16_WORLD, "bf16")


def _runs():
    for n in WORLD_SIZES:
        for kind in models.KINDS:
            for stage in STAGES:
                yield n, f"{kind}-fp32-s{stage}"
    for stage in STAGES:
        yield BF16_WORLD, f"llama-bf16-s{stage}"


@pytest.mark.parametrize("world_size,name", list(_runs()))
def test_memory_stats_not_under_reported(dist_results, world_size, name):
    """memory_stats()["total"] covers every tensor storage found independently (after the last backward of a step,
    optimizer states allocated):
    - through the public API: model params/grads/buffers, engine.optimizer param_groups (+grads) and state;
    - by walking every object reachable from the engine (its flat buffers, shards, grad buffers...), less an
      allowance for the collectives' scratch buckets (2 x each bucket size) and a few KiB of small tensors."""
    allowance = 2 * (BUCKET + BUCKET) + 4096
    for r, res in enumerate(dist_results(world_size, name)):
        mem = res["memory"]
        total = int(mem["stats"]["total"])
        # the walk itself: finished, and found at least what the public API exposes
        assert mem["walk_complete"] and mem["reachable_bytes"] >= mem["core_bytes"], mem
        assert total >= mem["core_bytes"], f"rank {r}: total {total} B < {mem['core_bytes']} B held via the API"
        assert total >= mem["reachable_bytes"] - allowance, (
            f"rank {r}: total {total} B, but {mem['reachable_bytes']} B of tensors are reachable from the engine")


# ------------------------------------------------------------------------------------------------------ grad norm
@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_global_grad_norm_matches_reference(dist_results, world_size, kind):
    ref = reference_train(kind, "full", STEPS, ACCUM)
    want = torch.tensor(ref["norms"], dtype=torch.float64)
    for stage in STAGES:
        for r, res in enumerate(dist_results(world_size, f"{kind}-fp32-s{stage}")):
            torch.testing.assert_close(torch.tensor(res["norms"], dtype=torch.float64), want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=r, stage=stage: f"stage {stage} rank {r}: norm\n{m}")
