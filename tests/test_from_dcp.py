"""torch.distributed.checkpoint folders read by hf_zero (checkpoint/from_dcp.py) and hf_zero checkpoints written as
DCP (checkpoint/to_dcp.py).

- Reading: tiny models trained 2 steps with torch's AdamW and saved by `dcp.save` the three ways DCP folders come
  (`{"model", "optim"}`, Accelerate's FSDP2 save_state folders, torchtitan's top-level model keys with a flattened
  optimizer state); `DcpSource` must give exactly the live model's weights and the live optimizer's moments, step
  and hyper-parameters (torch.equal), whole and in ranges, a tied weight under both names.
- Hostile folders: a pickle payload planted in `.metadata`, in a bytes entry and in a tensor entry of a data file
  does not run (a marker file stays absent) and the error names the file; a truncated or missing data file and a
  data file named outside the folder are errors naming it; nothing in the folder changes.
- Resume (slow): real FSDP2 (`fully_shard` on 2 gloo ranks) saves, hf_zero loads at 3 ranks (stages 3 and 2) and
  goes on; FSDP2 goes on too; losses and weights agree to fp32 rounding.
- Export: an hf_zero checkpoint of 2 ranks written as DCP and loaded by plain torch (`dcp.load`,
  `set_model_state_dict`, `set_optimizer_state_dict`) holds the weights and AdamW state of torch's AdamW trained on
  the same batches in one process (fp64).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

import models
from _dist import run_scenarios
from test_foreign import _Payload, _snapshot
from hf_zero.checkpoint import CheckpointError
from hf_zero.checkpoint.foreign import read_dcp_metadata
from hf_zero.checkpoint.from_dcp import DcpSource, parameter_names
from hf_zero.checkpoint.open_foreign import open_foreign
from hf_zero.checkpoint.pickles import UntrustedPickleError


def _dcp_save(state, folder):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))


def _train(kind, variant="full", steps=2):
    model = models.make_model(kind, variant)
    opt = models.make_optimizer(model)
    for batch in models.make_batches(steps, 1):
        x = batch[0]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(model, opt, folder, layout):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    msd = get_model_state_dict(model)
    if layout == "torch":
        _dcp_save({"model": msd, "optim": get_optimizer_state_dict(model, opt)}, folder)
    elif layout == "accelerate":  # accelerate/utils/fsdp_utils.py save_fsdp_model / save_fsdp_optimizer
        _dcp_save({"model": msd}, folder / "pytorch_model_fsdp_0")
        _dcp_save({"optimizer": get_optimizer_state_dict(model, opt)}, folder / "optimizer_0")
    else:  # torchtitan: the model's keys at the top level, the optimizer's state flattened
        flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        _dcp_save({**msd, "optimizer": flat, "train_state": {"step": 2}}, folder)
    return str(folder)


def _group_of(opt):
    return {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}


@pytest.mark.parametrize("kind, layout", [("llama", "torch"), ("gpt2", "torch"), ("gpt2", "accelerate"),
                                          ("llama", "torchtitan")])
def test_dcp_source_reads_exactly_what_torch_saved(tmp_path, kind, layout):
    model, opt = _train(kind)
    folder = _save(model, opt, tmp_path / "ckpt", layout)
    src = open_foreign(folder)
    assert isinstance(src, DcpSource)
    if layout == "accelerate":
        assert src.describe() == "FSDP2 (DCP) checkpoint, 1 rank, step 2"
    else:
        assert src.describe() == "torch.distributed.checkpoint (DCP) checkpoint, 1 rank, step 2"
    assert src.state_keys == ["exp_avg", "exp_avg_sq"] and src.scalar_keys == ["step"]
    assert src.m["model"]["buffers"] == []  # GPT-2 and Llama have no persistent buffers
    group_of = _group_of(opt)
    saved_groups = src.m["optimizer"]["param_groups"]
    assert len(saved_groups) == len(opt.param_groups) == 2
    for saved, live in zip(saved_groups, opt.param_groups):
        assert saved["lr"] == live["lr"] and saved["weight_decay"] == live["weight_decay"]
        assert tuple(saved["betas"]) == live["betas"] and saved["eps"] == live["eps"]
    names = parameter_names(model)
    assert [p.name for p in src.params] == list(names)
    for name, aliases in names.items():
        p = dict(model.named_parameters(remove_duplicate=False))[name]
        n, st = p.numel(), opt.state[p]
        info = src.by_name[name]
        assert info.shape == list(p.shape) and info.trainable and info.aliases == aliases[1:]
        assert src.m["optimizer"]["param_group_of"][name] == group_of[id(p)]
        for alias in aliases:  # a tied weight read under either name
            assert torch.equal(src.read(alias, "values", 0, n), p.detach().reshape(-1))
        assert torch.equal(src.read(name, "state.exp_avg", 0, n), st["exp_avg"].reshape(-1))
        assert torch.equal(src.read(name, "state.exp_avg_sq", 0, n), st["exp_avg_sq"].reshape(-1))
        assert src.scalar(name, "step") == float(st["step"]) == 2.0
        lo, hi = n // 3, n // 3 + max(1, n // 5)  # a range, as a rank reads its part
        assert torch.equal(src.read(name, "values", lo, hi), p.detach().reshape(-1)[lo:hi])
        assert torch.equal(src.read(name, "state.exp_avg_sq", lo, hi), st["exp_avg_sq"].reshape(-1)[lo:hi])
    if kind == "gpt2":
        assert src.by_name["lm_head.weight"].name == "transformer.wte.weight"  # found by its values, no hint
    src.close()


def test_frozen_parameter_needs_the_model_to_tell_it_from_a_buffer(tmp_path):
    model, opt = _train("llama", "frozen_emb")
    folder = _save(model, opt, tmp_path / "ckpt", "torch")
    emb = "model.embed_tokens.weight"
    guessed = open_foreign(folder)  # one process: DCP records a frozen parameter and a buffer alike
    assert [b["name"] for b in guessed.m["model"]["buffers"]] == [emb]
    told = open_foreign(folder, parameters=parameter_names(model))
    assert told.m["model"]["buffers"] == [] and not told.by_name[emb].trainable
    w = model.get_input_embeddings().weight
    assert torch.equal(told.read(emb, "values", 5, 50), w.detach().reshape(-1)[5:50])
    assert told.read(emb, "state.exp_avg", 0, 10) is None and told.scalar(emb, "step") is None
    assert told.files_for(emb, 0, 10) == ["__0_0.distcp"]


# ------------------------------------------------------------------------------------------ hostile folders
@pytest.fixture()
def saved(tmp_path):
    model, opt = _train("gpt2", steps=1)
    return _save(model, opt, tmp_path / "ckpt", "torch")


def _plant(folder, key, blob):
    """Append `blob` to the data file holding `key` and point the metadata's entry of `key` at it."""
    meta = read_dcp_metadata(folder)
    index, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn == key)
    path = os.path.join(folder, info.relative_path)
    start = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(blob)
    meta.storage_data[index] = dataclasses.replace(info, offset=start, length=len(blob))
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    return path


def _payload_bytes(marker):
    import io

    buf = io.BytesIO()
    torch.save({"pad": "0" * 10000, "x": _Payload(f"touch {marker}")}, buf)  # as long as the tensor it replaces
    return buf.getvalue()


def test_payload_in_metadata_does_not_run(saved, tmp_path):
    marker = tmp_path / "ran"
    with open(os.path.join(saved, ".metadata"), "wb") as f:
        pickle.dump({"x": _Payload(f"touch {marker}")}, f)
    before = _snapshot(saved)
    with pytest.raises(UntrustedPickleError, match=r"\.metadata: refused.*system"):
        open_foreign(saved)
    assert not marker.exists() and _snapshot(saved) == before


def test_payload_in_a_bytes_entry_does_not_run(saved, tmp_path):
    """DCP's own planner would torch.load a bytes entry with weights_only=False; hf_zero never lets it."""
    marker = tmp_path / "ran"
    path = _plant(saved, "optim.param_groups.0.lr", _payload_bytes(marker))
    before = _snapshot(saved)
    with pytest.raises(UntrustedPickleError, match=rf"{path} \(optim.param_groups.0.lr\): refused"):
        open_foreign(saved)
    assert not marker.exists() and _snapshot(saved) == before


def test_payload_in_a_tensor_entry_does_not_run(saved, tmp_path):
    marker = tmp_path / "ran"
    path = _plant(saved, "model.transformer.wpe.weight", _payload_bytes(marker))
    src = open_foreign(saved)
    before = _snapshot(saved)
    refused = rf"{path}: refused to unpickle model.transformer.wpe.weight \(Trying to load unsupported GLOBAL posix"
    with pytest.raises(UntrustedPickleError, match=refused):
        src.read("transformer.wpe.weight", "values", 0, 10)
    assert not marker.exists() and _snapshot(saved) == before


def test_chunks_that_do_not_tile_the_tensor_are_refused_before_any_allocation(saved):
    meta = read_dcp_metadata(saved)
    key = "model.transformer.wpe.weight"
    md = meta.state_dict_metadata[key]
    meta.state_dict_metadata[key] = dataclasses.replace(md, size=torch.Size([10**6, 10**6]))  # 4 TB, if allocated
    with open(os.path.join(saved, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    src = open_foreign(saved)
    with pytest.raises(CheckpointError, match=rf"{key} is \[1000000, 1000000\] \(torch.float32\) but its data files"):
        src.read("transformer.wpe.weight", "values", 0, 10)
    chunk = md.chunks[0]
    half = dataclasses.replace(chunk, sizes=torch.Size([chunk.sizes[0] // 2, chunk.sizes[1]]))
    meta.state_dict_metadata[key] = dataclasses.replace(md, chunks=[half])
    with open(os.path.join(saved, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(CheckpointError, match=f"the chunks of {key} do not cover it exactly once"):
        open_foreign(saved).read("transformer.wpe.weight", "values", 0, 10)


def test_truncated_missing_and_outside_data_files_are_named(saved, tmp_path):
    data = os.path.join(saved, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 100)
    before = _snapshot(saved)
    with pytest.raises(CheckpointError, match=rf"{data} is \d+ bytes but the DCP metadata records data up to"):
        open_foreign(saved)
    assert _snapshot(saved) == before
    os.remove(data)
    with pytest.raises(CheckpointError, match="DCP checkpoint without.*__0_0.distcp"):
        open_foreign(saved)
    # a metadata that names a file outside the folder
    shutil.copy(os.path.join(saved, ".metadata"), tmp_path / "meta")
    meta = read_dcp_metadata(saved)
    meta.storage_data = {i: dataclasses.replace(s, relative_path="../outside.distcp")
                         for i, s in meta.storage_data.items()}
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 100000)
    with open(os.path.join(saved, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(CheckpointError, match=r"names the data file '\.\./outside\.distcp', not a file name"):
        open_foreign(saved)


# ------------------------------------------------------------------------------------------ FSDP2 -> hf_zero
SAVED_AT, MORE = 3, 2  # FSDP2 trains SAVED_AT steps, saves, and both go on MORE steps


def _global_loss(loss, world_size):
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / world_size


def fsdp2_train(rank, world_size, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = models.make_model("gpt2")
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = models.make_optimizer(model)
    batches = models.make_batches(SAVED_AT + MORE, 1)
    losses = []
    for step in range(SAVED_AT + MORE):
        if step == SAVED_AT:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
        x = models.rank_slice(batches[step][0], rank, world_size)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world_size))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses[SAVED_AT:], "state": {k: v.clone() for k, v in full.items()} if rank == 0 else None}


def hf_zero_resume(rank, world_size, folder, stage):
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import load_checkpoint

    model = models.make_model("gpt2", seed=7)  # another start: only the load can make it right
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage))
    manifest = load_checkpoint(engine, folder)
    batches = models.make_batches(SAVED_AT + MORE, 1)
    losses = []
    for step in range(SAVED_AT, SAVED_AT + MORE):
        x = models.rank_slice(batches[step][0], rank, world_size)
        loss = engine.model(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        losses.append(_global_loss(loss, world_size))
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state if rank == 0 else None, "step": manifest.get("step")}


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_in_hf_zero_at_3_ranks(tmp_path):
    folder = str(tmp_path / "fsdp2")
    fsdp2 = run_scenarios(2, [("fsdp2", fsdp2_train, {"folder": folder})])["fsdp2"]
    if isinstance(fsdp2, Exception):
        raise fsdp2
    found = open_foreign(folder)
    assert found.describe() == f"FSDP2 (DCP) checkpoint, 2 ranks, step {SAVED_AT}"
    results = run_scenarios(3, [(f"stage{s}", hf_zero_resume, {"folder": folder, "stage": s}) for s in (3, 2)])
    ref = fsdp2[0]
    for stage in (3, 2):
        got = results[f"stage{stage}"]
        if isinstance(got, Exception):
            raise got
        assert got[0]["step"] == SAVED_AT
        torch.testing.assert_close(torch.tensor(got[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        for key, value in ref["state"].items():
            torch.testing.assert_close(got[0]["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


# ------------------------------------------------------------------------------------------ hf_zero -> DCP
EXPORT_STEPS = 2


def _lm_loss(model, x):
    """Next-token cross-entropy in the logits' dtype: fp64 here (Transformers' own loss casts the logits to fp32)."""
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def hf_zero_save(rank, world_size, folder):
    """Stage 3 on 2 ranks, fp64, EXPORT_STEPS steps, each rank on its half of every batch; saved at the end."""
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import save_checkpoint

    model = models.make_model("gpt2").double()
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3))
    for batch in models.make_batches(EXPORT_STEPS, 1):
        x = models.rank_slice(batch[0], rank, world_size)
        engine.backward(_lm_loss(engine.model, x))
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    save_checkpoint(engine, folder, step=EXPORT_STEPS)
    engine.close()
    return True


@functools.lru_cache(maxsize=None)
def _plain_adamw():
    """The reference: torch's AdamW on an unsharded copy of the model in one process, the whole of the same batches
    (each rank's mean loss over an equal share of the tokens: their average is this mean)."""
    model = models.make_model("gpt2").double()
    opt = models.make_optimizer(model)
    for batch in models.make_batches(EXPORT_STEPS, 1):
        _lm_loss(model, batch[0]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _torch_load(folder, layout):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model = models.make_model("gpt2", seed=7).double()
    opt = models.make_optimizer(model)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if layout == "torch":
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(folder))
            msd, osd = state["model"], state["optim"]
        else:
            m, o = {"model": msd}, {"optimizer": osd}
            dcp.load(m, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
            dcp.load(o, checkpoint_id=str(folder / "optimizer_0"))
            msd, osd = m["model"], o["optimizer"]
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt, osd)
    return model, opt


@pytest.fixture(scope="module")
def hf_zero_checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hfz") / "ckpt")
    ranks = run_scenarios(2, [("save", hf_zero_save, {"folder": folder})])["save"]
    if isinstance(ranks, Exception):
        raise ranks
    return folder, ranks


# The engine's fp64 state and the plain one differ by summation order only (~1e-16); the export keeps the masters'
# and moments' fp64 (to_dcp.py), so the tolerance is fp64's: a narrowing to fp32 (~1e-8 relative) fails it.
RTOL, ATOL = 1e-12, 1e-14


@pytest.mark.parametrize("layout, batch_bytes", [("torch", 1 << 30), ("torch", 20000), ("accelerate", 20000)])
def test_export_dcp_loads_in_plain_torch_as_plain_adamw_trained(hf_zero_checkpoint, tmp_path, layout, batch_bytes):
    """The DCP folder, loaded by plain torch (dcp.load, set_model_state_dict, set_optimizer_state_dict) into a model
    of another seed, holds the weights, exp_avg, exp_avg_sq and step of torch's AdamW trained on the same batches in
    one process, in the parameters' fp64."""
    from hf_zero.checkpoint.to_dcp import export_dcp

    folder, _ = hf_zero_checkpoint
    out = export_dcp(folder, tmp_path / "dcp", layout=layout, batch_bytes=batch_bytes)
    model, opt = _torch_load(out, layout)
    plain, plain_opt = _plain_adamw()
    plain_params = dict(plain.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(plain_params)
    for name, p in model.named_parameters():
        want, want_state, st = plain_params[name], plain_opt.state[plain_params[name]], opt.state[p]
        torch.testing.assert_close(p.detach(), want.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[key], want_state[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}.{key}: {m}")
        assert float(st["step"]) == float(want_state["step"]) == EXPORT_STEPS, name
    # a model of another seed took every value from the folder: nothing equals its start
    start = dict(models.make_model("gpt2", seed=7).double().named_parameters())
    assert not any(torch.equal(p.detach(), start[n].detach()) for n, p in model.named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-2]
    files = sorted(n for n in os.listdir(out if layout == "torch" else out / "pytorch_model_fsdp_0")
                   if n.endswith(".distcp"))
    assert (len(files) > 1) == (batch_bytes < 1 << 30)  # streamed in batches
    # and hf_zero's own DCP reader reads it back
    src = open_foreign(str(out))
    w = model.transformer.h[1].mlp.c_fc.weight
    assert torch.equal(src.read("transformer.h.1.mlp.c_fc.weight", "values", 0, w.numel()), w.detach().reshape(-1))


def test_export_dcp_refuses_a_folder_with_files(hf_zero_checkpoint, tmp_path):
    from hf_zero.checkpoint.to_dcp import export_dcp

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an empty folder"):
        export_dcp(hf_zero_checkpoint[0], tmp_path / "busy")
    assert os.listdir(tmp_path / "busy") == ["keep.txt"]


@pytest.mark.parametrize("kind, layout", [("gpt2", "torch"), ("llama", "accelerate")])
def test_consolidate_a_dcp_folder_gives_save_pretrained_of_the_live_model(tmp_path, kind, layout):
    """`hf-zero consolidate` on a DCP folder (and `hf-zero convert` then consolidate): the folder from_pretrained
    loads holds the live model's weights, under save_pretrained's own keys (its output is the reference)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_zero.cli import main

    model, opt = _train(kind)
    folder = _save(model, opt, tmp_path / "dcp", layout)
    model.save_pretrained(tmp_path / "reference")
    reference = load_file(str(tmp_path / "reference" / "model.safetensors"))
    for route in ("consolidate", "convert"):
        out = tmp_path / f"out-{route}"
        if route == "consolidate":
            assert main(["consolidate", folder, str(out), "--config", str(tmp_path / "reference")]) == 0
        else:
            assert main(["convert", folder, str(tmp_path / "converted")]) == 0
            assert main(["consolidate", str(tmp_path / "converted"), str(out), "--config",
                         str(tmp_path / "reference")]) == 0
        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(reference), route
        for name, value in reference.items():
            assert torch.equal(got[name], value), (route, name)
        loaded = AutoModelForCausalLM.from_pretrained(out)
        for name, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), (route, name)


def test_the_manifest_records_every_parameters_group_not_only_rank_0s(hf_zero_checkpoint):
    """A 2-rank stage-3 save: the manifest's param_group_of names every trained parameter with the group the user's
    optimizer put it in (it used to hold rank 0's segments only)."""
    from hf_zero.checkpoint import read_manifest

    folder, _ = hf_zero_checkpoint
    model = models.make_model("gpt2")
    opt = models.make_optimizer(model)
    name_of = {id(p): n for n, p in model.named_parameters()}  # tied: the first name, as the engine's slots
    expected = {name_of[id(p)]: gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    assert read_manifest(folder)["optimizer"]["param_group_of"] == expected


@pytest.mark.parametrize("layout", ["torch", "accelerate", "torchtitan"])
def test_looks_foreign_sees_each_dcp_layout_and_not_other_folders(tmp_path, layout):
    """What load_state and the Trainer's resume take for a foreign folder (by its file names alone): every DCP
    layout; not an empty folder, a save_pretrained folder or an hf_zero checkpoint's parent."""
    from hf_zero.checkpoint.foreign import looks_foreign

    model, opt = _train("llama")
    assert looks_foreign(_save(model, opt, tmp_path / "dcp", layout))
    (tmp_path / "empty").mkdir()
    model.save_pretrained(tmp_path / "pretrained")
    (tmp_path / "state" / "zero_shards").mkdir(parents=True)
    for other in ("empty", "pretrained", "state", "missing"):
        assert not looks_foreign(str(tmp_path / other)), other
