"""Checkpoints on disks the hosts do not share, simulated on one machine: the ranks of each "host" save to and
resume from a folder of their own (`root/hostA/ckpt`, `root/hostB/ckpt`), so nothing may assume that one path
names one folder for every rank.

World sizes 2 and 4 (gloo, one spawn each). Checked:
- each host's folder holds the partition files of its ranks, the manifest, the buffers and the config, nothing of
  the other host, and no temporary folder is left beside it; on a shared disk each file is written once;
- resuming from the per-host folders continues exactly as plain single-process training (fp64, as in
  tests/test_checkpoint.py), and the persistent buffers come back as rank 0 saved them, on every host;
- HSDP (shard_group_size=2): partitions, not ranks, name the files; each host writes the partitions its ranks
  hold, a shared disk gets one copy of each;
- a file missing on host B makes the resume raise CheckpointError on every rank, naming host, rank and file;
- a save that fails on host B (a write, or the rename) leaves the previous checkpoint on both hosts;
- `hf-zero consolidate hostA/ckpt hostB/ckpt out` writes what the online export and save_pretrained write.
The same through `accelerate launch`-style two-node launches (torchrun --nnodes 2 on this machine): Accelerate's
save_state / load_state and the Trainer with and without save_on_each_node (slow).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import models
import test_checkpoint as base
import test_export as ex
from _dist import DistResults
from hf_zero.checkpoint import CheckpointError, export_pretrained, load_checkpoint, read_manifest, save_checkpoint
from hf_zero.checkpoint.hosts import disk_groups, partition_writers

STEPS, ACCUM, SAVE_AT = base.STEPS, base.ACCUM, 2
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = ("config.json", "generation_config.json")

# (name, world size, host of each rank or None for one shared disk, stage, extra ZeroConfig options)
RUNS = [
    ("w2-s1", 2, "AB", 1, {}),
    ("w2-s0", 2, "AB", 0, {}),
    ("w4-s2", 4, "AABB", 2, {}),
    ("w4-s3-uneven", 4, "ABBB", 3, {}),
    ("w4-hsdp-s3", 4, "AABB", 3, {"shard_group_size": 2}),
    ("w4-shared-s2", 4, None, 2, {}),
    ("w4-shared-hsdp-s2", 4, None, 2, {"shard_group_size": 2}),
    ("w4-shared-s0", 4, None, 0, {}),
]
EXPORTED = "w4-s2"  # also exported online before its save, for the consolidate test


# ------------------------------------------------------------------------------------------------ worker side
def _folder(root, hosts, rank):
    return os.path.join(root, f"host{hosts[rank]}" if hosts else "shared", "ckpt")


def _engine(stage, options, seed):
    from hf_zero import ZeroConfig, shard_model

    model = ex.add_buffers(models.make_model("gpt2", seed=seed), "gpt2").double()
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=8192, allgather_bucket_size=8192, **options)
    return shard_model(model, models.make_optimizer(model), cfg)


class _CountWrites:
    """Counts this rank's safetensors.torch.save_file calls (the partition files) while active."""

    def __init__(self):
        import safetensors.torch as st

        self.st, self.real, self.calls = st, st.save_file, 0

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        self.st.save_file = counting
        return self

    def __exit__(self, *exc):
        self.st.save_file = self.real


def run(rank, world_size, name, hosts, stage, options, root):
    """Train SAVE_AT steps, save (each host to its own folder), resume in a differently seeded engine from the
    same folder, train to STEPS; report what each host's disk holds and the final state."""
    batches = models.make_batches(STEPS, ACCUM)
    ckpt = _folder(root, hosts, rank)
    engine = _engine(stage, options, seed=0)
    base._train(engine, rank, world_size, range(SAVE_AT), batches)
    with torch.no_grad():  # a buffer that differs per rank: the checkpoint keeps rank 0's, on every disk
        engine.model.transformer.hfz_scale.mul_(rank + 2)
    if name == EXPORTED:
        export_pretrained(engine, os.path.join(root, "online"), progress=False)
        sd = engine.full_state_dict()
        if rank == 0:
            torch.save(sd, os.path.join(root, "online-state.pt"))
    with _CountWrites() as writes:
        save_checkpoint(engine, ckpt, step=SAVE_AT)
    dist.barrier()
    parent = sorted(os.listdir(os.path.dirname(ckpt)))
    files = sorted(os.listdir(ckpt))
    engine.close()
    fresh = _engine(stage, options, seed=7)
    manifest = load_checkpoint(fresh, ckpt)
    buffer = fresh.model.transformer.hfz_scale.detach().clone()
    base._train(fresh, rank, world_size, range(SAVE_AT, STEPS), batches)
    out = base._collect(fresh)
    fresh.close()
    return {"result": out, "parent": parent, "files": files, "manifest": manifest, "writes": writes.calls,
            "buffer": buffer, "partition": getattr(fresh, "partition_comm", fresh.comm).rank}


def missing_file(rank, world_size, root):
    """Host B lost rank 3's file: every rank's resume raises, none hangs. Then host B's folder holds another
    save than host A's: every rank raises too."""
    hosts = "AABB"
    ckpt = _folder(root, hosts, rank)
    engine = _engine(2, {}, seed=0)
    base._train(engine, rank, world_size, range(1), models.make_batches(STEPS, ACCUM))
    save_checkpoint(engine, ckpt, step=1)
    dist.barrier()
    if rank == 2:
        os.remove(os.path.join(ckpt, "rank00003-of-00004.safetensors"))
    dist.barrier()
    start, error = time.monotonic(), None
    try:
        load_checkpoint(engine, ckpt)
    except CheckpointError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    # host B's folder now holds a later save than host A's: the ranks must not mix them
    save_checkpoint(engine, ckpt + "-later", step=2)
    dist.barrier()
    if rank == 2:
        shutil.rmtree(ckpt)
        os.replace(ckpt + "-later", ckpt)
    dist.barrier()
    mixed = None
    try:
        load_checkpoint(engine, ckpt)
    except CheckpointError as exc:
        mixed = str(exc)
    engine.close()
    return {"error": error, "seconds": seconds, "host": socket.gethostname(), "folder": ckpt, "mixed": mixed}


def save_failures(rank, world_size, root):
    """A save that fails on host B, once writing rank 3's file and once renaming host B's folder into place: every
    rank raises, and both hosts keep the first checkpoint (host A undoes its rename)."""
    import safetensors.torch as st

    import hf_zero.checkpoint.sharded as sharded

    hosts = "AABB"
    ckpt = _folder(root, hosts, rank)
    engine = _engine(2, {}, seed=0)
    batches = models.make_batches(STEPS, ACCUM)
    base._train(engine, rank, world_size, range(1), batches)
    save_checkpoint(engine, ckpt, step=1)
    base._train(engine, rank, world_size, range(1, 2), batches)
    errors = []
    real_save, real_swap = st.save_file, sharded.swap

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    def no_rename(tmp, directory):
        raise OSError(13, "Permission denied (injected)")

    for what, patch in (("write", lambda: setattr(st, "save_file", no_space if rank == 3 else real_save)),
                        ("rename", lambda: setattr(sharded, "swap", no_rename if rank == 2 else real_swap))):
        patch()
        try:
            save_checkpoint(engine, ckpt, step=2)
            errors.append((what, None))
        except CheckpointError as exc:
            errors.append((what, str(exc)))
        finally:
            st.save_file, sharded.swap = real_save, real_swap
        dist.barrier()
    out = {"errors": errors, "parent": sorted(os.listdir(os.path.dirname(ckpt))),
           "step": read_manifest(ckpt)["step"], "files": sorted(os.listdir(ckpt))}
    engine.close()
    return out


def scenarios_for(root):
    def make(world_size):
        sc = [(name, run, dict(name=name, hosts=hosts, stage=stage, options=options, root=os.path.join(root, name)))
              for name, n, hosts, stage, options in RUNS if n == world_size]
        if world_size == 4:
            sc += [("missing", missing_file, dict(root=os.path.join(root, "missing"))),
                   ("failures", save_failures, dict(root=os.path.join(root, "failures")))]
        return sc

    return make


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nodelocal"))


@pytest.fixture(scope="module")
def dist_results(root):
    return DistResults(scenarios_for(root))


def _partitions(n, options, stage):
    return 1 if stage == 0 else options.get("shard_group_size", n)


def _rank_file(p, count):
    return f"rank{p:05d}-of-{count:05d}.safetensors"


def assert_matches_reference(ranks, name):
    """The resumed run equals plain single-process training over all STEPS (parameters and AdamW state)."""
    ref = base.reference("gpt2")
    got = ranks[0]["result"]["state"]
    bad = {k: base._max_err(got[k], v) for k, v in ref["state"].items()
           if got[k].dtype != v.dtype or not torch.allclose(got[k], v, base.RTOL, base.ATOL)}
    assert not bad, f"{name}: parameters differ from the uninterrupted run (max abs err): {bad}"
    full, steps = base.assemble_optimizer_state([r["result"] for r in ranks], ref["numel"])
    for pname, st in ref["opt"].items():
        assert steps[pname] == {float(st["step"])}, f"{name}: {pname}: step {steps[pname]}"
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(full[pname][k], st[k].reshape(-1), base.RTOL, base.ATOL), f"{name}: {pname}.{k}"


# ------------------------------------------------------------------------------------------------ tests
def test_disks_and_writers():
    """The pure parts: disks from what each rank saw, and one writer per (disk, partition)."""
    assert disk_groups([[0, 1, 2, 3]] * 4) == [[0, 1, 2, 3]]
    assert disk_groups([[0, 1], [0, 1], [2, 3], [2, 3]]) == [[0, 1], [2, 3]]
    assert disk_groups([[0, 1], [1], [2], [3]]) is None  # rank 0 sees rank 1's marker, rank 1 not rank 0's
    assert disk_groups([[1], [1]]) is None  # rank 0 does not see its own marker
    # plain: partition = rank
    assert partition_writers([[0, 1, 2, 3]], [0, 1, 2, 3]) == {0, 1, 2, 3}
    # HSDP 2 x 2: a shared disk gets one replica of each partition, node-local disks both
    assert partition_writers([[0, 1, 2, 3]], [0, 1, 0, 1]) == {0, 1}
    assert partition_writers([[0, 1], [2, 3]], [0, 1, 0, 1]) == {0, 1, 2, 3}
    # stage 0: one partition, written once per disk
    assert partition_writers([[0, 1, 2, 3]], [0, 0, 0, 0]) == {0}
    assert partition_writers([[0], [1, 2, 3]], [0, 0, 0, 0]) == {0, 1}


@pytest.mark.parametrize("name,n,hosts,stage,options", RUNS, ids=[r[0] for r in RUNS])
def test_save_and_resume(dist_results, name, n, hosts, stage, options):
    ranks = dist_results(n, name)
    count = _partitions(n, options, stage)
    every = sorted(_rank_file(p, count) for p in range(count))
    meta = sorted(["manifest.json", "buffers.safetensors", *CONFIGS])
    by_host = {}
    for rank, r in enumerate(ranks):
        by_host.setdefault(hosts[rank] if hosts else "shared", []).append(rank)
    for host, members in by_host.items():
        held = sorted({_rank_file(ranks[m]["partition"] if count > 1 else 0, count) for m in members})
        want = sorted(held + meta)
        for m in members:
            assert ranks[m]["files"] == want, f"{name}: host {host}'s folder holds {ranks[m]['files']}, want {want}"
            assert ranks[m]["parent"] == ["ckpt"], f"{name}: left beside the checkpoint: {ranks[m]['parent']}"
        # one writer per (disk, partition): the host's partition files were each written once
        assert sum(ranks[m]["writes"] for m in members) == len(held), f"{name}: host {host} wrote its files twice"
    m = ranks[0]["manifest"]
    assert m["format_version"] == 3 and m["partitions"] == count and m["world_size"] == n
    assert sorted(m["files"]) == sorted(every + ["buffers.safetensors"])  # the same manifest lists every file
    assert len(m["disks"]) == len(by_host)
    assert all(r["manifest"]["save_id"] == m["save_id"] for r in ranks)
    copies = {f: len(w) for f, w in m["writers"].items()}
    assert copies["buffers.safetensors"] == len(by_host)
    # rank 0's buffer (scaled by 2 before the save), on every rank of every host
    want_buffer = torch.linspace(0.5, 1.5, 7).double() * 2
    assert all(torch.equal(r["buffer"], want_buffer) for r in ranks), [r["buffer"] for r in ranks]
    assert_matches_reference(ranks, name)


def test_hsdp_names_files_by_partition(dist_results):
    """HSDP 2 x 2: two partition files; node-local, both hosts write both; shared, one replica writes them."""
    local = dist_results(4, "w4-hsdp-s3")[0]["manifest"]
    shared = dist_results(4, "w4-shared-hsdp-s2")[0]["manifest"]
    names = [_rank_file(p, 2) for p in range(2)]
    assert {f: [r for _, r in w] for f, w in local["writers"].items() if f in names} == {names[0]: [0, 2],
                                                                                         names[1]: [1, 3]}
    assert {f: [r for _, r in w] for f, w in shared["writers"].items() if f in names} == {names[0]: [0],
                                                                                          names[1]: [1]}


def test_missing_file_fails_on_every_rank(dist_results):
    ranks = dist_results(4, "missing")
    for rank, r in enumerate(ranks):
        msg = r["error"]
        assert msg is not None, f"rank {rank} did not raise"
        for part in ("rank 3", f"host {r['host']}", "rank00003-of-00004.safetensors", ranks[3]["folder"],
                     "is missing", "copy", "hf-zero consolidate"):
            assert part in msg, f"rank {rank}: {part!r} not in {msg}"
        assert r["seconds"] < 60, f"rank {rank} took {r['seconds']:.0f}s to fail: waited for a peer"
        mixed = r["mixed"]
        assert mixed and "read different checkpoints" in mixed and "read step 1" in mixed and "read step 2" in mixed, \
            mixed


def test_failed_save_leaves_previous_checkpoint_on_every_host(dist_results):
    ranks = dist_results(4, "failures")
    for rank, r in enumerate(ranks):
        (w, write_err), (n, rename_err) = r["errors"]
        assert write_err and "rank 3" in write_err and "No space left" in write_err, (rank, write_err)
        assert rename_err and "rank 2" in rename_err and "Permission denied" in rename_err, (rank, rename_err)
        assert "undone" in rename_err, rename_err
        assert r["parent"] == ["ckpt"], f"rank {rank}: left beside the checkpoint: {r['parent']}"
        assert r["step"] == 1, f"rank {rank}: the folder holds step {r['step']}, not the first save"


def _consolidate(*args):
    from hf_zero.cli import main

    return main(["consolidate", *map(str, args)])


def test_consolidate_from_every_hosts_folder(dist_results, root, tmp_path, capsys):
    dist_results(4, EXPORTED)
    run_root = os.path.join(root, EXPORTED)
    host_a, host_b = (os.path.join(run_root, f"host{h}", "ckpt") for h in "AB")
    out = tmp_path / "out"
    assert _consolidate(host_a, host_b, out) == 0
    ex.assert_same_bytes(os.path.join(run_root, "online"), out)
    # and save_pretrained of a model holding the gathered state writes the same
    model = ex.add_buffers(models.make_model("gpt2", seed=3), "gpt2").double()
    model.load_state_dict(torch.load(os.path.join(run_root, "online-state.pt")), strict=True)
    model.save_pretrained(tmp_path / "ref")
    ex.assert_same_as_reference(out, tmp_path / "ref")
    # the order of the folders does not matter; one host's folder alone is not enough
    assert _consolidate(host_b, host_a, tmp_path / "out2") == 0
    ex.assert_same_bytes(out, tmp_path / "out2")
    capsys.readouterr()
    assert _consolidate(host_a, tmp_path / "out3") == 1
    err = capsys.readouterr().err
    assert "rank00002-of-00004.safetensors is missing" in err and "HOST_B_DIR" in err, err
    assert not (tmp_path / "out3").exists()


def test_consolidate_refuses_folders_of_different_saves(dist_results, root, tmp_path, capsys):
    dist_results(4, EXPORTED)
    a = os.path.join(root, EXPORTED, "hostA", "ckpt")
    other = os.path.join(root, "w4-s3-uneven", "hostB", "ckpt")
    dist_results(4, "w4-s3-uneven")
    assert _consolidate(a, other, tmp_path / "out") == 1
    assert "hold different checkpoints" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ launches
# Two "nodes" on this machine: two torchrun launchers (--nnodes 2, one process each), so both processes are
# their node's local main process, as on two hosts. Each saves to its own folder.
SCRIPT = r'''
import json, os, sys
import hf_zero
import torch
from accelerate.utils import ProjectConfiguration

api, root, mode = sys.argv[1], sys.argv[2], sys.argv[3]  # mode: "save" or "resume:<folder inside the host's>"
node = int(os.environ["GROUP_RANK"])
host = os.path.join(root, f"host{'AB'[node]}")
torch.manual_seed(0)
from transformers import AutoModelForCausalLM, GPT2Config, get_linear_schedule_with_warmup
cfg = GPT2Config(vocab_size=101, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0)
result = {}
if api == "accelerate":
    from torch.utils.data import DataLoader, TensorDataset
    acc = hf_zero.HfZeroAccelerator(project_config=ProjectConfiguration(save_on_each_node=False),
                                    zero_plugin=hf_zero.ZeroPlugin(stage=2))
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = get_linear_schedule_with_warmup(opt, 1, 4)
    data = torch.randint(0, 101, (16, 8), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data), batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    done = 0
    if mode.startswith("resume:"):
        try:
            acc.load_state(os.path.join(host, mode.split(":", 1)[1]))
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        done = 2
    if "error" not in result:
        for step, (x,) in enumerate(loader):
            if step < done:
                continue
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
            if mode == "save" and step == 1:
                for each in (False, True):
                    acc.project_configuration.save_on_each_node = each
                    acc.save_state(os.path.join(host, f"state-each{int(each)}"))
            if step == 3:
                break
        sd = acc.get_state_dict(model)
        result["lr"] = sched.get_last_lr()
else:
    from datasets import Dataset
    from transformers import TrainingArguments
    ids = torch.randint(0, 101, (32, 8), generator=torch.Generator().manual_seed(1)).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=os.path.join(host, "out"), max_steps=4, save_steps=2, save_strategy="steps",
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                             save_on_each_node=True, disable_tqdm=True, logging_steps=1, seed=0)
    trainer = hf_zero.ZeroTrainer(model=AutoModelForCausalLM.from_config(cfg), args=args, train_dataset=ds,
                                  zero_plugin=hf_zero.ZeroPlugin(stage=3))
    try:
        trainer.train(resume_from_checkpoint=os.path.join(host, mode.split(":", 1)[1]) if mode.startswith("resume:")
                      else None)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    sd = trainer.accelerator.get_state_dict(trainer.model) if "error" not in result else {}
if node == 0 and "error" not in result:
    result["weights"] = {k: v.double().sum().item() for k, v in sd.items()}
json.dump(result, open(os.path.join(host, f"result-{mode.replace(':', '-').replace('/', '-')}.json"), "w"))
torch.distributed.destroy_process_group()
os._exit(0)
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(script, *args, timeout=400):
    """Run `script args` as two one-process nodes; returns each node's result file's content."""
    port = _free_port()
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    env.pop("HF_ZERO_CONFIG_FILE", None)
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                               str(script), *map(str, args)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    mode = args[2].replace(":", "-").replace("/", "-")
    results = []
    for node, h in enumerate("AB"):
        path = os.path.join(args[1], f"host{h}", f"result-{mode}.json")
        assert os.path.isfile(path), f"node {node} wrote no result:\n" + "\n".join(o[-4000:] for o in outs)
        results.append(json.load(open(path)))
    return results


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "node_local_train.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow
def test_accelerate_save_state_on_node_local_disks(script, tmp_path):
    full = _two_nodes(script, "accelerate", tmp_path, "save")
    b = tmp_path / "hostB"
    # Accelerate's own files: the scheduler on the main process only, unless save_on_each_node; RNG per process
    assert not (b / "state-each0" / "scheduler.bin").exists() and (b / "state-each1" / "scheduler.bin").exists()
    assert (b / "state-each0" / "random_states_1.pkl").exists()
    for state in ("state-each0", "state-each1"):  # the consolidated weights stay on the main process's host
        assert (tmp_path / "hostA" / state / "model.safetensors").exists()
        assert not (b / state / "model.safetensors").exists()
        assert sorted(f for f in os.listdir(b / state / "zero_shards") if f.startswith("rank")) == \
            ["rank00001-of-00002.safetensors"]
    failed = _two_nodes(script, "accelerate", tmp_path, "resume:state-each0")
    for r in failed:
        assert "CheckpointError" in r["error"] and "scheduler.bin" in r["error"], r
        assert "save_on_each_node=True" in r["error"] and "missing on host" in r["error"], r
    resumed = _two_nodes(script, "accelerate", tmp_path, "resume:state-each1")
    assert "error" not in resumed[0], resumed
    assert resumed[0]["lr"] == full[0]["lr"]
    for k, v in full[0]["weights"].items():
        assert resumed[0]["weights"][k] == pytest.approx(v, rel=1e-6, abs=1e-8), k


@pytest.mark.slow
def test_trainer_resume_on_node_local_disks(script, tmp_path):
    full = _two_nodes(script, "trainer", tmp_path, "save")
    ckpt = os.path.join("out", "checkpoint-2")
    b = tmp_path / "hostB" / ckpt
    # save_on_each_node=True: host B's local main process wrote the Trainer's files; the weights stay on host A
    assert (b / "trainer_state.json").exists() and (b / "scheduler.pt").exists()
    assert not (b / "model.safetensors").exists() and (tmp_path / "hostA" / ckpt / "model.safetensors").exists()
    resumed = _two_nodes(script, "trainer", tmp_path, f"resume:{ckpt}")  # each node from its own host's folder
    assert "error" not in resumed[0], resumed
    for k, v in full[0]["weights"].items():
        assert resumed[0]["weights"][k] == pytest.approx(v, rel=1e-6, abs=1e-8), k
    # what save_on_each_node=False leaves on host B: no trainer_state.json / scheduler.pt there
    (b / "trainer_state.json").unlink()
    (b / "scheduler.pt").unlink()
    failed = _two_nodes(script, "trainer", tmp_path, f"resume:{ckpt}")
    for r in failed:
        assert "CheckpointError" in r["error"] and "trainer_state.json" in r["error"], r
        assert "save_on_each_node=True" in r["error"], r
