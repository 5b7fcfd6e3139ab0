"""Reentrant activation checkpointing (issue 20 item 3): each checkpointed segment runs its own inner backward
(torch.autograd.backward inside the outer one). The end of an inner backward is not the end of the backward: the
reducer must launch each group once per backward, so the ledger shows the paper's counts per step (stage 0: 2Ψ
all-reduce; stage 1: Ψ reduce-scatter + Ψ all-gather; stage 2: mΨ reduce-scatter + Ψ all-gather, with m
micro-batches), whichever checkpointing is used, and training matches plain DDP without checkpointing.

Model: the tiny Llama of tests/models.py with LoRA adapters (the LoRA variant with the final norm frozen too: only
the adapters train, all inside the layers), checkpointed by transformers' gradient_checkpointing_enable(use_reentrant=True) with
enable_input_require_grads(), as PEFT recipes do.
"""
import warnings

import pytest
import torch

import models
from _dist import DistResults

WORLD_SIZES = (2, 3)
STAGES = (0, 1, 2)
STEPS, ACCUM = 2, 3
BUCKET = 2048  # bytes: several groups, so groups left incomplete by a segment's inner backward exist


def _model(checkpointing):
    model = models.make_model("llama", "lora")
    # as under PEFT: only the adapters train, all inside the checkpointed layers, so the first gradient of the
    # backward arrives in a segment's inner backward
    model.model.norm.weight.requires_grad_(False)
    if checkpointing is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        model.enable_input_require_grads()
    return model


def train(rank, world_size, backend, stage=0, checkpointing=None):
    """backend "ddp": torch DDP, no checkpointing (the reference); "zero": hf_zero at `stage`."""
    import torch.distributed as dist

    model = _model(checkpointing)
    opt = models.make_optimizer(model)
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        run, no_sync, backward = wrapped, wrapped.no_sync, lambda loss: loss.backward()
        step = opt
    else:
        from hf_zero import ZeroConfig, shard_model

        engine = shard_model(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=BUCKET,
                                                    allgather_bucket_size=BUCKET))
        run, no_sync, backward, step = engine.model, engine.no_sync, engine.backward, engine.optimizer
        psi_padded = sum(g.plan.padded_numel for g in engine.groups if g.plan.trainable)
    comm = []
    for batch in models.make_batches(STEPS, ACCUM):
        if backend == "zero":
            engine.reset_comm_stats()
        for j, mb in enumerate(batch):
            x = models.rank_slice(mb, rank, world_size)
            ctx = no_sync() if j < ACCUM - 1 else torch.enable_grad()
            with ctx:
                backward(run(input_ids=x, labels=x).loss / ACCUM)
        step.step()
        step.zero_grad()
        if backend == "zero":
            stats = engine.comm_stats()
            comm.append({k: int(stats.get(k, {}).get("elements", 0))
                         for k in ("all_reduce", "reduce_scatter", "all_gather")})
    if backend == "zero":
        state = engine.full_state_dict()
        dist.barrier()
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else {}
    out = {"comm": comm, "state": {k: v for k, v in state.items() if "lora_" in k}}
    if backend == "zero":
        out["psi_padded"] = psi_padded
    return out


def scenarios_for(world_size):
    sc = [("ddp", train, dict(backend="ddp"))]
    for stage in STAGES:
        for ck in ("reentrant", "non_reentrant"):
            sc.append((f"s{stage}-{ck}", train, dict(backend="zero", stage=stage, checkpointing=ck)))
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def expected(stage, psi):
    if stage == 0:
        return {"all_reduce": 2 * psi, "reduce_scatter": 0, "all_gather": 0}
    if stage == 1:
        return {"all_reduce": 0, "reduce_scatter": psi, "all_gather": psi}
    return {"all_reduce": 0, "reduce_scatter": ACCUM * psi, "all_gather": psi}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_ledger_is_the_papers_and_weights_match_ddp(dist_results, world_size, stage, checkpointing):
    ours = dist_results(world_size, f"s{stage}-{checkpointing}")
    ref = dist_results(world_size, "ddp")[0]["state"]
    psi = ours[0]["psi_padded"]
    for rank, res in enumerate(ours):
        for i, per_step in enumerate(res["comm"]):
            assert per_step == expected(stage, psi), (
                f"rank {rank} step {i}: ledger {per_step}, paper {expected(stage, psi)} (Ψ padded = {psi}); "
                f"ratio {sum(per_step.values()) / sum(expected(stage, psi).values()):.2f}x")
    got = ours[0]["state"]
    assert set(got) == set(ref) and ref
    for k in ref:
        err = ((got[k].double() - ref[k].double()).norm() / ref[k].double().norm()).item()
        assert err < 1e-5, f"{k}: relative error {err:.2e} against DDP"


def test_inner_backward_end_is_not_the_end():
    """One process: the reducer's end-of-backward runs once per outer backward, after every gradient, also when
    every trainable parameter sits inside reentrant segments (each segment's inner backward ends first)."""
    from hf_zero import ZeroConfig, shard_model

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    model = torch.nn.Sequential(*blocks)
    engine = shard_model(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2, reduce_bucket_size=64))
    ends, launched = [], []
    reducer = engine.reducer
    real_end, real_launch = reducer.on_backward_end, reducer.on_launch
    reducer.on_backward_end = lambda: (ends.append(len(launched)), real_end())
    reducer.on_launch = lambda g: (launched.append(g.plan.index), real_launch(g))
    x = torch.randn(2, 4, requires_grad=True)
    h = x
    for b in blocks:
        h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=True)
    engine.backward(h.pow(2).sum())
    assert ends == [len(reducer.states)], ends  # the end of the backward: once, every group launched by then
    assert sorted(launched) == sorted(st.group.plan.index for st in reducer.states), launched  # each group once
