"""Checkpoints on node-local disks across two real hosts, and the collective ledger across them.

tests/test_node_local_checkpoint.py simulates disks the hosts do not share on one machine; here the two hosts are
made of network namespaces (tests/_hosts.py): each has its own hostname, address and disk, mounted at the same path
(`hosts.disk`) on both, so one checkpoint path names a different folder on each host, as /scratch does on a
cluster. 2 hosts x 2 ranks, world 4, gloo, `accelerate launch --num_machines 2` (tests/test_multihost.py's
command), one TwoHosts for the whole module. tests/scripts/multihost_ckpt.py is the training script (tiny GPT-2,
ZeRO stage 3, 4 steps of 2 micro-batches, `save_on_each_node=True`).

- Accelerate `save_state` at step 2 of 4: each host's disk holds its own ranks' partition files, the manifest (the
  same save on both), the buffers and the config, none of the other host's rank files, Accelerate's scheduler and
  RNG files of its own ranks, and no temporary folder; the consolidated weights only on the main host. Resuming on
  the same two hosts equals the uninterrupted run (losses, grad norms, lr, final weights within 1e-5), and the
  consolidated exports (`accelerator.save_model`, `export_pretrained(engine)`) land on the main host's disk only and
  load with `AutoModelForCausalLM.from_pretrained` to the run's `get_state_dict`.
- A rank file deleted from host B's disk: the resume fails on every rank of both hosts within seconds (no hang),
  each rank's error naming host B, rank 3 and the missing file; both launchers exit non-zero.
- `hf-zero consolidate hostA/ckpt hostB/ckpt OUT` from the test process (outside the namespaces) writes what the
  online export of the same checkpoint wrote, and what save_pretrained of the weights at the save writes, tensor by
  tensor; host A's folder alone is refused, naming the files.
- ZeroTrainer with `TrainingArguments(save_on_each_node=True)`: checkpoint-2 is complete on both disks (shards of
  the host's ranks, trainer_state.json, scheduler.pt, RNG states; weights on the main host), and the resume equals
  the uninterrupted run.
- The ledger across hosts (tests/scripts/multihost_train.py): plain stage 3, hpZ, HSDP at stages 3/2/1 train alike
  and every rank's intra-/inter-host elements of the last step match the paper's formulas (a table is printed).

Every launch is bounded (RUN_TIMEOUT_S; a host whose peer exited gets PEER_GRACE_S), ports come from the OS.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

import test_export as ex
from _hosts import ROOT, base_env, run_local, two_hosts_or_skip, worker_logs
from test_multihost import (PEER_GRACE_S, RUN_TIMEOUT_S, SCRIPT as TRAIN_SCRIPT, accelerate_on_two_hosts,
                            assert_clean_exit, assert_ranks_on, load_results)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "multihost_ckpt.py")
BIN = os.path.dirname(sys.executable)
HF_ZERO = ([os.path.join(BIN, "hf-zero")] if os.path.isfile(os.path.join(BIN, "hf-zero"))
           else [sys.executable, "-m", "hf_zero.cli"])
SAVE_AT, STEPS, ACCUM, WORLD, PER_HOST = 2, 4, 2, 4, 2
RTOL = 1e-5
FAIL_TIMEOUT_S = 120  # a resume that must fail: bounded well below RUN_TIMEOUT_S
FAIL_WITHIN_S = 30  # load_state's start to every rank's error
META = ["buffers.safetensors", "config.json", "generation_config.json", "manifest.json"]
LEDGER_CONFIGS = [{"stage": 3}, {"stage": 3, "hpz_partition_size": "host"}, {"stage": 3, "shard_group_size": "host"},
                  {"stage": 2, "shard_group_size": "host"}, {"stage": 1, "shard_group_size": "host"}]
DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
pytestmark = pytest.mark.needs_root  # every test runs on the two namespace hosts


def _rank_file(p, count=WORLD):
    return f"rank{p:05d}-of-{count:05d}.safetensors"


# ------------------------------------------------------------------------------------------------ launching
@pytest.fixture(scope="module")
def hosts():
    h = two_hosts_or_skip()  # skips with "needs root, ..." and what is missing
    with h:
        yield h


def launch(hosts, script_and_args, timeout=RUN_TIMEOUT_S):
    """Both hosts' `accelerate launch` of the script; a clean exit on both is required."""
    runs = hosts.run(accelerate_on_two_hosts(hosts, script_and_args), timeout=timeout, peer_grace=PEER_GRACE_S)
    assert_clean_exit(runs)
    return runs


def ckpt(hosts, api, out, *extra):
    runs = launch(hosts, [SCRIPT, "--api", api, "--out", os.path.join(hosts.disk, out), *extra])
    assert "MULTIHOST_CKPT finished" in runs[0].stdout, runs[0].describe()
    assert not os.path.exists(os.path.join(hosts.disk_of(1), out, "log.json"))  # the main process writes it
    with open(os.path.join(hosts.disk_of(0), out, "log.json")) as f:
        log = json.load(f)
    assert log["world_size"] == WORLD
    assert [(x["rank"], x["hostname"]) for x in log["ranks"]] == \
        [(r, hosts.hostname(r // PER_HOST)) for r in range(WORLD)], log["ranks"]
    log["state"] = load_file(os.path.join(hosts.disk_of(0), out, "weights.safetensors"))
    return runs, log


@pytest.fixture(scope="module")
def accel_full(hosts):
    """The uninterrupted Accelerate run: save_state and an online export after step 2, on to step 4."""
    return ckpt(hosts, "accelerate", "acc-full", "--save-at", str(SAVE_AT))[1]


@pytest.fixture(scope="module")
def trainer_full(hosts):
    """The uninterrupted ZeroTrainer run, checkpointing every 2 steps."""
    return ckpt(hosts, "trainer", "tr-full", "--save-at", str(SAVE_AT))[1]


# ------------------------------------------------------------------------------------------------ comparing
def assert_same_state(got, ref, what, rtol=RTOL):
    assert set(got) == set(ref) and ref, (what, sorted(set(got) ^ set(ref)))
    for k, v in ref.items():
        assert got[k].shape == v.shape, (what, k, got[k].shape, v.shape)
        err = ((got[k].double() - v.double()).norm() / v.double().norm().clamp_min(1e-30)).item()
        assert err < rtol, f"{what}: {k}: relative error {err:.2e}"


def assert_same_floats(got, ref, what, rtol=RTOL):
    assert len(got) == len(ref) > 0, (what, got, ref)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               rtol=rtol, atol=1e-6, msg=lambda m: f"{what}: {m}")


def listing(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else None


def assert_no_temporaries(*folders):
    """No save's temporary folder (`NAME.tmp-ID`), replaced folder (`NAME.old-ID`) or rank markers (`.ranks`)."""
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(folder):
            left = [n for n in dirnames + filenames if ".tmp-" in n or ".old-" in n or n == ".ranks"]
            assert not left, f"left in {dirpath}: {left}"


def assert_node_local_shards(hosts, shards, step, count=WORLD):
    """Each host's `shards` folder: its own ranks' partition files and the metadata, one save on both hosts."""
    manifests = []
    for i in range(2):
        mine = [_rank_file(r, count) for r in range(i * PER_HOST, (i + 1) * PER_HOST)]
        got = listing(os.path.join(hosts.disk_of(i), shards))
        assert got == sorted(mine + META), f"host {'AB'[i]}'s {shards}: {got}, want {sorted(mine + META)}"
        with open(os.path.join(hosts.disk_of(i), shards, "manifest.json")) as f:
            manifests.append(f.read())
    assert manifests[0] == manifests[1], "the hosts' manifests differ"
    m = json.loads(manifests[0])
    assert m["format_version"] == 3 and m["world_size"] == WORLD and m["partitions"] == count and m["step"] == step
    assert sorted(m["files"]) == sorted([_rank_file(p, count) for p in range(count)] + ["buffers.safetensors"])
    assert [d["hosts"] for d in m["disks"]] == [[hosts.hostname(0)], [hosts.hostname(1)]], m["disks"]
    for p in range(count):  # every partition file was written by its own rank, on its own host
        assert m["writers"][_rank_file(p, count)] == [[hosts.hostname(p // PER_HOST), p]], m["writers"]
    assert sorted(map(tuple, m["writers"]["buffers.safetensors"])) == [(hosts.hostname(0), 0), (hosts.hostname(1), 2)]
    return m


# ------------------------------------------------------------------------------------------------ 1. Accelerate
@pytest.mark.slow
def test_accelerate_save_state_on_node_local_disks_and_resume(hosts, accel_full):
    a, b = hosts.disk_of(0), hosts.disk_of(1)
    state = os.path.join("acc-full", "state")
    # the manifest's step counts optimizer steps (Accelerate's own `accelerator.step` counts micro-batches)
    assert_node_local_shards(hosts, os.path.join(state, "zero_shards"), step=SAVE_AT)
    # Accelerate's own files: RNG per process on its host; with save_on_each_node the scheduler (and our steps.json)
    # from every host's local main process; the consolidated weights from the main process only
    assert listing(os.path.join(a, state)) == ["model.safetensors", "random_states_0.pkl", "random_states_1.pkl",
                                               "scheduler.bin", "steps.json", "zero_shards"]
    assert listing(os.path.join(b, state)) == ["random_states_2.pkl", "random_states_3.pkl", "scheduler.bin",
                                               "steps.json", "zero_shards"]
    assert listing(os.path.join(a, "acc-full")) == ["export", "export-step2", "log.json", "saved", "state",
                                                    "weights-step2.safetensors", "weights.safetensors"]
    assert_no_temporaries(os.path.join(a, "acc-full"), os.path.join(b, "acc-full"))
    full = accel_full
    assert full["steps"] == STEPS and len(full["losses"]) == STEPS * ACCUM and len(full["norms"]) == STEPS

    # the consolidated exports: on the main host's disk only, and they load to the run's get_state_dict
    from transformers import AutoModelForCausalLM

    # export_pretrained writes nothing at all on another host; accelerator.save_model leaves only the empty folder
    # that Accelerate's save_model makes on every rank
    assert listing(os.path.join(b, "acc-full")) == ["saved", "state"], listing(os.path.join(b, "acc-full"))
    assert listing(os.path.join(b, "acc-full", "saved")) == []
    assert listing(os.path.join(a, "acc-full", "saved")) == ["config.json", "model.safetensors"]
    assert listing(os.path.join(a, "acc-full", "export")) == ["config.json", "generation_config.json",
                                                              "model.safetensors"]
    for name in ("saved", "export"):
        model = AutoModelForCausalLM.from_pretrained(os.path.join(a, "acc-full", name), dtype=torch.float32)
        sd = model.state_dict()
        for k, v in full["state"].items():
            assert torch.equal(sd[k], v), f"{name}: {k} differs from get_state_dict"

    # resume on the same two hosts: each host reads its own disk (host B has no rank 0/1 files)
    _, resumed = ckpt(hosts, "accelerate", "acc-resumed", "--resume", os.path.join(hosts.disk, state))
    assert resumed["steps"] == STEPS
    assert_same_floats(resumed["losses"], full["losses"][SAVE_AT * ACCUM:], "losses after the resume")
    assert_same_floats(resumed["norms"], full["norms"][SAVE_AT:], "grad norms after the resume")
    assert_same_floats(resumed["lr"], full["lr"], "last lr")
    assert_same_state(resumed["state"], full["state"], "final weights, resumed vs uninterrupted")


# ------------------------------------------------------------------------------------------------ 2. missing file
@pytest.mark.slow
def test_missing_rank_file_on_host_b_fails_every_rank_fast(hosts, accel_full):
    state = os.path.join("acc-full", "state")
    lost = _rank_file(3)
    copy = os.path.join("acc-missing", "state")
    for i in range(2):  # a copy of the checkpoint on both disks (the other tests keep theirs whole)
        shutil.copytree(os.path.join(hosts.disk_of(i), state), os.path.join(hosts.disk_of(i), copy))
    os.remove(os.path.join(hosts.disk_of(1), copy, "zero_shards", lost))
    folder = os.path.join(hosts.disk, copy, "zero_shards")
    logs = "acc-missing-logs"  # every rank's own stdout/stderr files, on its host's disk (worker_logs)
    runs = hosts.run(accelerate_on_two_hosts(hosts, ["--tee", "3", "--log_dir", os.path.join(hosts.disk, logs),
                                                     SCRIPT, "--api", "accelerate", "--out",
                                                     os.path.join(hosts.disk, "acc-missing-out"), "--resume",
                                                     os.path.join(hosts.disk, copy)]),
                     timeout=FAIL_TIMEOUT_S, peer_grace=PEER_GRACE_S)
    described = "\n".join(r.describe() for r in runs)
    for r in runs:
        assert not r.killed and r.returncode not in (0, None), f"{r.name} did not fail by itself\n{described}"
        assert r.returncode > 0, f"{r.name} ended by signal {-r.returncode}\n{described}"
        assert not r.leftover, f"{r.name}: processes {r.leftover} outlived the launcher"
        assert r.seconds < 60, f"{r.name} took {r.seconds:.0f} s to fail\n{described}"
        assert "MULTIHOST_CKPT finished" not in r.output
    host_b = hosts.hostname(1)
    per_host = [worker_logs(os.path.join(hosts.disk_of(i), logs)) for i in range(2)]
    for i in range(2):
        assert sorted(per_host[i]) == list(range(PER_HOST)), f"host {i}: ranks' log files {sorted(per_host[i])}"
    for rank in range(WORLD):
        stderr = per_host[rank // PER_HOST][rank % PER_HOST].get("stderr", "")
        # the whole of this rank's own stderr: its error line once, and no other rank's
        mine = re.findall(r"^MULTIHOST_CKPT error rank=(\d+) .*$", stderr, re.M)
        assert mine == [str(rank)], f"rank {rank}: error lines of ranks {mine} in its stderr:\n{stderr}"
        line = re.search(r"^MULTIHOST_CKPT error rank=.*$", stderr, re.M).group(0)
        m = re.match(r"MULTIHOST_CKPT error rank=\d+ host=(\S+) after ([\d.]+) s in load_state: CheckpointError: ",
                     line)
        assert m, line
        assert m.group(1) == hosts.hostname(rank // PER_HOST), line
        assert float(m.group(2)) < FAIL_WITHIN_S, f"rank {rank} waited {m.group(2)} s for its error: {line}"
        for part in (f"host {host_b}, rank 3", lost, "is missing", folder, "failed on 1 of 4 ranks",
                     "hf-zero consolidate"):
            assert part in line, f"rank {rank}: {part!r} not in {line}"
    # nothing of the failed run was written
    assert not os.path.exists(os.path.join(hosts.disk_of(0), "acc-missing-out", "log.json"))


# ------------------------------------------------------------------------------------------------ 3. consolidate
@pytest.mark.slow
def test_consolidate_every_hosts_folder_from_outside(hosts, accel_full, tmp_path):
    shards = os.path.join("acc-full", "state", "zero_shards")
    folders = [os.path.join(hosts.disk_of(i), shards) for i in range(2)]
    env = base_env({"HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf_home")})
    out = tmp_path / "out"
    run = run_local(HF_ZERO + ["consolidate", *folders, str(out)], env, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.describe()
    # the online export of the same checkpoint (export_pretrained(engine) right after save_state at step 2)
    online = os.path.join(hosts.disk_of(0), "acc-full", "export-step2")
    ex.assert_same_as_reference(str(out), online)  # tensor by tensor, metadata, bytes, configs
    # and save_pretrained of a model holding the run's weights at the save (get_state_dict), not the final ones
    step2 = load_file(os.path.join(hosts.disk_of(0), "acc-full", f"weights-step{SAVE_AT}.safetensors"))
    assert any(not torch.equal(step2[k], v) for k, v in accel_full["state"].items()), "step-2 weights == final"
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(online))
    model.load_state_dict(step2, strict=True)
    model.save_pretrained(tmp_path / "ref")
    ex.assert_same_as_reference(str(out), str(tmp_path / "ref"))
    # host A's folder alone lacks host B's rank files: refused, naming them
    alone = run_local(HF_ZERO + ["consolidate", folders[0], str(tmp_path / "alone")], env, timeout=120, cwd=ROOT)
    assert alone.returncode == 1, alone.describe()
    assert "rank00002-of-00004.safetensors is missing" in alone.stderr and "HOST_B_DIR" in alone.stderr, alone.stderr
    assert not (tmp_path / "alone").exists()


# ------------------------------------------------------------------------------------------------ 4. the Trainer
@pytest.mark.slow
def test_trainer_save_on_each_node_resume_on_same_hosts(hosts, trainer_full):
    a, b = hosts.disk_of(0), hosts.disk_of(1)
    ck = os.path.join("tr-full", "trainer", "checkpoint-2")
    assert_node_local_shards(hosts, os.path.join(ck, "zero_shards"), step=SAVE_AT)  # the Trainer's global_step
    # save_on_each_node=True: every host's local main process writes trainer_state.json and scheduler.pt; RNG states
    # per process on its host; the consolidated weights, config and training arguments from the main process only
    assert listing(os.path.join(a, ck)) == ["config.json", "generation_config.json", "model.safetensors",
                                            "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
                                            "trainer_state.json", "training_args.bin", "zero_shards"]
    assert listing(os.path.join(b, ck)) == ["rng_state_2.pth", "rng_state_3.pth", "scheduler.pt",
                                            "trainer_state.json", "zero_shards"]
    with open(os.path.join(a, ck, "trainer_state.json")) as fa, open(os.path.join(b, ck, "trainer_state.json")) as fb:
        assert json.load(fa)["global_step"] == json.load(fb)["global_step"] == SAVE_AT
    assert_no_temporaries(os.path.join(a, "tr-full"), os.path.join(b, "tr-full"))
    full = trainer_full
    assert full["steps"] == STEPS and len(full["losses"]) == len(full["norms"]) == STEPS

    _, resumed = ckpt(hosts, "trainer", "tr-resumed", "--resume", os.path.join(hosts.disk, ck))
    assert resumed["steps"] == STEPS
    # the log history comes back from trainer_state.json for the first two steps and goes on from there
    assert_same_floats(resumed["losses"], full["losses"], "losses")
    assert_same_floats(resumed["norms"], full["norms"], "grad norms")
    assert_same_state(resumed["state"], full["state"], "final weights, resumed vs uninterrupted")


# ------------------------------------------------------------------------------------------------ 5. the ledger
def _train_script_module():
    spec = importlib.util.spec_from_file_location("multihost_train_for_ledger", TRAIN_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_counts():
    """(Ψ trainable elements, r resident elements, parameter tensors, m micro-batches) of the script. Resident: what
    stage 3 keeps gathered from forward into backward under the default reshard_after_forward ("auto", as
    torchtitan does): the root unit (everything outside the blocks) and the last block."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    mod = _train_script_module()
    model = mod.tiny_gpt2()
    params = [p for p in model.parameters() if p.requires_grad]
    blocks = [m for m in model.modules() if isinstance(m, GPT2Block)]
    in_blocks = {id(p) for m in blocks for p in m.parameters()}
    in_last = {id(p) for p in blocks[-1].parameters()}
    psi = sum(p.numel() for p in params)
    r = sum(p.numel() for p in params if id(p) not in in_blocks or id(p) in in_last)
    return psi, r, len(params), mod.GRAD_ACCUM


def ledger_formulas(psi, r, m, K=PER_HOST):
    """Per config, {kind: (intra, inter)} elements per rank and optimizer step (paper counting)."""
    return {
        "stage 3": {"all_gather": (0, m * (2 * psi - r)), "reduce_scatter": (0, m * psi)},
        "stage 3 hpZ": {"all_gather": (m * (psi - r), m * psi), "reduce_scatter": (0, m * psi)},
        "stage 3 HSDP": {"all_gather": (m * (2 * psi - r), 0), "reduce_scatter": (m * psi, 0),
                         "all_reduce": (0, m * 2 * psi // K)},
        "stage 2 HSDP": {"reduce_scatter": (m * psi, 0), "all_gather": (psi, 0), "all_reduce": (0, m * 2 * psi // K)},
        "stage 1 HSDP": {"reduce_scatter": (psi, 0), "all_gather": (psi, 0), "all_reduce": (0, 2 * psi // K)},
    }


def format_table(rows):
    head = ["config", "kind", "intra measured", "intra formula", "inter measured", "inter formula"]
    cells = [head] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


@pytest.mark.slow
def test_ledger_across_hosts_matches_formulas(hosts):
    out = os.path.join(hosts.disk, "ledger")
    runs = launch(hosts, [TRAIN_SCRIPT, "--api", "accelerate", "--configs", json.dumps(LEDGER_CONFIGS), "--out", out])
    assert "MULTIHOST_TRAIN finished" in runs[0].stdout, runs[0].describe()
    results = load_results(os.path.join(hosts.disk_of(0), "ledger"))
    assert [e["config"] for e in results] == LEDGER_CONFIGS
    for entry in results:
        assert_ranks_on(entry, [hosts.hostname(0)] * PER_HOST + [hosts.hostname(1)] * PER_HOST)

    # (a) the same training whoever talks to whom
    plain = results[0]
    for entry in results[1:]:
        what = f"config {entry['config']} vs {plain['config']}"
        assert_same_floats(entry["losses"], plain["losses"], f"{what}: losses")
        assert_same_floats(entry["norms"], plain["norms"], f"{what}: grad norms")
        assert_same_state(entry["state"], plain["state"], f"{what}: final weights")

    # (b) every rank's intra/inter elements of the last step against the formulas
    psi, r, tensors, m = model_counts()
    formulas = ledger_formulas(psi, r, m)
    rows, problems = [], []
    for (name, kinds), entry in zip(formulas.items(), results):
        by_rank = sorted(entry["ranks"], key=lambda x: x["rank"])
        for kind in DATA_KINDS:
            want = kinds.get(kind, (0, 0))
            got = [(x["comm_last_step"].get(kind, {}).get("intra_elements", 0),
                    x["comm_last_step"].get(kind, {}).get("inter_elements", 0)) for x in by_rank]
            if want != (0, 0) or any(g != (0, 0) for g in got):
                rows.append([name, kind, got[0][0], want[0], got[0][1], want[1]])
            for rank, g in enumerate(got):
                for where, measured, formula in (("intra", g[0], want[0]), ("inter", g[1], want[1])):
                    # padding: each flat buffer may be padded to a multiple of N, per pass over the parameters
                    slack = math.ceil(formula / psi) * tensors * WORLD
                    if not formula <= measured <= formula + slack:
                        problems.append(f"{name} {kind} rank {rank}: {where} {measured}, formula {formula} "
                                        f"(+ up to {slack} padding)")
    table = format_table(rows)
    print(f"\nhf_zero ledger across 2 hosts x 2 ranks (N = {WORLD}, K = {PER_HOST}, m = {m}, Ψ = {psi}, r = {r}; "
          f"elements per rank and optimizer step, every rank alike):\n{table}")
    assert not problems, "\n".join(problems) + "\n" + table
