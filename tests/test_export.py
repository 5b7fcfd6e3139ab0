"""Consolidated export == save_pretrained.

For tiny GPT-2 (tied lm_head, plus test-only persistent and non-persistent buffers) and tiny Llama (untied), stages
1-3 and world sizes 1-4 (one spawn of 4 workers; world size N runs on the sub-group of ranks 0..N-1), an engine
trains one step, then exports online (`export_pretrained(engine, ...)`) and saves a sharded checkpoint. Here:
- the reference is `save_pretrained` of a fresh model holding `engine.full_state_dict()`: the export has the same
  files, byte for byte (tensor names, dtypes, values, the shard layout and the index), and equal configs; both load
  with from_pretrained and give the same logits;
- `hf-zero consolidate` of the checkpoint (offline) writes the same bytes as the online export;
- a ~170 MB model exported with max_shard_size=20MB holds what docs/checkpoints.md promises: one output file plus one
  tensor (offline) or one flat group (online, stage 3 on 2 ranks), counted as the tensor bytes and Python heap the
  export itself allocates (`NewTensorBytes`, tracemalloc), never the model.
"""
from __future__ import annotations

import gc
import json
import os
import tracemalloc
import weakref

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import models
from _dist import DistResults
from _flat_layout import layout
from hf_zero.checkpoint import export_pretrained, save_checkpoint

WORLD = 4
SMALL = "20KB"  # tiny models: ~52 KB (GPT-2) / ~178 KB (Llama) of weights -> 3 / 9 files
# (name, kind, variant, stage, world size, max_shard_size, mixed_precision)
COMBOS = [
    ("gpt2-s1-w1", "gpt2", "full", 1, 1, SMALL, "no"),
    ("gpt2-s2-w2", "gpt2", "full", 2, 2, "5GB", "no"),
    ("gpt2-s3-w3", "gpt2", "full", 3, 3, SMALL, "no"),
    ("gpt2-s3-w4-frozen", "gpt2", "frozen_emb", 3, 4, SMALL, "no"),
    ("llama-s1-w4", "llama", "full", 1, 4, SMALL, "no"),
    ("llama-s2-w3-bf16", "llama", "full", 2, 3, SMALL, "bf16"),
    ("llama-s3-w2", "llama", "full", 3, 2, "5GB", "no"),
    ("llama-s3-w1", "llama", "full", 3, 1, SMALL, "no"),
]
BF16_EXPORT = "gpt2-s3-w3"  # also exported online with dtype=bf16


def add_buffers(model, kind):
    """GPT-2 gets persistent buffers (float and int, which save_pretrained writes) and a non-persistent one (which
    it does not); neither model has persistent buffers of its own."""
    if kind == "gpt2":
        model.transformer.register_buffer("hfz_scale", torch.linspace(0.5, 1.5, 7))
        model.transformer.h[1].register_buffer("hfz_count", torch.tensor([3, 1, 4], dtype=torch.int64))
        model.transformer.register_buffer("hfz_cache", torch.ones(5), persistent=False)
    return model


# ------------------------------------------------------------------------------------------------ worker side
_GROUPS: dict = {}


def _group(n):
    if not _GROUPS:
        world = dist.get_world_size()
        for k in range(1, world):
            _GROUPS[k] = dist.new_group(list(range(k)))
        _GROUPS[world] = None
    return _GROUPS[n]


def export_scenario(rank, world_size, name, kind, variant, stage, n, shard_size, mp, root):
    from hf_zero import ZeroConfig, shard_model


    group = _group(n)
    out = None
    if rank < n:
        model = add_buffers(models.make_model(kind, variant), kind)
        engine = shard_model(model, models.make_optimizer(model),
                             ZeroConfig(stage=stage, mixed_precision=mp, reduce_bucket_size=4096), process_group=group)
        x = models.rank_slice(models.make_batches(1, 1)[0][0], rank, n)
        engine.backward(engine.model(input_ids=x, labels=x).loss)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        with torch.no_grad():  # buffers change during training too
            if kind == "gpt2":
                engine.model.transformer.hfz_scale.mul_(2.0)
        base = os.path.join(root, name)
        sd = engine.full_state_dict()
        path = export_pretrained(engine, os.path.join(base, "online"), max_shard_size=shard_size, progress=False)
        if name == BF16_EXPORT:
            export_pretrained(engine, os.path.join(base, "online-bf16"), max_shard_size=shard_size, dtype="bf16",
                              progress=False)
        save_checkpoint(engine, os.path.join(base, "ckpt"), step=1)
        out = {"state": {k: v.clone() for k, v in sd.items()} if sd else None, "path": str(path),
               "largest_group": max(g.plan.padded_numel for g in engine.groups)}
        engine.close()
    dist.barrier()
    return out


def export_failure(rank, world_size, root):
    """Stage 3 at world size 2: rank 0's second output file fails to write while rank 1 keeps gathering; both
    ranks raise, the earlier export in the folder is untouched, and the engine can export again."""
    import safetensors.torch as st
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import CheckpointError

    n, out = 2, None
    if rank < n:
        model = models.make_model("gpt2")
        engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3), process_group=_group(n))
        target = os.path.join(root, "export-failure", "out")
        export_pretrained(engine, target, max_shard_size=SMALL, progress=False)
        before = {f: open(os.path.join(target, f), "rb").read() for f in os.listdir(target)}
        x = models.rank_slice(models.make_batches(1, 1)[0][0], rank, n)
        engine.backward(engine.model(input_ids=x, labels=x).loss)
        engine.optimizer.step()
        real, calls = st.save_file, [0]

        def flaky(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(28, "No space left on device (injected)")
            return real(*args, **kwargs)

        st.save_file = flaky if rank == 0 else real
        err = None
        try:
            export_pretrained(engine, target, max_shard_size=SMALL, progress=False)
        except CheckpointError as exc:
            err = str(exc)
        finally:
            st.save_file = real
        after = {f: open(os.path.join(target, f), "rb").read() for f in os.listdir(target)}
        leftovers = sorted(os.listdir(os.path.dirname(target)))
        dist.barrier()  # rank 0 makes the next export's temporary folder before its first collective
        export_pretrained(engine, target, max_shard_size=SMALL, progress=False)  # still in step
        changed = {f: open(os.path.join(target, f), "rb").read() for f in os.listdir(target)} != before
        out = {"error": err, "unchanged": after == before, "leftovers": leftovers, "changed": changed}
        engine.close()
    dist.barrier()
    return out


def big_online_export(rank, world_size, root):
    """The ~170 MB GPT-2 (BIG) at stage 3 over ranks 0 and 1, every group partitioned, exported online: each rank's
    peak of tensor bytes and Python heap the export allocates (`measured`)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from hf_zero import ZeroConfig, shard_model

    n, out = 2, None
    group = _group(n)
    if rank < n:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(GPT2Config(**BIG))
        engine = shard_model(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3), process_group=group)
        _, tensors, heap = measured(lambda: export_pretrained(engine, os.path.join(root, "big-online"),
                                                              max_shard_size=BIG_SHARD, progress=False))
        out = {"tensors": tensors, "heap": heap, "largest_group": max(g.full_bytes for g in engine.groups)}
        engine.close()
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("export"))


@pytest.fixture(scope="module")
def dist_results(root):
    def scenarios_for(world_size):
        os.makedirs(os.path.join(root, "export-failure"), exist_ok=True)
        return [(c[0], export_scenario, dict(name=c[0], kind=c[1], variant=c[2], stage=c[3], n=c[4],
                                             shard_size=c[5], mp=c[6], root=root)) for c in COMBOS] + [
            ("export-failure", export_failure, dict(root=root)), ("big-online", big_online_export, dict(root=root))]

    return DistResults(scenarios_for)


def reference_dir(kind, variant, state, out, shard_size, dtype=None):
    """save_pretrained of a fresh model holding `state` (independent of the export code)."""
    model = add_buffers(models.make_model(kind, variant, seed=3), kind)
    model.load_state_dict(state, strict=True)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out, max_shard_size=shard_size)
    return out


def tensors_of(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def assert_same_as_reference(got_dir, ref_dir):
    got_files, ref_files = sorted(os.listdir(got_dir)), sorted(os.listdir(ref_dir))
    assert got_files == ref_files, f"file sets differ: {got_files} vs {ref_files}"
    for f in ref_files:
        g, r = os.path.join(got_dir, f), os.path.join(ref_dir, f)
        if f.endswith(".safetensors"):
            (gt, gm), (rt, rm) = tensors_of(g), tensors_of(r)
            assert sorted(gt) == sorted(rt), f"{f}: tensor names {sorted(gt)} vs {sorted(rt)}"
            assert gm == rm, f"{f}: metadata {gm} vs {rm}"
            for k in rt:
                assert gt[k].dtype == rt[k].dtype and gt[k].shape == rt[k].shape, f"{f}:{k}: dtype/shape"
                assert torch.equal(gt[k], rt[k]), f"{f}:{k}: values differ"
            assert open(g, "rb").read() == open(r, "rb").read(), f"{f}: same tensors but different bytes"
        elif f.endswith(".json"):
            gj, rj = json.load(open(g)), json.load(open(r))
            assert gj == rj, f"{f} differs:\n{json.dumps(gj, indent=1)}\nvs\n{json.dumps(rj, indent=1)}"
        else:
            raise AssertionError(f"unexpected file {f}")


def assert_same_bytes(a_dir, b_dir):
    a, b = sorted(os.listdir(a_dir)), sorted(os.listdir(b_dir))
    assert a == b, f"file sets differ: {a} vs {b}"
    for f in a:
        assert open(os.path.join(a_dir, f), "rb").read() == open(os.path.join(b_dir, f), "rb").read(), f"{f} differs"


def logits_of(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    model.eval()
    x = models.make_batches(1, 1, seed=99)[0][0][:4]
    with torch.no_grad():
        return model(input_ids=x).logits


def consolidate(*args):
    from hf_zero.cli import main

    assert main(["consolidate", *map(str, args)]) == 0


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("combo", COMBOS, ids=[c[0] for c in COMBOS])
def test_export_equals_save_pretrained(dist_results, root, tmp_path, combo):
    name, kind, variant, stage, n, shard_size, mp = combo
    ranks = dist_results(WORLD, name)
    assert all(r is None for r in ranks[n:]) and all(r["state"] is None for r in ranks[1:n])
    online = os.path.join(root, name, "online")
    ref = reference_dir(kind, variant, ranks[0]["state"], str(tmp_path / "ref"), shard_size)
    assert_same_as_reference(online, ref)
    files = os.listdir(online)
    if shard_size == SMALL:
        assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) >= 3
    else:
        assert "model.safetensors" in files
    keys = set()
    for f in files:
        if f.endswith(".safetensors"):
            keys |= set(tensors_of(os.path.join(online, f))[0])
    if kind == "gpt2":  # tied: written once, under the name Transformers keeps; persistent buffers only
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
        assert {"transformer.hfz_scale", "transformer.h.1.hfz_count"} <= keys and "transformer.hfz_cache" not in keys
    else:
        assert "lm_head.weight" in keys and not any("rotary" in k for k in keys)
    config = json.load(open(os.path.join(online, "config.json")))
    assert config["dtype"] == "float32"  # the trained (master) dtype, also under bf16 mixed precision
    torch.testing.assert_close(logits_of(online), logits_of(ref), rtol=0, atol=0)
    # offline: the same bytes from the shard files alone
    offline = tmp_path / "offline"
    consolidate(os.path.join(root, name, "ckpt"), offline, "--max-shard-size", shard_size)
    assert_same_bytes(online, offline)


def test_export_in_bf16(dist_results, root, tmp_path):
    ranks = dist_results(WORLD, BF16_EXPORT)
    name, kind, variant, _, _, shard_size, _ = next(c for c in COMBOS if c[0] == BF16_EXPORT)
    online = os.path.join(root, name, "online-bf16")
    ref = reference_dir(kind, variant, ranks[0]["state"], str(tmp_path / "ref"), shard_size, dtype=torch.bfloat16)
    assert_same_as_reference(online, ref)
    assert json.load(open(os.path.join(online, "config.json")))["dtype"] == "bfloat16"
    offline = tmp_path / "offline"
    consolidate(os.path.join(root, name, "ckpt"), offline, "--max-shard-size", shard_size, "--dtype", "bf16")
    assert_same_bytes(online, offline)


def test_failed_online_export_leaves_folder_unchanged(dist_results):
    for r in dist_results(WORLD, "export-failure")[:2]:
        assert r["error"] is not None and "rank 0" in r["error"] and "No space left" in r["error"], r["error"]
        assert r["unchanged"], "a failed export changed the folder's files"
        assert r["leftovers"] == ["out"], f"temporary folders left behind: {r['leftovers']}"
        assert r["changed"], "the export after the failure did not write the trained weights"


def test_consolidate_config_tokenizer_and_existing_folder(dist_results, root, tmp_path):
    """--config (a folder, a JSON file, a PretrainedConfig), a tokenizer, and re-exporting into a folder that holds
    a README and an earlier export's shards (the README stays, stale shards go)."""

    from tokenizers import Tokenizer, models as tok_models
    from transformers import GPT2Config, PreTrainedTokenizerFast

    dist_results(WORLD, "gpt2-s1-w1")
    ckpt = os.path.join(root, "gpt2-s1-w1", "ckpt")
    out = tmp_path / "out"
    consolidate(ckpt, out, "--max-shard-size", SMALL)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) == 3
    (out / "README.md").write_text("my model\n")
    cfg = GPT2Config.from_pretrained(os.path.join(root, "gpt2-s1-w1", "online"))
    cfg.summary_first_dropout = 0.25  # any visible change
    cfg_dir = tmp_path / "cfg"
    cfg.save_pretrained(cfg_dir)
    vocab = {f"t{i}": i for i in range(models.VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token="t0")),
                                  unk_token="t0")
    export_pretrained(ckpt, out, model_config=cfg, tokenizer=tok, progress=False)  # one file now
    files = sorted(os.listdir(out))
    assert "README.md" in files and "model.safetensors" in files and "tokenizer.json" in files
    assert not any(f.startswith("model-") or f.endswith("index.json") for f in files), files
    got = json.load(open(out / "config.json"))
    assert got["summary_first_dropout"] == 0.25 and got["architectures"] == ["GPT2LMHeadModel"]
    assert json.load(open(out / "generation_config.json")) == json.load(
        open(os.path.join(root, "gpt2-s1-w1", "online", "generation_config.json")))
    for cfg_arg in (cfg_dir, cfg_dir / "config.json"):
        consolidate(ckpt, tmp_path / "out2", "--config", cfg_arg)
        assert json.load(open(tmp_path / "out2" / "config.json"))["summary_first_dropout"] == 0.25
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p], "temporary folders left behind"


# ------------------------------------------------------------------------------------------------ bounded memory
# 42.4M parameters, 170 MB in fp32: 8x the output file size
BIG = dict(vocab_size=8192, n_positions=256, n_embd=512, n_layer=12, n_head=8, bos_token_id=0, eos_token_id=0)
BIG_SHARD = "20MB"


class NewTensorBytes(TorchDispatchMode):
    """Bytes of tensor storage made inside the block and still alive (`now`), and their `peak`: what the code in
    the block allocated in tensors, whatever else the process holds.

    Not the process's RSS, which this test bounded before and nearly crossed in one run in four: resident pages
    move with the allocator's arenas and free lists, the pages of the files read and written, and the imports, none
    of which the export decides. Not tracemalloc alone: torch's CPU allocator does not report to it (it is used
    beside this for the Python heap). Here every op's outputs pass through the mode; a storage alive when the block
    began (the engine's own tensors, found through the garbage collector) or on meta (the export sizes its files
    with meta tensors) is not counted; any other counts from the op that made it until a weakref finalizer sees it
    freed. Sizes and lifetimes are the program's (CPython frees a storage with its last reference), so the count
    is the same in every run where no other thread holds a tensor (the online export reuses one buffer). Blind
    spots: a tensor made outside the dispatcher and never given to an op, a storage resized outside an op (the
    export reads into torch.empty with readinto and resizes nothing: it sees all of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()  # torch keeps one wrapper per storage
        for obj in gc.get_objects():  # type(), not isinstance: some module proxies warn when asked their class
            if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
                self._known[obj.untyped_storage()] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self._known:
                    self._known[st] = True
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._freed, st.nbytes())
        return out

    def _freed(self, nbytes: int) -> None:
        self.now -= nbytes


def measured(fn):
    """fn() under NewTensorBytes and tracemalloc: (its result, peak tensor bytes, peak Python heap bytes)."""
    live = NewTensorBytes()
    tracemalloc.start()
    try:
        with live:
            out = fn()
        heap = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, live.peak, heap


def largest_file_bytes(folder) -> int:
    """The tensor bytes of the largest .safetensors file in `folder`: its size less the 8-byte length and the
    header (the safetensors format)."""
    sizes = []
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            path = os.path.join(folder, f)
            with open(path, "rb") as fh:
                header = int.from_bytes(fh.read(8), "little")
            sizes.append(os.path.getsize(path) - 8 - header)
    return max(sizes)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """BIG's save_pretrained (max_shard_size 20MB: the reference files) and a checkpoint of it saved by a
    one-process stage-1 engine, with the sizes the docs' promise is made of (counted from the model)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from hf_zero import ZeroConfig, shard_model

    folder = tmp_path_factory.mktemp("big")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(**BIG))
    # save_pretrained before sharding: at stages 0-2 the parameters become views of flat buffers, and
    # save_pretrained would size the tied embedding by its whole buffer in the index
    model.save_pretrained(folder / "ref", max_shard_size=BIG_SHARD)
    sizes = {"model": sum(p.numel() * 4 for p in model.parameters()),
             "tensor": max(p.numel() * 4 for p in model.parameters()),
             # stage 3 over 2 ranks: one flat group per unit (the root's, with the embeddings, is the largest)
             "group": sorted(g.padded * 4 for g in layout(model, 2))[-1],
             "group2": sorted(g.padded * 4 for g in layout(model, 2))[-2],
             "file": largest_file_bytes(folder / "ref")}
    engine = shard_model(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=1))
    save_checkpoint(engine, folder / "ckpt")
    engine.close()
    return {"ref": folder / "ref", "ckpt": folder / "ckpt", **sizes}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def test_offline_export_memory_is_bounded(big, tmp_path, capsys):
    """hf-zero consolidate of BIG's checkpoint: one output file plus one tensor at most (the docs' promise),
    at least the largest file (the counter sees the export), and the same bytes as save_pretrained."""
    out = tmp_path / "big-out"
    _, tensors, heap = measured(lambda: consolidate(big["ckpt"], out, "--max-shard-size", BIG_SHARD))
    outputs = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    with capsys.disabled():
        print(f"\n[memory] offline: model {_mib(big['model'])} in {len(outputs)} files, largest "
              f"{_mib(big['file'])}; largest tensor {_mib(big['tensor'])}; the export allocated {_mib(tensors)} "
              f"of tensors and {_mib(heap)} of Python heap at their peaks")
    assert len(outputs) >= 8
    assert tensors >= big["file"], "the counter did not see the output file the export held"
    assert tensors + heap <= big["file"] + big["tensor"], (
        f"offline export: {_mib(tensors)} of tensors + {_mib(heap)} of Python heap, more than one output file "
        f"({_mib(big['file'])}) + one tensor ({_mib(big['tensor'])})")
    assert_same_bytes(out, big["ref"])


SLACK = 64 * 2**10  # scalars and small temporaries of the collectives: far below a flat group here (12 MiB, 16.5 MiB)


def test_online_export_memory_is_bounded(dist_results, big, root, capsys):
    """export_pretrained(engine) of BIG at stage 3 over 2 gloo ranks: rank 0 holds one output file plus one
    gathered flat group, rank 1 (which writes nothing) one group, never the model; the files are save_pretrained's
    bytes (every rank starts from rank 0's seed-0 weights, the reference's).

    The groups are gathered into one reused buffer the size of the largest (engine/state.py): a dropped group
    can live on for a moment in gloo's worker thread after wait() returned, and the export once allocated the next
    group meanwhile (rank 1 measured 28.5 MiB in one run of three: two groups)."""
    writer, other = dist_results(WORLD, "big-online")[:2]
    with capsys.disabled():
        print(f"\n[memory] online, stage 3 on 2 ranks: largest file {_mib(big['file'])}, groups {_mib(big['group'])} "
              f"and {_mib(big['group2'])}; rank 0 allocated {_mib(writer['tensors'])} of tensors and "
              f"{_mib(writer['heap'])} of Python heap, rank 1 {_mib(other['tensors'])} and {_mib(other['heap'])}")
    assert writer["largest_group"] == big["group"]
    assert other["tensors"] >= big["group"], "the counter did not see rank 1 gather the largest group"
    # besides the group, the collectives' own scalars (8 bytes seen in one run): SLACK is far below any group
    assert other["tensors"] <= big["group"] + SLACK, (
        f"rank 1 (gathers only) allocated {other['tensors']} B of tensors, more than one group "
        f"({big['group']} B) + {SLACK} B")
    assert writer["tensors"] >= big["file"], "the counter did not see the output file rank 0 held"
    assert writer["tensors"] <= big["file"] + big["group"] + SLACK, (
        f"online export: {writer['tensors']} B of tensors on rank 0, more than one output file "
        f"({big['file']} B) + one group ({big['group']} B) + {SLACK} B")
    # the data is in tensors; the Python heap is the loop's objects and the index (0.2-0.4 MiB measured)
    assert writer["heap"] < 2**20 and other["heap"] < 2**20, (writer["heap"], other["heap"])
    assert_same_bytes(os.path.join(root, "big-online"), big["ref"])
