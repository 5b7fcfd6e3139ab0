"""Clipping on every micro-batch (issue 20 item 1): many scripts call clip_grad_norm_ on every micro-batch inside
accumulate()/no_sync(), not only when the gradients are synchronised. Such a call must finalise nothing: with a
max_norm that is never reached, training is exactly the stock run's.

What a clip inside no_sync() returns and does (docs/gradient_accumulation.md, "Clipping"):
- stages 0/1: as DDP, the rank's local accumulated gradient: its local norm, clipped in place if over max_norm;
- stages 2/3: the global norm of the reduce-scattered sums so far, scaled as the final average would be (sum/N),
  and those sums scaled in place if over max_norm.

The peers: plain torch DDP on the same ranks (engine.clip_grad_norm_), and stock accelerate.Accelerator (DDP on CPU
gloo) under `accelerate launch` (HfZeroAccelerator.clip_grad_norm_, tests/scripts/accel_clip_train.py).
"""
import json
import os

import pytest
import torch

import models
from _dist import DistResults

WORLD_SIZES = (2, 3)
STEPS, ACCUM = 3, 3
HUGE = 1e9


def train(rank, world_size, backend, stage=0, max_norm=HUGE):
    """Every micro-batch: forward, backward (no_sync on all but the last), clip_grad_norm_(max_norm); step on the
    last. Returns every clip's norm, and on rank 0 the final weights."""
    import torch.distributed as dist

    model = models.make_model("llama")
    opt = models.make_optimizer(model)
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        run, no_sync, backward, optimizer = wrapped, wrapped.no_sync, lambda loss: loss.backward(), opt
        params = list(model.parameters())

        def clip():
            return torch.nn.utils.clip_grad_norm_(params, max_norm)

        def global_partial_norm():  # the meaning at stages 2/3: norm of the all-reduced sums so far / N
            sq = torch.zeros(())
            for p in params:
                if p.grad is not None:
                    g = p.grad.detach().clone()
                    dist.all_reduce(g)
                    sq += (g / world_size).double().pow(2).sum().float()
            return float(sq.sqrt())
    else:
        from hf_zero import ZeroConfig, shard_model

        engine = shard_model(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=8192, allgather_bucket_size=8192))
        run, no_sync, backward, optimizer = engine.model, engine.no_sync, engine.backward, engine.optimizer

        def clip():
            return engine.clip_grad_norm_(max_norm)
    norms, global_norms = [], []
    for batch in models.make_batches(STEPS, ACCUM):
        for j, mb in enumerate(batch):
            x = models.rank_slice(mb, rank, world_size)
            ctx = no_sync() if j < ACCUM - 1 else torch.enable_grad()
            with ctx:
                backward(run(input_ids=x, labels=x).loss / ACCUM)
                if backend == "ddp" and j < ACCUM - 1:
                    global_norms.append(global_partial_norm())
                norms.append(float(clip()))
        optimizer.step()
        optimizer.zero_grad()
    if backend == "ddp":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else {}
    else:
        state = engine.full_state_dict()
    dist.barrier()
    return {"norms": norms, "global_norms": global_norms, "state": state}


def scenarios_for(world_size):
    sc = [("ddp", train, dict(backend="ddp")), ("ddp-clips", train, dict(backend="ddp", max_norm=0.5))]
    sc += [(f"s{stage}", train, dict(backend="zero", stage=stage)) for stage in (0, 1, 2, 3)]
    sc += [(f"s{stage}-clips", train, dict(backend="zero", stage=stage, max_norm=0.5)) for stage in (0, 1)]
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def assert_same_state(got, ref, rtol=1e-5):
    assert ref and set(got) == set(ref)
    for k in ref:
        err = ((got[k].double() - ref[k].double()).norm() / ref[k].double().norm().clamp_min(1e-12)).item()
        assert err < rtol, f"{k}: relative error {err:.2e} against DDP"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_every_micro_batch_matches_ddp(dist_results, world_size, stage):
    ours, ref = dist_results(world_size, f"s{stage}"), dist_results(world_size, "ddp")
    assert_same_state(ours[0]["state"], ref[0]["state"])
    for rank in range(world_size):
        got, want = ours[rank]["norms"], ref[rank]["norms"]
        if stage >= 2:  # inside no_sync: the global norm of the reduced sums so far (sum / N)
            want = [g if (i % ACCUM) < ACCUM - 1 else w for i, (w, g) in
                    enumerate(zip(want, _interleave(ref[rank]["global_norms"], want)))]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _interleave(partials, norms):
    """The DDP run's global partial norms, placed at the non-synchronising micro-batches' positions."""
    out, it = [], iter(partials)
    for i in range(len(norms)):
        out.append(next(it) if (i % ACCUM) < ACCUM - 1 else None)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_1_clip_the_local_gradient_as_ddp_does(dist_results, world_size, stage):
    """A max_norm that clips: at stages 0/1 the local partial sum is clipped in place, exactly as under DDP."""
    ours, ref = dist_results(world_size, f"s{stage}-clips"), dist_results(world_size, "ddp-clips")
    assert any(n > 0.5 for n in ref[0]["norms"])  # the reference does clip
    assert_same_state(ours[0]["state"], ref[0]["state"])
    for rank in range(world_size):
        torch.testing.assert_close(torch.tensor(ours[rank]["norms"]), torch.tensor(ref[rank]["norms"]),
                                   rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ accelerate launch
@pytest.mark.slow
@pytest.mark.parametrize("nproc", WORLD_SIZES)
def test_accelerate_clip_every_micro_batch_matches_stock(tmp_path, nproc):
    from test_accelerate import accelerate_launch, assert_same_weights

    args = ["--grad-accum", "3", "--batches", "8", "--clip-every-micro-batch", "--max-norm", str(HUGE)]
    ref = tmp_path / "ddp"
    accelerate_launch("accel_clip_train.py", nproc, "--backend", "ddp", "--out", str(ref), *args)
    ref_log = json.load(open(ref / "log.json"))
    assert ref_log["optimizer_steps"] == 3 and len(ref_log["norms"]) == 8
    for stage in (1, 2, 3):
        cfg = tmp_path / f"zero{stage}.yaml"
        cfg.write_text(f"zero:\n  stage: {stage}\n  reduce_bucket_size: 4096\n")
        out = tmp_path / f"zero{stage}"
        accelerate_launch("accel_clip_train.py", nproc, "--backend", "zero", "--out", str(out), *args,
                          zero_yaml=cfg)
        log = json.load(open(out / "log.json"))
        assert log["optimizer_steps"] == ref_log["optimizer_steps"]
        torch.testing.assert_close(torch.tensor(log["losses"]), torch.tensor(ref_log["losses"]), rtol=1e-5, atol=1e-6)
        assert_same_weights(os.path.join(out, "weights.safetensors"), os.path.join(ref, "weights.safetensors"))
