"""TRL's SFTTrainer with a PEFT LoRA adapter on hf_zero (the class `hf_zero.zero_trainer(trl.SFTTrainer)` makes),
through the real `accelerate launch` on 2 gloo ranks, against the stock SFTTrainer under Accelerate's DDP: same
seed and data, gradient accumulation 2, clipping, fp32. The logged losses and grad norms, and the adapter that
`trainer.save_model()` writes in PEFT's own layout (gathered from the shards at stage 3), agree within 1e-5."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from test_accelerate import accelerate_launch, assert_close_runs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "ddp"
    accelerate_launch("sft_train.py", 2, "--backend", "ddp", "--out", str(out))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sft_lora_on_hf_zero_matches_stock_sft(tmp_path, stock, stage):
    out = tmp_path / f"zero{stage}"
    accelerate_launch("sft_train.py", 2, "--backend", "zero", "--stage", str(stage), "--out", str(out))
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
