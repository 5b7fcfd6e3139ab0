"""Issue #45 item 1, at the engine: stage 3's `model.state_dict()` / `save_pretrained()` outside a gather.

- Called on every rank (as Transformers' example scripts do), it is collective, as under FSDP2: rank 0 gets the full
  weights (CPU, original dtype, trainable ones from the fp32 master), the other ranks meta tensors of the same
  shapes and dtypes, so they keep no full copy (their only real tensors are the module buffers).
  `save_pretrained(dir, is_main_process=rank == 0)` on every rank writes what plain `save_pretrained` of the same
  model trained without ZeRO writes (the reference: single-process training on the same batches).
- Called on some ranks only, every caller gets a RuntimeError naming the ranks that did not call, within
  `state_dict_timeout_s` (here 3 s) instead of a hang, no weights file is written, and the next call made on every
  rank works again.
- Inside `gathered_parameters()` it is local and gives the gathered values on every rank, as before.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Dict

import pytest
import torch

import models
from _dist import DistResults
from _recipe import reference_train

pytestmark = pytest.mark.slow  # 4 spawns of 2-3 ranks, two of them wait out the 3 s timeout

WORLD_SIZES = (2, 3)
TIMEOUT_S = 3.0
RTOL, ATOL = 1e-5, 1e-6


def _train_one_step(rank: int, world_size: int, kind: str, **config):
    """reference_train(kind, "full", 1, 1)'s step on this rank's slice, at stage 3."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model(kind)
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3, **config))
    (mb,) = models.make_batches(1, 1)[0]
    x = models.rank_slice(mb, rank, world_size)
    engine.backward(model(input_ids=x, labels=x).loss)
    engine.clip_grad_norm_(1.0)
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    return model, engine


def _shared_tmpdir(rank: int) -> str:
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="hfz_sd_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _describe(sd: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    return {k: (v.device.type, tuple(v.shape), v.dtype, v.detach().clone() if v.device.type != "meta" else None)
            for k, v in sd.items()}


def sc_collective(rank: int, world_size: int, kind: str) -> Dict[str, Any]:
    from safetensors.torch import load_file

    model, engine = _train_one_step(rank, world_size, kind)
    out: Dict[str, Any] = {"state_dict": _describe(model.state_dict()),
                           "keep_vars": _describe(model.state_dict(keep_vars=True))}
    folder = _shared_tmpdir(rank)
    model.save_pretrained(folder, is_main_process=rank == 0)
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        out["files"] = sorted(os.listdir(folder))
        out["saved"] = load_file(os.path.join(folder, "model.safetensors"))
    with engine.gathered_parameters():
        out["gathered"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["buffers"] = {n for n, _ in model.named_buffers()}
    # memory: the tensor bytes each call allocates (tests/test_export.py's counter), state_dict() beside
    # full_state_dict() (what accelerator.get_state_dict calls)
    from test_export import measured

    _, out["state_dict_peak"], _ = measured(lambda: model.state_dict())
    _, out["full_state_dict_peak"], _ = measured(engine.full_state_dict)
    engine.close()
    return out


def sc_some_ranks(rank: int, world_size: int, absent: int) -> Dict[str, Any]:
    """Every rank but `absent` calls save_pretrained; then every rank calls state_dict()."""
    import torch.distributed as dist

    model, engine = _train_one_step(rank, world_size, "llama", state_dict_timeout_s=TIMEOUT_S)
    folder = _shared_tmpdir(rank)
    out: Dict[str, Any] = {}
    if rank != absent:
        start = time.monotonic()
        try:
            model.save_pretrained(folder, is_main_process=rank == 0)
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = str(exc)
        out["elapsed"] = time.monotonic() - start
    dist.barrier()  # the absent rank waits here: it does not call state_dict before the others gave up
    out["files"] = sorted(os.listdir(folder))
    sd = model.state_dict()  # now on every rank: collective again
    full = engine.full_state_dict()
    out["after"] = {k: v.clone() for k, v in sd.items()} if rank == 0 else {k: v.device.type for k, v in sd.items()}
    out["full"] = full
    engine.close()
    return out


def scenarios_for(world_size: int):
    sc = [(f"collective-{kind}", sc_collective, dict(kind=kind)) for kind in models.KINDS]
    sc += [(f"some-ranks-absent{a}", sc_some_ranks, dict(absent=a)) for a in (0, 1)]
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def _reference_save(kind: str) -> Dict[str, Any]:
    """Plain training, then plain save_pretrained: its files and tensors."""
    from safetensors.torch import load_file

    ref = reference_train(kind, "full", 1, 1)
    model = models.make_model(kind)
    model.load_state_dict(ref["state"])
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return {"state": ref["state"], "files": sorted(os.listdir(tmp)),
                "saved": load_file(os.path.join(tmp, "model.safetensors"))}


@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_on_every_rank_is_the_full_model_on_rank_0(dist_results, world_size, kind):
    ranks = dist_results(world_size, f"collective-{kind}")
    ref = _reference_save(kind)
    for what in ("state_dict", "keep_vars"):
        got = ranks[0][what]
        assert list(got) == list(ref["state"]), what
        for k, want in ref["state"].items():
            device, shape, dtype, value = got[k]
            assert (device, shape, dtype) == ("cpu", tuple(want.shape), want.dtype), (what, k)
            torch.testing.assert_close(value, want, rtol=RTOL, atol=ATOL, msg=f"{what} {k}")
        for r, res in enumerate(ranks[1:], 1):
            other = res[what]
            assert list(other) == list(ref["state"]), (r, what)
            for k, want in ref["state"].items():
                device, shape, dtype, _ = other[k]
                assert (shape, dtype) == (tuple(want.shape), want.dtype), (r, what, k)
                # no full copy elsewhere: parameters are meta, only the module buffers hold values
                assert device == ("cpu" if k in res["buffers"] else "meta"), (r, what, k, device)


@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_save_pretrained_on_every_rank_writes_what_plain_save_pretrained_writes(dist_results, world_size, kind):
    ranks = dist_results(world_size, f"collective-{kind}")
    ref = _reference_save(kind)
    assert ranks[0]["files"] == ref["files"]
    saved = ranks[0]["saved"]
    assert sorted(saved) == sorted(ref["saved"])  # a tied lm_head written once, as plain save_pretrained does
    for k, want in ref["saved"].items():
        torch.testing.assert_close(saved[k], want, rtol=RTOL, atol=ATOL, msg=k)


@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_memory_is_get_state_dicts_and_other_ranks_keep_no_copy(dist_results, world_size, kind):
    """No rank's peak exceeds what accelerator.get_state_dict (full_state_dict) allocates on the main rank, and a
    rank other than 0 allocates at most one gathered flat group (the largest, counted from the model's shapes by
    tests/_flat_layout.py), never the model."""
    from _flat_layout import layout

    ranks = dist_results(world_size, f"collective-{kind}")
    largest_group = max(g.padded for g in layout(models.make_model(kind), world_size)) * 4  # fp32 masters
    tensors = {id(t): t for t in models.make_model(kind).state_dict(keep_vars=True).values()}  # a tied one once
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    main = ranks[0]["full_state_dict_peak"]
    assert model_bytes <= main <= model_bytes + largest_group, (main, model_bytes, largest_group)
    for r, res in enumerate(ranks):
        assert res["state_dict_peak"] <= main, (r, res["state_dict_peak"], main)
        if r:
            assert res["state_dict_peak"] <= largest_group, (r, res["state_dict_peak"], largest_group)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_inside_gathered_parameters_state_dict_is_local_and_gathered(dist_results, world_size):
    ranks = dist_results(world_size, "collective-llama")
    ref = reference_train("llama", "full", 1, 1)["state"]
    for r, res in enumerate(ranks):
        assert list(res["gathered"]) == list(ref)
        for k, want in ref.items():
            torch.testing.assert_close(res["gathered"][k], want, rtol=RTOL, atol=ATOL, msg=f"rank {r} {k}")


@pytest.mark.parametrize("absent", (0, 1))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_call_on_some_ranks_only_is_an_error_in_bounded_time(dist_results, world_size, absent):
    ranks = dist_results(world_size, f"some-ranks-absent{absent}")
    for r, res in enumerate(ranks):
        if r == absent:
            continue
        err = res["error"]
        assert err is not None, f"rank {r}: save_pretrained without rank {absent} did not raise"
        assert f"rank(s) [{absent}] did not" in err and "every rank" in err, err
        assert "save_pretrained(output_dir, is_main_process=accelerator.is_main_process" in err, err
        # bounded: the timeout, then at most one more wait for a rank that met the others' verdict late
        assert TIMEOUT_S <= res["elapsed"] < 2 * TIMEOUT_S + 30, res["elapsed"]
    for r, res in enumerate(ranks):
        assert not [f for f in res["files"] if f.endswith(".safetensors")], f"rank {r} sees weights: {res['files']}"
    # the next call made on every rank works: the full model on rank 0, meta elsewhere
    full = ranks[0]["full"]
    assert list(ranks[0]["after"]) == list(full)
    for k, v in full.items():
        assert torch.equal(ranks[0]["after"][k], v), k
    for res in ranks[1:]:
        assert set(res["after"].values()) <= {"meta", "cpu"} and "meta" in set(res["after"].values())
