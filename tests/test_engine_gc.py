"""A dropped engine and its model are freed (issue 34 item 5): a notebook that trains twice must not hold both
models. Hooks that torch keeps in C++ (a parameter's post-accumulate-grad hooks, a tensor's hooks) are invisible to
the garbage collector; a strong reference from one of them to an hf_zero object closes a cycle (parameter -> hook ->
Reducer -> FlatGroup -> parameter) that no collection frees.

Each case builds an engine over a tiny GPT-2, trains two steps, drops engine, model and optimizer, collects, and
checks: the weak references to the engine and the model are dead, and the bytes of tensor storage the collector can
still find do not grow from one round to the next (three rounds). One process without torch.distributed, and two
gloo ranks (tests/_dist.py)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import models
from _dist import DistResults

ROUNDS = 3
CASES = {"s0": dict(stage=0), "s1": dict(stage=1), "s2": dict(stage=2), "s3": dict(stage=3),
         "s3-ckpt-cpu": dict(stage=3, checkpointing="on", cpu=True),
         "s2-frozen": dict(stage=2, variant="frozen_emb")}


def _live_tensor_bytes() -> int:
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except RuntimeError:
                continue
            key = storage.data_ptr()
            if key and key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _round(rank: int, world_size: int, stage: int, variant: str = "full", checkpointing: str = "off",
           cpu: bool = False):
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.engine import enable_activation_checkpointing

    model = models.make_model("gpt2", variant)
    if checkpointing != "off":
        enable_activation_checkpointing(model, checkpointing, cpu=cpu)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = shard_model(model, optimizer, ZeroConfig(stage=stage))
    for step in models.make_batches(2, 1):
        x = models.rank_slice(step[0], rank, world_size)
        engine.backward(model(input_ids=x, labels=x).loss)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    return weakref.ref(engine), weakref.ref(model), weakref.ref(engine.optimizer)


def rounds(rank: int, world_size: int, **case) -> dict:
    """ROUNDS build-train-drop rounds: which weak references survived each, and the live tensor bytes after it."""
    alive, bytes_after = [], []
    for _ in range(ROUNDS):
        refs = _round(rank, world_size, **case)
        gc.collect()
        alive.append([r() is not None for r in refs])
        bytes_after.append(_live_tensor_bytes())
    return {"alive": alive, "bytes": bytes_after}


def _check(out: dict) -> None:
    assert out["alive"] == [[False, False, False]] * ROUNDS, f"engine/model/optimizer alive after del: {out}"
    # the first round may leave one-time caches (autograd, Transformers); later rounds must add nothing
    assert out["bytes"][-1] <= out["bytes"][1], out


@pytest.mark.parametrize("case", sorted(CASES))
def test_dropped_engine_is_freed_one_process(case):
    _check(rounds(0, 1, **CASES[case]))


def scenarios_for(world_size):
    return [(name, rounds, kw) for name, kw in CASES.items()]


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


@pytest.mark.parametrize("case", ["s1", "s2", "s3", "s3-ckpt-cpu"])
def test_dropped_engine_is_freed_two_ranks(dist_results, case):
    for out in dist_results(2, case):
        _check(out)
