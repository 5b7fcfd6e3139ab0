"""TRL's SFTTrainer and DPOTrainer with a PEFT LoRA adapter on hf_zero (the class `hf_zero.zero_trainer(trl.SFTTrainer)` makes),
through the real `accelerate launch` on 2 gloo ranks, against the stock SFTTrainer under Accelerate's DDP: same
seed and data, gradient accumulation 2, clipping, fp32. The logged losses and grad norms, and the adapter that
`trainer.save_model()` writes in PEFT's own layout (gathered from the shards at stage 3), agree within 1e-5."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from test_accelerate import accelerate_launch, assert_close_runs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "ddp"
    accelerate_launch("trl_train.py", 2, "--backend", "ddp", "--out", str(out))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sft_lora_on_hf_zero_matches_stock_sft(tmp_path, stock, stage):
    out = tmp_path / f"zero{stage}"
    accelerate_launch("trl_train.py", 2, "--backend", "zero", "--stage", str(stage), "--out", str(out))
    assert_close_runs(out, stock)
    ours, ref = out / "final", stock / "final"
    assert sorted(f for f in os.listdir(ours) if f.startswith("adapter")) == ["adapter_config.json",
                                                                              "adapter_model.safetensors"]
    configs = [json.load(open(d / "adapter_config.json")) for d in (ours, ref)]
    for c in configs:  # PEFT keeps target_modules as a set: its order differs between processes
        c["target_modules"] = sorted(c["target_modules"])
    assert configs[0] == configs[1]
    a, b = load_file(ours / "adapter_model.safetensors"), load_file(ref / "adapter_model.safetensors")
    assert set(a) == set(b) and len(a) == 8, sorted(set(a) ^ set(b))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def stock_dpo(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "ddp"
    accelerate_launch("trl_train.py", 2, "--backend", "ddp", "--trainer", "dpo", "--out", str(out))
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_dpo_lora_on_hf_zero_matches_stock_dpo(tmp_path, stock_dpo, stage):
    """DPO: the policy forward with the adapter and the reference forward with it disabled, on the same units,
    before one backward; at stage 3 every unit is gathered for each. Losses, grad norms and adapter as stock."""
    out = tmp_path / f"zero{stage}"
    accelerate_launch("trl_train.py", 2, "--backend", "zero", "--trainer", "dpo", "--stage", str(stage),
                      "--out", str(out))
    assert_close_runs(out, stock_dpo)
    a = load_file(out / "final" / "adapter_model.safetensors")
    b = load_file(stock_dpo / "final" / "adapter_model.safetensors")
    assert set(a) == set(b) and len(a) == 8
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_sft_resumes_from_a_checkpoint_at_the_same_and_another_world_size(tmp_path, world):
    """A ZeroSFTTrainer run (stage 2, 2 ranks) checkpointed at step 2. Resumed on 2 ranks it ends with the
    losses of steps 3-4 and the adapter of the uninterrupted run. Resumed on 3 ranks (the shards cut anew), the
    engine holds exactly the adapter the checkpoint holds when training begins again."""
    full = tmp_path / "full"
    accelerate_launch("trl_train.py", 2, "--backend", "zero", "--stage", "2", "--save-steps", "2", "--out", str(full))
    resumed = tmp_path / f"resumed{world}"
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    steps = ["--dump-resumed", "--max-steps", "3"] if world == 3 else []
    accelerate_launch("trl_train.py", world, "--backend", "zero", "--stage", "2", "--out", str(resumed),
                      "--resume", str(resumed / "checkpoint-2"), *steps)
    if world == 2:
        ours = load_file(resumed / "final" / "adapter_model.safetensors")
        after = json.load(open(resumed / "log.json"))["losses"]
        want = json.load(open(full / "log.json"))["losses"]
        torch.testing.assert_close(torch.tensor(after[-2:]), torch.tensor(want[-2:]), rtol=1e-5, atol=1e-6)
        ref = load_file(full / "final" / "adapter_model.safetensors")
    else:
        ours = {k.replace(".default.", "."): v for k, v in load_file(resumed / "resumed_adapter.safetensors").items()}
        ref = load_file(full / "checkpoint-2" / "adapter_model.safetensors")
    assert set(ours) == set(ref) and len(ours) == 8
    for key in ours:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
