"""Sharded checkpoints: resume at another world size / stage / bucket layout equals an uninterrupted run; a save
that fails on one rank leaves the previous checkpoint loadable; damaged checkpoints give clear CheckpointErrors.

All world sizes run in ONE spawn of 4 gloo workers: a "world size N" engine runs on the sub-group of ranks 0..N-1
(N = 4 uses the default group), so a checkpoint saved at N is loaded at M within the same spawn.

Numerics: models in float64 with mixed_precision="no" (the engine then keeps fp64 master weights and states);
tolerance 1e-12. Three things would otherwise break exactness, none of them in the checkpoint code:
- Transformers' causal-LM loss upcasts logits with `.float()`, i.e. *down*casts fp64 logits to fp32: the loss is
  computed here in fp64 instead (lm_loss).
- ZeroEngine.clip_grad_norm_ sums the squares of `grad.float()`, i.e. in fp32 for an fp64 model, which moves the
  weights by ~1e-9 after 4 steps: these runs do not clip.
- HF Llama computes RMSNorm and the eager-attention softmax in fp32, forward and backward. Every rank
  back-propagates its *local* mean loss and the engine divides the summed gradients by W afterwards; fp32 rounding
  commutes with scaling by 2 or 4 but not by 3, so at world size 3 (or 6) the gradients differ from the
  single-process ones by ~1e-7 relative from the first step on, and AdamW grows that to 1e-7..1e-5 in the weights
  (the unexplained W=3 vs W=4 difference). DDP has the same property. test_llama_noise_at_world_size_3 shows it in
  one process without hf_zero; the Llama runs here keep those two ops in fp64 (llama_in_fp64).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
from _dist import DistResults
from hf_zero.checkpoint import export_pretrained, load_checkpoint, save_checkpoint

WORLD = 4
STEPS = 4
ACCUM = 2
BUCKETS = (8192, 5000, 12000)  # bytes per stage-0..2 flat group, per phase: fp64 -> ~1000/625/1500 elements
ATOL, RTOL = 1e-12, 1e-10
LLAMA_FP64 = True  # see llama_in_fp64

# (name, kind, [(world size, stage, steps), ...]): train, save, load into a fresh engine in the next phase, go on
RESUMES = [
    ("2to2-s2", "gpt2", [(2, 2, 2), (2, 2, 2)]),
    ("2to3-s3", "gpt2", [(2, 3, 2), (3, 3, 2)]),
    ("3to2-s1", "gpt2", [(3, 1, 2), (2, 1, 2)]),
    ("4to1-s2", "gpt2", [(4, 2, 2), (1, 2, 2)]),
    ("1to4-s3", "gpt2", [(1, 3, 2), (4, 3, 2)]),
    ("stages-3-2-1", "gpt2", [(2, 3, 2), (3, 2, 1), (4, 1, 1)]),
    ("llama-3to4-s0to2", "llama", [(3, 0, 2), (4, 2, 2)]),
    ("stages-3-2-1-flat", "gpt2", [(2, 3, 2), (3, 2, 1), (4, 1, 1)]),
]
# runs with the flat (NCCL-shaped) collectives: every phase trains, saves and loads (stage 1/2 all-gathers) with them
FLAT = {"stages-3-2-1-flat"}


# ------------------------------------------------------------------------------------------------ worker side
_GROUPS: dict = {}


def _group(n: int):
    """The sub-group of ranks 0..n-1 (None: the whole world). Created once per process, on every rank."""
    if not _GROUPS:
        world = dist.get_world_size()
        for k in range(1, world):
            _GROUPS[k] = dist.new_group(list(range(k)))
        _GROUPS[world] = None
    return _GROUPS[n]


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the logits' dtype (fp64 here)."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


@contextlib.contextmanager
def llama_in_fp64(kind: str):
    """While active: HF Llama's RMSNorm and eager-attention softmax compute in the input's dtype, not fp32
    (see the module docstring: their fp32 backward is not equivariant under the 1/W averaging for W = 3)."""
    if kind != "llama" or not LLAMA_FP64:
        yield
        return
    import transformers.models.llama.modeling_llama as L

    saved = (L.LlamaRMSNorm.forward, L.eager_attention_forward)
    softmax = torch.nn.functional.softmax

    def rms_norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = L.repeat_kv(key, module.num_key_value_groups)
        value_states = L.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = softmax(w, dim=-1)
        return torch.matmul(w, value_states).transpose(1, 2).contiguous(), w

    L.LlamaRMSNorm.forward, L.eager_attention_forward = rms_norm, eager
    try:
        yield
    finally:
        L.LlamaRMSNorm.forward, L.eager_attention_forward = saved


def _make_engine(kind, stage, group, seed, bucket, collectives="auto"):
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model(kind, seed=seed).double()
    opt = models.make_optimizer(model)
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=bucket, allgather_bucket_size=bucket, collectives=collectives)
    return shard_model(model, opt, cfg, process_group=group)


def _train(engine, rank, n, steps, batches):
    for step in steps:
        for j, mb in enumerate(batches[step]):
            x = models.rank_slice(mb, rank, n)
            with engine.no_sync() if j < ACCUM - 1 else contextlib.nullcontext():
                engine.backward(lm_loss(engine.model, x) / ACCUM)
        engine.optimizer.step()
        engine.optimizer.zero_grad()


def _collect(engine):
    sd = engine.full_state_dict()
    segments = []
    for seg in engine.optimizer.segments:
        state = engine.optimizer.state.get(seg.tensor, {})
        start = seg.group.lo + seg.start - seg.slot.offset  # offset inside the parameter
        segments.append((seg.slot.name, start, {k: v.detach().clone() for k, v in state.items()}))
    return {"state": {k: v.clone() for k, v in sd.items()} if sd else None, "segments": segments,
            "num_groups": len(engine.groups), "collectives": sorted(engine.collectives)}


def resume(rank, world_size, kind, phases, root, collectives="auto"):
    with llama_in_fp64(kind):
        return _resume(rank, world_size, kind, phases, root, collectives)


def _resume(rank, world_size, kind, phases, root, collectives):
    batches = models.make_batches(STEPS, ACCUM)
    step0, out = 0, None
    for i, (n, stage, nsteps) in enumerate(phases):
        group = _group(n)
        if rank < n:
            # phase > 0 starts from a differently seeded model: only the load can make it right
            engine = _make_engine(kind, stage, group, seed=0 if i == 0 else 7, bucket=BUCKETS[i],
                                  collectives=collectives)
            if i > 0:
                manifest = load_checkpoint(engine, os.path.join(root, f"p{i - 1}"))
                assert manifest["world_size"] == phases[i - 1][0] and manifest["step"] == step0
            _train(engine, rank, n, range(step0, step0 + nsteps), batches)
            if i < len(phases) - 1:
                save_checkpoint(engine, os.path.join(root, f"p{i}"), step=step0 + nsteps)
            else:
                out = _collect(engine)
            engine.close()
        dist.barrier()
        step0 += nsteps
    return out


def save_failure(rank, world_size, root):
    """A save that fails on rank 1 (its second safetensors write raises) must raise on every rank and leave
    the first save loadable."""
    import safetensors.torch as st
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import CheckpointError, load_checkpoint

    n = 2
    out = None
    if rank < n:
        group = _group(n)
        model = models.make_model("gpt2").double()
        engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=2, reduce_bucket_size=8192),
                             process_group=group)
        batches = models.make_batches(STEPS, ACCUM)
        real, calls = st.save_file, [0]

        def flaky(*args, **kwargs):
            calls[0] += 1
            if rank == 1 and calls[0] == 2:
                raise OSError(28, "No space left on device (injected)")
            return real(*args, **kwargs)

        st.save_file = flaky
        try:
            _train(engine, rank, n, range(0, 1), batches)
            path = os.path.join(root, "ckpt")
            save_checkpoint(engine, path, step=1)
            after_first = engine.full_state_dict()
            _train(engine, rank, n, range(1, 2), batches)
            moved = engine.full_state_dict()
            err = None
            try:
                save_checkpoint(engine, path, step=2)
            except CheckpointError as exc:
                err = str(exc)
        finally:
            st.save_file = real
        dist.barrier(group=group)
        leftovers = sorted(os.listdir(root))
        fresh_model = models.make_model("gpt2", seed=7).double()
        fresh = shard_model(fresh_model, models.make_optimizer(fresh_model), ZeroConfig(stage=1),
                            process_group=group)
        manifest = load_checkpoint(fresh, path)
        loaded = fresh.full_state_dict()
        out = {"error": err, "calls": calls[0], "leftovers": leftovers, "step": manifest["step"]}
        if rank == 0:
            out["equal_first"] = all(torch.equal(loaded[k], after_first[k]) for k in after_first)
            out["moved"] = any(not torch.equal(moved[k], after_first[k]) for k in after_first)
        engine.close()
        fresh.close()
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------------ reference
@functools.lru_cache(maxsize=None)
def reference(kind):
    """Plain single-process fp64 training over the full global micro-batches, all STEPS at once."""
    torch.set_num_threads(1)
    model = models.make_model(kind).double()
    opt = models.make_optimizer(model)
    batches = models.make_batches(STEPS, ACCUM)
    with llama_in_fp64(kind):
        for step in range(STEPS):
            for mb in batches[step]:
                (lm_loss(model, mb) / ACCUM).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state = {names[id(p)]: {k: v.detach().clone() for k, v in st.items()} for p, st in opt.state.items()}
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "opt": opt_state,
            "numel": {n: p.numel() for n, p in model.named_parameters()}}


def assemble_optimizer_state(ranks, numel):
    """Per parameter name: full flat exp_avg / exp_avg_sq and the step, from every rank's segments; every
    element must be covered."""
    full, covered, steps = {}, {}, {}
    for res in ranks:
        if res is None:
            continue
        for name, start, state in res["segments"]:
            for k, v in state.items():
                if v.dim() == 0:
                    steps.setdefault(name, set()).add(float(v))
                    continue
                buf = full.setdefault(name, {}).setdefault(k, torch.full((numel[name],), float("nan"),
                                                                          dtype=v.dtype))
                buf[start:start + v.numel()] = v.reshape(-1)
                covered.setdefault((name, k), torch.zeros(numel[name], dtype=torch.bool))[start:start + v.numel()] = True
    for (name, k), mask in covered.items():
        assert mask.all(), f"{name}.{k}: {int((~mask).sum())} elements not held by any rank"
    return full, steps


# ------------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def dist_results(root):
    def scenarios_for(world_size):
        assert world_size == WORLD
        sc = []
        for name, kind, phases in RESUMES:
            os.makedirs(os.path.join(root, name), exist_ok=True)
            sc.append((name, resume, dict(kind=kind, phases=phases, root=os.path.join(root, name),
                                          collectives="flat" if name in FLAT else "auto")))
        os.makedirs(os.path.join(root, "fail"), exist_ok=True)
        sc.append(("save-failure", save_failure, dict(root=os.path.join(root, "fail"))))
        return sc

    return DistResults(scenarios_for)


def _max_err(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("name,kind,phases", RESUMES, ids=[r[0] for r in RESUMES])
def test_resume_equals_uninterrupted(dist_results, name, kind, phases):
    ranks = dist_results(WORLD, name)
    assert ranks[0]["collectives"] == ["flat" if name in FLAT else "chunked"]
    n_last = phases[-1][0]
    assert all(r is None for r in ranks[n_last:])
    ref = reference(kind)
    got = ranks[0]["state"]
    assert set(got) == set(ref["state"])
    bad = {k: _max_err(got[k], ref["state"][k]) for k in ref["state"]
           if got[k].dtype != ref["state"][k].dtype or not torch.allclose(got[k], ref["state"][k], RTOL, ATOL)}
    assert not bad, f"{name}: parameters differ from the uninterrupted run (max abs err): {bad}"
    full, steps = assemble_optimizer_state(ranks[:n_last], ref["numel"])
    assert set(full) == set(ref["opt"]), "optimizer state for other parameters than the reference"
    for pname, st in ref["opt"].items():
        assert steps[pname] == {float(st["step"])}, f"{pname}: step {steps[pname]} != {float(st['step'])}"
        for k in ("exp_avg", "exp_avg_sq"):
            want = st[k].reshape(-1)
            assert torch.allclose(full[pname][k], want, RTOL, ATOL), \
                f"{name}: {pname}.{k} differs (max abs err {_max_err(full[pname][k], want):.3g})"
    if phases[-1][1] < 3:
        assert ranks[0]["num_groups"] > 6, "the bucket size should split the model into several flat groups"


def test_failed_save_leaves_previous_checkpoint(dist_results):
    r0, r1 = dist_results(WORLD, "save-failure")[:2]
    for r in (r0, r1):  # every rank hears of rank 1's failure, none renames a partial folder into place
        assert r["error"] is not None and "rank 1" in r["error"] and "No space left" in r["error"], r["error"]
        assert r["leftovers"] == ["ckpt"], f"temporary folders left behind: {r['leftovers']}"
        assert r["step"] == 1
    assert r0["moved"], "the second step did not change the weights: the test would not see a partial save"
    assert r0["equal_first"], "the checkpoint after the failed save is not the first save"


def test_llama_noise_at_world_size_3():
    """Why the Llama runs need llama_in_fp64: in one process, without hf_zero, summing the gradients of k local
    mean losses and dividing by k afterwards (what data parallelism does) equals the full-batch gradient for k = 2
    and 4 but not for k = 3, unless RMSNorm and softmax stay in fp64."""
    torch.manual_seed(0)
    mb = models.make_batches(1, 1)[0][0]

    def grads(k, fp64):
        model = models.make_model("llama").double()
        with llama_in_fp64("llama") if fp64 else contextlib.nullcontext():
            n = mb.shape[0] // k
            for c in range(k):
                lm_loss(model, mb[c * n:(c + 1) * n]).backward()
        return {name: p.grad / k for name, p in model.named_parameters()}

    def err(a, b):
        return max(_max_err(a[name], b[name]) for name in a)

    for fp64 in (False, True):
        full = grads(1, fp64)
        assert err(grads(2, fp64), full) < 1e-14 and err(grads(4, fp64), full) < 1e-14
        if fp64:
            assert err(grads(3, fp64), full) < 1e-14
        else:
            assert err(grads(3, fp64), full) > 1e-9, "HF Llama no longer computes RMSNorm / softmax in fp32?"


# ------------------------------------------------------------------------------------------------ damaged checkpoints
@pytest.fixture(scope="module")
def saved_w2(dist_results, root, tmp_path_factory):
    """A GPT-2 checkpoint saved at world size 2 (phase 0 of 2to3-s3), copied per test."""
    dist_results(WORLD, "2to3-s3")
    return os.path.join(root, "2to3-s3", "p0")


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _engine_1proc(kind="gpt2"):
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model(kind).double()
    return shard_model(model, models.make_optimizer(model), ZeroConfig(stage=1))


def _load_error(path, kind="gpt2"):
    from hf_zero.checkpoint import CheckpointError

    engine = _engine_1proc(kind)
    try:
        with pytest.raises(CheckpointError) as load_err:
            load_checkpoint(engine, str(path))
    finally:
        engine.close()
    with pytest.raises(CheckpointError) as export_err:
        export_pretrained(str(path), str(path) + "-export", progress=False)
    assert not os.path.exists(str(path) + "-export"), "a failed export left an output folder"
    return str(load_err.value), str(export_err.value)


def test_damaged_checkpoints_give_clear_errors(saved_w2, tmp_path):
    # intact: loads at world size 1 (the baseline for the cases below)
    engine = _engine_1proc()
    assert load_checkpoint(engine, saved_w2)["world_size"] == 2
    engine.close()
    rank1 = "rank00001-of-00002.safetensors"

    ckpt = _copy(saved_w2, tmp_path / "trunc")
    data = (ckpt / rank1).read_bytes()
    (ckpt / rank1).write_bytes(data[: len(data) // 2])
    for msg in _load_error(ckpt):
        assert rank1 in msg and "truncated" in msg, msg

    ckpt = _copy(saved_w2, tmp_path / "flip")
    data = bytearray((ckpt / rank1).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / rank1).write_bytes(bytes(data))
    for msg in _load_error(ckpt):
        assert rank1 in msg and "checksum mismatch" in msg, msg

    ckpt = _copy(saved_w2, tmp_path / "missing")
    (ckpt / rank1).unlink()
    for msg in _load_error(ckpt):
        assert rank1 in msg and "missing" in msg and "2 ranks" in msg, msg

    ckpt = _copy(saved_w2, tmp_path / "pickle")
    torch.save({"g0.values": torch.zeros(3)}, ckpt / rank1)
    for msg in _load_error(ckpt):
        assert rank1 in msg and "pickle" in msg and "never" in msg, msg

    for msg in _load_error(tmp_path / "nothing-here"):
        assert "does not exist" in msg, msg
    (tmp_path / "empty").mkdir()
    for msg in _load_error(tmp_path / "empty"):
        assert "manifest.json is missing" in msg, msg


def test_checkpoint_of_another_model_is_refused(saved_w2):
    from hf_zero.checkpoint import CheckpointError

    engine = _engine_1proc("llama")
    try:
        with pytest.raises(CheckpointError, match="saved from another model.*GPT2LMHeadModel.*LlamaForCausalLM"):
            load_checkpoint(engine, saved_w2)
    finally:
        engine.close()


def test_manifest_records_layout_and_no_pickle(saved_w2):
    from hf_zero.checkpoint import read_manifest

    m = read_manifest(saved_w2)
    assert m["format_version"] == 3 and m["world_size"] == 2 and m["partitions"] == 2
    rank_files = [f"rank0000{r}-of-00002.safetensors" for r in (0, 1)]
    assert sorted(m["files"]) == sorted(m["file_bytes"]) == ["buffers.safetensors", *rank_files]
    # one shared disk: each file written once, by one rank
    assert len(m["disks"]) == 1 and sorted(m["disks"][0]["ranks"]) == [0, 1]
    assert {f: [r for _, r in w] for f, w in m["writers"].items()} == {
        "buffers.safetensors": [0], rank_files[0]: [0], rank_files[1]: [1]}
    model = models.make_model("gpt2")
    assert m["model"]["state_dict_keys"] == list(model.state_dict())
    assert m["model"]["class"] == "GPT2LMHeadModel" and m["model"]["dtype"] == "float64"
    assert any("lm_head.weight" in p for p in m["model"]["tied_weight_patterns"])
    assert sorted(os.listdir(saved_w2)) == sorted(["config.json", "generation_config.json", "manifest.json",
                                                   *m["files"]])
    for f in m["files"]:
        with open(os.path.join(saved_w2, f), "rb") as fh:
            assert not fh.read(4).startswith((b"PK", b"\x80"))


# ------------------------------------------------------------------------------------------------ older formats
def _to_format_2(src, dst):
    """Rewrite a format-3 checkpoint as format 2 wrote it: rank files named by rank (the same names when
    partitions == world size), the persistent buffers in rank 0's file under "buffer.<name>", no buffers file
    and none of format 3's manifest keys."""
    from safetensors.torch import load_file, save_file

    from hf_zero.checkpoint.source import sha256 as _sha256

    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    assert m["partitions"] == m["world_size"]
    buffers = load_file(dst / "buffers.safetensors")
    (dst / "buffers.safetensors").unlink()
    rank0 = dst / f"rank00000-of-{m['world_size']:05d}.safetensors"
    tensors = load_file(rank0)
    tensors.update({f"buffer.{k}": v for k, v in buffers.items()})
    save_file(tensors, rank0, metadata={"format": "hf_zero-sharded"})
    for key in ("partitions", "save_id", "buffers_file", "writers", "disks", "file_copies_sha256"):
        m.pop(key)
    names = [f"rank{r:05d}-of-{m['world_size']:05d}.safetensors" for r in range(m["world_size"])]
    m.update(format_version=2, files={n: _sha256(dst / n) for n in names},
             file_bytes={n: (dst / n).stat().st_size for n in names})
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _to_format_1(src, dst):
    """Format 1: no state-dict layout (so no buffers), no file list or sizes, no recorded optimizer-state keys."""
    dst = _to_format_2(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    for key in ("model", "files", "file_bytes"):
        m.pop(key)
    for g in m["groups"]:
        g.pop("state_keys"), g.pop("scalar_keys")
    m["format_version"] = 1
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _loaded(path):
    engine = _engine_1proc()
    manifest = load_checkpoint(engine, str(path))
    state = engine.full_state_dict()
    opt = {seg.slot.name: {k: v.clone() for k, v in engine.optimizer.state[seg.tensor].items()}
           for seg in engine.optimizer.segments}
    engine.close()
    return manifest, state, opt


def test_loads_format_2_and_1_checkpoints(saved_w2, tmp_path):
    from hf_zero.checkpoint import CheckpointError

    _, want, want_opt = _loaded(saved_w2)
    v2 = _to_format_2(saved_w2, tmp_path / "v2")
    v1 = _to_format_1(saved_w2, tmp_path / "v1")
    for path, version in ((v2, 2), (v1, 1)):
        manifest, state, opt = _loaded(path)
        assert manifest["format_version"] == version
        assert all(torch.equal(state[k], want[k]) for k in want), f"format {version}: weights differ"
        assert opt.keys() == want_opt.keys() and all(
            torch.equal(opt[n][k], want_opt[n][k]) for n in want_opt for k in want_opt[n]), f"format {version}"
    export_pretrained(str(saved_w2), str(tmp_path / "e3"), progress=False)
    export_pretrained(str(v2), str(tmp_path / "e2"), progress=False)
    for f in os.listdir(tmp_path / "e3"):
        assert (tmp_path / "e3" / f).read_bytes() == (tmp_path / "e2" / f).read_bytes(), f
    with pytest.raises(CheckpointError, match="without the model's state-dict layout"):
        export_pretrained(str(v1), str(tmp_path / "e1"), progress=False)


def test_format_2_buffers_come_from_rank_0_file(tmp_path):
    from hf_zero import ZeroConfig, shard_model

    def engine_with_buffer():
        model = models.make_model("gpt2").double()
        model.transformer.register_buffer("hfz_scale", torch.linspace(0.5, 1.5, 7).double())
        return shard_model(model, models.make_optimizer(model), ZeroConfig(stage=1))

    engine = engine_with_buffer()
    with torch.no_grad():
        engine.model.transformer.hfz_scale.mul_(3)
    save_checkpoint(engine, str(tmp_path / "ckpt"))
    engine.close()
    v2 = _to_format_2(tmp_path / "ckpt", tmp_path / "v2")
    engine = engine_with_buffer()
    load_checkpoint(engine, str(v2))
    assert torch.equal(engine.model.transformer.hfz_scale, torch.linspace(0.5, 1.5, 7).double() * 3)
    engine.close()
