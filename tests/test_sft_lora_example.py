"""examples/sft_lora.py --tiny through the real `accelerate launch` on 2 gloo ranks at stage 3: LoRA SFT through
trl.SFTTrainer on hf_zero. The adapter it saves (gathered from the shards) must be what PeftModel.from_pretrained
reads back, tensor for tensor; the merged export must give the adapter model's logits; the eval loss must drop."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from test_example import _free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sft_lora_example_tiny_stage3(tmp_path):
    env = dict(os.environ, ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf_home"),
               HF_ZERO_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    env.pop("HF_ZERO_CONFIG_FILE", None)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), os.path.join(ROOT, "examples", "sft_lora.py"), "--tiny",
           "--output_dir", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "hf_zero LoRA SFT summary | ZeRO stage 3 | 2 process(es)" in proc.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["adapter_reload_equal"] is True
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(s["adapter_files"])
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert sum(v.numel() for v in adapter.values()) == s["trainable_params"]
    assert s["merged_logits_max_abs_diff"] < 1e-4
    assert s["eval_loss_after"] < s["eval_loss_before"], s
    assert len(s["losses"]) == 8
