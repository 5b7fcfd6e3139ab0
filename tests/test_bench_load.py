"""`hf-zero bench --load` end to end: the tiny GPT-2 saved with save_pretrained into several files, loaded into a
sharded model by hf_zero stage 1, hf_zero stage 3 and FSDP2 on 2 gloo ranks.

The bytes each row reports are checked against counts made here from the preset's shapes (written out below, not
read from hf_zero or from the bench): before the first step, hf_zero stage 1 holds the full fp32 parameters and
the full fp32 gradient accumulator (Ψ*4 each, plus padding to the world size per flat group), stage 3 half of
each (its shard; the fp32 master is the shard itself), FSDP2 its dim-0 chunk of every parameter (the ranks'
chunks add up to Ψ*4 exactly).

The loaded weights: the bench's own verdict (`weights_ok`, computed inside the run) is not the evidence. The test
saves the model itself with the bench's save step, points `--load-folder` at that folder, reads every tensor of its
safetensors files with `safetensors.safe_open`, and (a) checks the bench compared exactly that many tensors, (b)
loads the folder again in its own 2-rank gloo world with hf_zero's loader, as the bench's hf_zero rows do
(`hf_zero.from_pretrained` on meta + `shard_model`, stages 1 and 3), and requires every weight to equal the file's
bit for bit. FSDP2's loaded weights stay inside the bench (its verdict only).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPT2Config

from _dist import run_scenarios

pytestmark = pytest.mark.slow  # one --load run of three systems: ~50 s idle on 2 cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
SYSTEMS = ("zero1", "zero3", "fsdp2")
MiB = 2**20


def _tiny_named_params():
    """(name, parameter) of each distinct parameter of --preset tiny: a GPT-2 with 2 layers, width 64,
    vocabulary 512, 128 positions; wte and lm_head tied (one tensor)."""
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    return list(model.named_parameters())  # remove_duplicate=True: tied weights once


def _tiny_params():
    return [p for _, p in _tiny_named_params()]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The --preset tiny model saved by the bench's own save step (save_pretrained into about 4 files, seed 0), in a
    folder the test keeps, so it can read the very files the bench loads."""
    from hf_zero.tools.bench.load import save_model
    from hf_zero.tools.bench.runner import PRESETS

    folder = str(tmp_path_factory.mktemp("bench_load_model") / "model")
    save_model(dict(PRESETS["tiny"]), folder, 0, None, 300, 2)
    return folder


def read_files(folder):
    """{name: tensor} of every safetensors file in `folder`, read with safe_open (not through hf_zero)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in f.keys():
                    assert key not in out, f"{key} in two files"
                    out[key] = f.get_tensor(key)
    return out


@pytest.fixture(scope="module")
def load_run(tmp_path_factory, model_folder):
    out = tmp_path_factory.mktemp("bench_load") / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "hf_zero.cli", "bench", "--load", "--load-folder", model_folder,
           "--num-processes", str(WORLD), "--systems", ",".join(SYSTEMS), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = [ln for ln in out.read_text().splitlines() if ln.strip()]
    assert len(lines) == 1, "--json writes exactly one JSON line"
    payload = json.loads(lines[0])
    return payload, {r["system"]: r for r in payload["rows"]}, proc


def test_every_system_loads_the_files_exactly(load_run, model_folder):
    payload, rows, proc = load_run
    assert list(rows) == list(SYSTEMS)
    files = read_files(model_folder)
    assert len(payload["settings"]["files"]) >= 2, "the model is saved into several safetensors files"
    assert sorted(payload["settings"]["files"]) == sorted(n for n in os.listdir(model_folder)
                                                          if n.endswith(".safetensors"))
    n_tensors = len(_tiny_params())  # distinct tensors: lm_head.weight is wte's, save_pretrained writes it once
    assert len(files) == n_tensors, sorted(files)
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("error", r["status"]))
        assert r["world_size"] == WORLD and len(r["per_rank"]) == WORLD
        assert r["weights_ok"] and r["weights_max_abs_diff"] == 0.0 and not r["weights_missing"], name
        assert r["weights_checked"] == n_tensors, name
    for name in SYSTEMS:
        assert name in proc.stdout and "above baseline MiB" in proc.stdout  # the table


def load_with_hf_zero(rank, world_size, folder, stage):
    """What the bench's hf_zero rows do, in the test's own gloo world: hf_zero.from_pretrained on meta, then
    shard_model with AdamW; rank 0 returns the full weights (full_state_dict), the others {}."""
    from hf_zero import ZeroConfig, from_pretrained, shard_model

    model = from_pretrained(AutoModelForCausalLM, folder, torch_dtype=torch.float32)
    engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=stage))
    state = engine.full_state_dict()
    engine.close()
    return {k: v.clone() for k, v in state.items()}


def test_hf_zero_loads_every_tensor_of_the_files_bit_for_bit(model_folder):
    """Independent of the bench's verdict: the files read with safe_open against what hf_zero's loader puts into a
    2-rank stage-1 and stage-3 model, every tensor bit for bit (GPT-2's tied lm_head.weight is the file's
    transformer.wte.weight; save_pretrained writes it once)."""
    files = read_files(model_folder)
    assert len(files) == len(_tiny_params())
    results = run_scenarios(WORLD, [(f"stage{k}", load_with_hf_zero, dict(folder=model_folder, stage=k))
                                    for k in (1, 3)])
    for name, res in results.items():
        if isinstance(res, Exception):
            raise res
        state = res[0]
        assert all(r == {} for r in res[1:]), name
        for key, want in files.items():
            assert key in state, (name, key)
            got = state[key]
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (
                name, key, (got.double() - want.double()).abs().max().item())
        assert torch.equal(state["lm_head.weight"], files["transformer.wte.weight"]), name


def test_memory_and_time_are_plausible(load_run):
    _, rows, _ = load_run
    for name, r in rows.items():
        assert r["peak_kind"].startswith("VmHWM (reset"), name  # the peak is the loading peak, not the imports'
        assert 0 < r["wall_s"] < 120, name
        for rank in r["per_rank"]:
            # a process with torch and Transformers imported is well above 50 MiB; the peak is at least the
            # baseline (the peak was reset to it) and at least the end state
            assert rank["rss_before"] > 50 * MiB, name
            assert rank["hwm_after"] >= rank["rss_before"] and rank["hwm_after"] >= rank["rss_after"], name
            assert 0 <= rank["peak_above_baseline"] == rank["hwm_after"] - rank["rss_before"], name
            # the model states have to live somewhere: above the baseline at the end (allocator slack aside),
            # and loading a 0.5 MiB model does not cost more than 64 MiB
            assert rank["peak_above_baseline"] >= 0.5 * rank["state_bytes"], name
            assert rank["peak_above_baseline"] < 64 * MiB, name
        assert r["peak_bytes"] == max(x["hwm_after"] for x in r["per_rank"])


def test_model_state_bytes_match_the_counts_from_the_shapes(load_run):
    _, rows, _ = load_run
    params = _tiny_params()
    psi = sum(p.numel() for p in params)
    n = len(params)  # a bound on the flat groups, hence on the padding (at most WORLD-1 elements each)

    # hf_zero stage 1: full parameters on every rank; a model read from its files gets its gradients at the first
    # backward and its Adam state at the first step, so right after loading it holds the parameters only
    z1 = rows["zero1"]
    assert z1["psi"] == psi
    for rank in z1["per_rank"]:
        assert psi * 4 <= rank["param_bytes"] <= (psi + n * (WORLD - 1)) * 4
        assert rank["grad_bytes"] == 0
        assert rank["optimizer_state_bytes"] == 0
        assert rank["state_bytes"] == rank["param_bytes"]

    # hf_zero stage 3: a 1/WORLD shard of the parameters (the master is the shard; gradients come later)
    z3 = rows["zero3"]
    for rank in z3["per_rank"]:
        assert psi * 4 / WORLD <= rank["param_bytes"] <= (psi + n * (WORLD - 1)) * 4 / WORLD
        assert rank["shard_bytes"] == rank["param_bytes"] and rank["grad_bytes"] == 0
        assert rank["state_bytes"] == rank["param_bytes"]
    # the largest unit: the root (embeddings, final norm) or a block, whichever is bigger, padded
    named = _tiny_named_params()
    root = sum(p.numel() for name, p in named if not name.startswith("transformer.h."))
    block = sum(p.numel() for name, p in named if name.startswith("transformer.h.0."))
    assert max(root, block) <= z3["largest_unit_numel"] <= max(root, block) + n * (WORLD - 1)
    assert z3["largest_unit_bytes"] == 4 * z3["largest_unit_numel"]
    assert z3["bound_bytes"] == z3["state_bytes"] + z3["largest_unit_bytes"]

    # FSDP2: dim-0 chunks of every parameter, no gradients or Adam state yet; the chunks add up to the model
    f = rows["fsdp2"]
    chunk_slack = sum(p.numel() // p.shape[0] for p in params)  # at most one extra row per tensor per rank
    assert sum(rank["param_bytes"] for rank in f["per_rank"]) == psi * 4
    for rank in f["per_rank"]:
        assert psi * 4 / WORLD - chunk_slack * 4 <= rank["param_bytes"] <= psi * 4 / WORLD + chunk_slack * 4
        assert rank["state_bytes"] == rank["param_bytes"]

