"""hf_zero through the real `accelerate launch`, torchrun and the Transformers Trainer (2 and 3 gloo ranks).

Every hf_zero run is compared with the same script under stock Accelerate DDP / the stock Trainer: same seed,
same data, per-step losses, global grad norms and final weights within 1e-5 relative (fp32).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
ROOT = os.path.dirname(HERE)


def _env(zero_yaml=None):
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    env.pop("HF_ZERO_CONFIG_FILE", None)
    if zero_yaml is not None:
        env["HF_ZERO_CONFIG_FILE"] = str(zero_yaml)
    return env


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(script, nproc, *args, zero_yaml=None, timeout=600):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           os.path.join(SCRIPTS, script), *args]
    res = subprocess.run(cmd, env=_env(zero_yaml), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res


def assert_close_runs(ours, ref, rtol=1e-5):
    a, b = json.load(open(os.path.join(ours, "log.json"))), json.load(open(os.path.join(ref, "log.json")))
    assert len(a["losses"]) == len(b["losses"]) > 0
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), rtol=rtol, atol=1e-6)


def assert_same_weights(path_a, path_b, rtol=1e-5):
    wa, wb = load_file(path_a), load_file(path_b)
    assert set(wa) == set(wb), set(wa) ^ set(wb)
    for k in wa:
        err = ((wa[k].double() - wb[k].double()).norm() / wb[k].double().norm()).item()
        assert err < rtol, f"{k}: relative error {err:.2e}"


# ------------------------------------------------------------------------------------------ accelerate launch
@pytest.mark.parametrize("nproc,model,stages", [(2, "gpt2", (1, 2, 3)), (3, "llama", (1, 2, 3))])
def test_accelerate_launch_matches_ddp(tmp_path, nproc, model, stages):
    ref = tmp_path / "ddp"
    accelerate_launch("accel_train.py", nproc, "--backend", "ddp", "--model", model, "--out", str(ref))
    for stage in stages:
        cfg = tmp_path / f"zero{stage}.yaml"
        # ZeRO-R through hf_zero.yaml: checkpointing changes memory, not the numbers (the DDP run has none)
        ckpt = {1: "", 2: "  activation_checkpointing: on\n  cpu_checkpointing: true\n",
                3: "  activation_checkpointing: partitioned\n"}[stage]
        cfg.write_text(f"zero:\n  stage: {stage}\n  reduce_bucket_size: 4096\n{ckpt}")
        out = tmp_path / f"zero{stage}"
        accelerate_launch("accel_train.py", nproc, "--backend", "zero", "--model", model, "--out", str(out),
                          zero_yaml=cfg)
        log = json.load(open(out / "log.json"))
        assert log["num_processes"] == nproc
        assert len(log["checkpointed_layers"]) == (0 if stage == 1 else 2), log["checkpointed_layers"]
        assert all(cpu == (stage == 2) for _, cpu in log["checkpointed_layers"]), log["checkpointed_layers"]
        assert_close_runs(out, ref)
        assert_same_weights(out / "weights.safetensors", ref / "weights.safetensors")


@pytest.mark.parametrize("stage", [1, 3])
def test_save_state_load_state_resumes_exactly(tmp_path, stage):
    """save_state keeps every rank's shard; load_state continues the same run to the same weights."""
    cfg = tmp_path / "zero.yaml"
    cfg.write_text(f"zero:\n  stage: {stage}\n")
    full = tmp_path / "full"
    accelerate_launch("accel_train.py", 2, "--backend", "zero", "--model", "llama", "--steps", "4",
                      "--save-at", "2", "--out", str(full), zero_yaml=cfg)
    shards = sorted(f for f in os.listdir(full / "state" / "zero_shards") if f.startswith(("rank", "manifest")))
    assert shards == ["manifest.json", "rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"]
    resumed = tmp_path / "resumed"
    accelerate_launch("accel_train.py", 2, "--backend", "zero", "--model", "llama", "--steps", "4",
                      "--resume", str(full / "state"), "--out", str(resumed), zero_yaml=cfg)
    assert_same_weights(resumed / "weights.safetensors", full / "weights.safetensors", rtol=1e-6)


def test_torchrun_gives_one_gloo_world(tmp_path):
    """A plain Accelerator() under torchrun on a CPU machine runs N one-process worlds; HfZeroAccelerator must not."""
    script, reports = tmp_path / "world.py", tmp_path / "reports"
    reports.mkdir()
    script.write_text(
        "import json, os, sys\n"
        "import torch.distributed as dist\n"
        "from hf_zero import HfZeroAccelerator\n"
        "a = HfZeroAccelerator()\n"
        "info = {'rank': a.process_index, 'n': a.num_processes, 'dist': dist.get_world_size()}\n"
        "open(os.path.join(sys.argv[1], f'rank{a.process_index}.json'), 'w').write(json.dumps(info))\n"
        "dist.destroy_process_group()\n"
        "os._exit(0)  # gloo's threads now and then abort interpreter teardown; the report is written\n"
    )
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), str(script), str(reports)],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = [json.loads(p.read_text()) for p in sorted(reports.iterdir())]
    assert sorted(s["rank"] for s in seen) == [0, 1]
    assert all(s["n"] == 2 and s["dist"] == 2 for s in seen)


# ------------------------------------------------------------------------------------------ Trainer
@pytest.fixture(scope="module")
def trainer_ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer") / "ddp"
    accelerate_launch("trainer_train.py", 2, "--backend", "ddp", "--out", str(out))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_trainer_matches_trainer_and_resumes(tmp_path, trainer_ddp, stage):
    out = tmp_path / "zero"
    accelerate_launch("trainer_train.py", 2, "--backend", "zero", "--stage", str(stage), "--out", str(out))
    assert_close_runs(out, trainer_ddp)
    # save_model under ZeRO writes full weights that from_pretrained loads and that equal DDP's
    assert_same_weights(out / "final" / "model.safetensors", trainer_ddp / "final" / "model.safetensors")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out / "final")
    ref = load_file(trainer_ddp / "final" / "model.safetensors")
    for name, tensor in loaded.state_dict().items():
        if name in ref:
            torch.testing.assert_close(tensor, ref[name], rtol=1e-5, atol=1e-6)
    # every rank's optimizer shard is in the checkpoint, not only the main process's
    shards = sorted(f for f in os.listdir(out / "checkpoint-2" / "zero_shards") if f.startswith(("rank", "manifest")))
    assert shards == ["manifest.json", "rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"]
    # resume from step 2 in a fresh output dir: same losses for steps 3-4 and the same final weights
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    accelerate_launch("trainer_train.py", 2, "--backend", "zero", "--stage", str(stage), "--out", str(resumed),
                      "--resume", str(resumed / "checkpoint-2"))
    full = json.load(open(out / "log.json"))["losses"]
    after = json.load(open(resumed / "log.json"))["losses"]
    torch.testing.assert_close(torch.tensor(after[-2:]), torch.tensor(full[-2:]), rtol=1e-5, atol=1e-6)
    assert_same_weights(resumed / "final" / "model.safetensors", out / "final" / "model.safetensors", rtol=1e-6)


# ------------------------------------------------------------------------------------------ Hub pushes
def _hub_env(hub, zero_yaml=None):
    env = _env(zero_yaml)
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN="hf_dummy_token", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("HF_HUB_OFFLINE", None)
    return env


def _launch_env(script, env, *args):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), os.path.join(SCRIPTS, script), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


def test_accelerator_save_model_and_push_to_hub_stage3(tmp_path):
    """accelerator.save_model writes the consolidated weights of a stage-3 model; push_to_hub uploads an export
    whose weights equal them, through the real huggingface_hub client to a local stand-in of the Hub."""
    import io

    from hub_server import HubServer
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    from hub_server import CLIENT_ENV

    cfg = tmp_path / "zero.yaml"
    cfg.write_text("zero:\n  stage: 3\n")
    out = tmp_path / "run"
    with HubServer(lfs_threshold=1024) as hub:  # the weights take the LFS path the real client takes for them
        env = {**_hub_env(hub, cfg), **CLIENT_ENV}
        _launch_env("accel_train.py", env, "--backend", "zero", "--model", "llama", "--out", str(out),
                    "--push", "me/tiny-llama")
        received = hub.repos["me/tiny-llama"]
        assert hub.unhandled == []
        lfs_paths = {c["path"] if isinstance(c, dict) else c for commit in hub.commits for c in commit.get("lfs", [])}
        assert "model.safetensors" in lfs_paths, hub.commits
    assert_same_weights(out / "saved" / "model.safetensors", out / "weights.safetensors", rtol=1e-7)
    loaded = AutoModelForCausalLM.from_pretrained(out / "saved")
    trained = load_file(out / "weights.safetensors")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0)
    assert "config.json" in received and "model.safetensors" in received
    pushed = load(received["model.safetensors"])
    assert set(pushed) == set(trained)
    for name in trained:
        assert torch.equal(pushed[name], trained[name]), name


@pytest.mark.parametrize("stage", [2])
def test_zero_trainer_push_to_hub(tmp_path, trainer_ddp, stage):
    """ZeroTrainer.push_to_hub uploads full weights (gathered from the shards), equal to the stock Trainer's."""
    from hub_server import HubServer
    from safetensors.torch import load

    out = tmp_path / "zero"
    with HubServer() as hub:
        _launch_env("trainer_train.py", _hub_env(hub), "--backend", "zero", "--stage", str(stage), "--out", str(out),
                    "--push", "me/tiny-trainer")
        received = hub.repos["me/tiny-trainer"]
    assert_close_runs(out, trainer_ddp)
    pushed = load(received["model.safetensors"])
    ref = load_file(trainer_ddp / "final" / "model.safetensors")
    assert set(pushed) == set(ref)
    for name in ref:
        err = ((pushed[name].double() - ref[name].double()).norm() / ref[name].double().norm()).item()
        assert err < 1e-5, f"{name}: {err:.2e}"


def test_groups_from_the_device_mesh_tensor_parallel(tmp_path):
    """HfZeroAccelerator takes ZeRO's group ("dp") and P_a's group ("tp") from the device mesh: 4 ranks = 2 x 2;
    each TP shard trains to its slice of the dense single-process run."""
    sys.path.insert(0, HERE)
    import test_zero_r as T

    out = tmp_path / "tp"
    accelerate_launch("accel_tp_train.py", 4, str(out))
    reports = [json.load(open(out / f"rank{r}.json")) for r in range(4)]
    for rep in reports:
        t, d = rep["tp"], rep["dp"]
        assert rep["zero_group"] == [t, t + T.TP] and rep["checkpoint_group"] == [T.TP * d, T.TP * d + 1], rep
    ref_losses, ref_state = T.tp_reference()
    by = {(rep["tp"], rep["dp"]): rep for rep in reports}
    for t in range(T.TP):
        mean = (torch.tensor(by[t, 0]["losses"]) + torch.tensor(by[t, 1]["losses"])) / 2
        torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        got = load_file(out / f"tp{t}.safetensors")
        assert set(got) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(got[k], T.tp_slice(k, v, t), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ loading into shards
def _saved_trainer_model(folder):
    """The model tests/scripts/trainer_train.py builds, written by save_pretrained into several files."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, max_shard_size="40KB")
    return folder


def test_zero_trainer_trains_a_model_loaded_into_shards_like_the_trainer(tmp_path):
    """Issue #12: ZeroTrainer on hf_zero.from_pretrained (parameters on meta until prepare reads each rank's
    shards) equals the stock Trainer on Transformers' from_pretrained of the same folder."""
    folder = _saved_trainer_model(tmp_path / "pretrained")
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    ref, out = tmp_path / "ddp", tmp_path / "zero"
    accelerate_launch("trainer_train.py", 2, "--backend", "ddp", "--out", str(ref), "--from-folder", str(folder))
    accelerate_launch("trainer_train.py", 2, "--backend", "zero", "--stage", "3", "--out", str(out),
                      "--from-folder", str(folder))
    assert_close_runs(out, ref)
    assert_same_weights(out / "final" / "model.safetensors", ref / "final" / "model.safetensors")
