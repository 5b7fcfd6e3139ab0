"""ZeRO-R and offload: activation checkpointing (on / partitioned / CPU) and optimizer / parameter offload train
exactly like plain single-process training without either.

Scenarios run at world size 3 (padding everywhere) through the same recipe as test_engine_equivalence: a tiny
GPT-2 (tied) or Llama (untied), 4 AdamW steps x 3 accumulated micro-batches, clipping.
"""
import pytest
import torch

import models
from _dist import DistResults
from _recipe import ACCUM, STEPS, engine_train, reference_train
from test_engine_equivalence import check_against_reference

WORLD = 3
STAGES = (1, 2, 3)
# (mode, cpu_checkpointing): "partitioned" with pure data parallelism has no model-parallel group to split across
CHECKPOINTING = {"on": ("on", False), "cpu": ("on", True), "partitioned": ("partitioned", False),
                 "partitioned-cpu": ("partitioned", True)}
OFFLOAD = {"opt": dict(offload_optimizer="cpu"), "opt-params": dict(offload_optimizer="cpu", offload_params="cpu")}


def _kind(stage, i):
    return models.KINDS[(stage + i) % len(models.KINDS)]  # both model families over the combinations


def scenarios_for(world_size):
    sc = [(f"ckpt-{name}-s{stage}", engine_train, dict(kind=_kind(stage, i), stage=stage, zero_checkpointing=ck))
          for stage in STAGES for i, (name, ck) in enumerate(CHECKPOINTING.items())]
    sc += [(f"offload-{name}-s{stage}", offload_train, dict(kind=_kind(stage, i), stage=stage, **kw))
           for i, (name, kw) in enumerate(OFFLOAD.items()) for stage in STAGES
           if stage == 3 or "offload_params" not in kw]
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def offload_train(rank, world_size, kind, stage, **offload):
    """The recipe with offload, plus, counted through the optimizer's public API, the storages the step reads and
    writes (master segments, optimizer states) and their devices."""
    probe = {}
    real_step = torch.optim.AdamW.step

    def counting_step(opt, *args, **kwargs):
        if opt.state:  # AdamW makes its states in the first step: count from the second on
            tensors = [p for g in opt.param_groups for p in g["params"]]
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
            probe["devices"] = sorted({str(t.device) for t in tensors})
            probe["bytes"] = _storage_bytes(tensors)
        return real_step(opt, *args, **kwargs)

    torch.optim.AdamW.step = counting_step
    try:
        out = engine_train(rank, world_size, kind, stage=stage, probe_step=STEPS - 1, **offload)
    finally:
        torch.optim.AdamW.step = real_step
    out["step_tensors"] = probe
    return out


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("name,stage", [(n, s) for n, kw in OFFLOAD.items() for s in STAGES
                                        if s == 3 or "offload_params" not in kw])
def test_offload_matches_plain_training_and_places_states_on_host(dist_results, name, stage):
    i = list(OFFLOAD).index(name)
    kind = _kind(stage, i)
    ranks = dist_results(WORLD, f"offload-{name}-s{stage}")
    check_against_reference(ranks, reference_train(kind, "full", STEPS, ACCUM), WORLD)
    model = models.make_model(kind)
    psi = sum(p.numel() for p in model.parameters())  # every parameter trains; tied weights counted once
    for r, res in enumerate(ranks):
        step, stats = res["step_tensors"], res["memory"]["stats"]
        assert step["devices"] == ["cpu"], f"rank {r}: the offloaded step ran on {step['devices']}"
        # fp32 master (4 B) + AdamW's exp_avg and exp_avg_sq (8 B) per owned element, padding at most one
        # element per parameter tensor and group (and AdamW's scalar step counters)
        assert 12 * psi / WORLD <= step["bytes"] <= 12 * (psi / WORLD + 64), (r, step["bytes"], psi)
        params_host = stats["params"] if "offload_params" in OFFLOAD[name] else 0
        assert stats["offloaded"] == step["bytes"] + params_host, (r, stats)
        if params_host:  # stage 3 parameter shards: 4 B per owned element
            assert 4 * psi / WORLD <= params_host <= 4 * (psi / WORLD + 64)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(CHECKPOINTING))
def test_checkpointing_matches_plain_training(dist_results, name, stage):
    i = list(CHECKPOINTING).index(name)
    ranks = dist_results(WORLD, f"ckpt-{name}-s{stage}")
    calls = [res["layer_calls_per_micro_batch"] for res in ranks]
    assert calls == [2.0] * WORLD, f"decoder layers ran {calls} times per micro-batch: no recomputation"
    check_against_reference(ranks, reference_train(_kind(stage, i), "full", STEPS, ACCUM), WORLD)
