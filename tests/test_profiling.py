"""The engine's phases under torch.profiler (engine/profiling.py): each labelled range appears as often as the
phase happens in a step, counted from the model's structure; without a profiler the labels cost nothing.
One process, no process group."""
import torch
from torch.profiler import ProfilerActivity, profile

import models
from hf_zero import ZeroConfig, shard_model
from hf_zero.engine.profiling import phase


def _counts(prof) -> dict:
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("hf_zero.")}


def _train_step(model, engine, x):
    engine.backward(model(input_ids=x, labels=x).loss)
    engine.clip_grad_norm_(1.0)
    engine.optimizer.step()


def test_without_a_profiler_a_phase_is_the_shared_no_op():
    assert phase("step") is phase("gather")  # no record_function made: nothing recorded, nothing allocated
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with phase("step"):
            pass
    assert _counts(prof) == {"hf_zero.step": 1}


def test_stage3_step_labels_every_gather_release_reduction_and_the_step():
    """A GPT-2 of B blocks at stage 3: the forward gathers the root and each block and releases each block but the
    last (by default, reshard_after_forward="auto" as torchtitan does, the last block stays gathered into its
    backward, like the root), the backward gathers each block but the last again and releases every block and the
    root; every unit's one fp32 group is reduced once; the step (prepare, update) and clip once each; no stage-1/2
    all-gather of updated parameters."""
    model = models.make_model("gpt2")
    blocks = len(models.unit_modules(model))
    engine = shard_model(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    (x,) = models.make_batches(1, 1)[0]
    _train_step(model, engine, x)  # the first step records the forward order
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train_step(model, engine, x)
    got = _counts(prof)
    assert got["hf_zero.gather"] == got["hf_zero.gather.wait"] == (blocks + 1) + (blocks - 1), got
    assert got["hf_zero.release"] == (blocks - 1) + (blocks + 1), got
    assert got["hf_zero.reduce"] == blocks + 1, got
    assert got["hf_zero.reduce.wait"] >= 1, got
    for name in ("hf_zero.step", "hf_zero.step.prepare", "hf_zero.step.update", "hf_zero.clip"):
        assert got[name] == 1, (name, got)
    assert got.get("hf_zero.step.all_gather", 0) == 1  # entered, but stage 3 gathers nothing after the step
    engine.close()


def test_stage1_step_labels_the_reductions_and_the_all_gather_after_the_step():
    model = models.make_model("llama")
    groups = len(models.unit_modules(model)) + 1  # a group per decoder layer and the root's
    engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=0.1), ZeroConfig(stage=1, units=None))
    (x,) = models.make_batches(1, 1)[0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train_step(model, engine, x)
    got = _counts(prof)
    assert "hf_zero.gather" not in got and "hf_zero.release" not in got, got
    assert got["hf_zero.reduce"] == groups, got
    assert got["hf_zero.step"] == got["hf_zero.step.update"] == got["hf_zero.step.all_gather"] == 1, got
    engine.close()
