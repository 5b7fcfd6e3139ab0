"""Stage 3 with uneven work per rank, the collective-mismatch check, fp16 loss scaling, and a model with
parameters of several dtypes plus a buffer. One spawn of 2 gloo workers; references never import hf_zero."""
import copy

import pytest
import torch
import torch.nn as nn

import models
from _dist import DistResults

WORLD = 2


def _ids(rank):
    return models.rank_slice(models.make_batches(1, 1)[0][0], rank, WORLD)


# -------------------------------------------------------------------------------------------- scenarios (workers)
def uneven_generate(rank, world_size):
    """Ranks generate different lengths inside gathered_parameters(), then train on together."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("llama")
    reference = copy.deepcopy(model).eval()
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3))
    prompt = _ids(rank)[:, :4]
    new = 2 + 3 * rank  # rank 1 runs three more forwards than rank 0
    model.eval()
    with engine.gathered_parameters():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    expected = reference.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    model.train()
    x = _ids(rank)
    engine.backward(model(input_ids=x, labels=x).loss)  # collectives line up again after the block
    norm = engine.clip_grad_norm_(1.0)
    engine.optimizer.step()
    return {"out": out, "expected": expected, "norm": float(norm)}


def mismatch(rank, world_size):
    """Rank 0 runs an extra forward at stage 3: with debug_collectives both ranks raise, naming the units."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("llama")
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3, debug_collectives=True))
    x = _ids(rank)
    try:
        for _ in range(2 if rank == 0 else 1):
            loss = model(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.optimizer.step()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"type": type(exc).__name__, "msg": str(exc)}
    return None


def fp16_scaling(rank, world_size):
    """fp16: dynamic loss scale; an overflowing step is skipped (weights unchanged) and the scale halves."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("gpt2")
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=2, mixed_precision="fp16",
                                                                         initial_loss_scale=1024.0))
    x = _ids(rank)
    engine.backward(model(input_ids=x, labels=x).loss)
    engine.optimizer.step()
    after_good = {k: v.clone() for k, v in engine.full_state_dict().items()}
    scale_good = engine.scaler.scale
    engine.backward(model(input_ids=x, labels=x).loss * 1e30)  # overflows fp16 gradients
    norm = engine.clip_grad_norm_(1.0)
    engine.optimizer.step()
    after_skip = {k: v.clone() for k, v in engine.full_state_dict().items()}
    return {"scale_good": scale_good, "scale_after": engine.scaler.scale, "norm": float(norm),
            "changed": any(not torch.equal(after_good[k], after_skip[k]) for k in after_good) if rank == 0 else None,
            "dtype": str(next(model.parameters()).dtype)}


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.lin = nn.Linear(6, 6).to(dtype)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x.to(self.lin.weight.dtype))).to(torch.float32)


class MixedNet(nn.Module):
    """Parameters in float32 and float64 (and a frozen one), a buffer per block: several flat groups per unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(torch.float32), Block(torch.float64), Block(torch.float32)])
        self.frozen = nn.Parameter(torch.randn(6), requires_grad=False)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x) + self.frozen
        return self.head(x).pow(2).mean()


def mixed_dtypes(rank, world_size, stage):
    from hf_zero import ZeroConfig, shard_model

    def opt(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)

    data = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(3))
    ref = MixedNet()
    ref_opt = opt(ref)
    for step in range(4):
        ref(data[step]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = MixedNet()
    engine = shard_model(model, opt(model), ZeroConfig(stage=stage))
    per = data.shape[1] // world_size
    for step in range(4):
        engine.backward(model(data[step][rank * per:(rank + 1) * per]))
        engine.optimizer.step()
    full = engine.full_state_dict()
    ref_sd = ref.state_dict()
    return {"err": {k: (full[k].double() - ref_sd[k].double()).abs().max().item() for k in ref_sd} if rank == 0 else
            None, "dtypes": {k: str(v.dtype) for k, v in full.items()} if rank == 0 else None,
            "ref_dtypes": {k: str(v.dtype) for k, v in ref_sd.items()}}


def scenarios_for(world_size):
    return [("uneven_generate", uneven_generate, {}), ("fp16", fp16_scaling, {})] + [
        (f"mixed-s{s}", mixed_dtypes, {"stage": s}) for s in (0, 1, 2, 3)] + [
        ("mismatch", mismatch, {})]  # last: it leaves the group after an error


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


# ---------------------------------------------------------------------------------------------------- the tests
def test_uneven_generate_inside_gathered_parameters(dist_results):
    res = dist_results(WORLD, "uneven_generate")
    for rank, r in enumerate(res):
        assert r["out"].shape[1] == 4 + 2 + 3 * rank
        assert torch.equal(r["out"], r["expected"]), f"rank {rank}: sharded generate differs from the full model"
    assert res[0]["norm"] == pytest.approx(res[1]["norm"], rel=1e-6) and res[0]["norm"] > 0


def test_collective_mismatch_names_the_units(dist_results):
    res = dist_results(WORLD, "mismatch")
    for rank, r in enumerate(res):
        assert r is not None, f"rank {rank} did not notice the mismatch"
        assert r["type"] == "CollectiveMismatchError", r
        assert "unit model.layers" in r["msg"] and "rank" in r["msg"], r["msg"]


def test_fp16_scales_and_skips_overflow(dist_results):
    res = dist_results(WORLD, "fp16")
    for r in res:
        assert r["dtype"] == "torch.float16"
        assert r["scale_good"] == 1024.0
        assert r["scale_after"] == 512.0  # halved by the overflow
        assert r["norm"] == float("inf")
    assert res[0]["changed"] is False  # the overflowing step left every weight as it was


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_dtypes_frozen_and_buffers_match_reference(dist_results, stage):
    r = dist_results(WORLD, f"mixed-s{stage}")[0]
    assert r["dtypes"] == r["ref_dtypes"]
    bad = {k: e for k, e in r["err"].items() if e > 1e-5}
    assert not bad, bad
