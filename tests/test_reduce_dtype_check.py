"""examples/reduce_dtype_check.py runs end to end on 2 gloo ranks. Step 0 starts from the same weights and data in
both runs, so the fp32 reduce must equal the one-process reference there up to bf16 compute noise, and the fp32
run must send exactly twice the reduce-scatter bytes of the bf16 run (same elements, 4 vs 2 bytes)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_reduce_dtype_check_smoke_run():
    cmd = [sys.executable, os.path.join(ROOT, "examples", "reduce_dtype_check.py"), "--world-size", "2",
           "--steps", "2", "--seq-len", "16"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["fp32"]["reduce_scatter_bytes"] == 2 * data["compute"]["reduce_scatter_bytes"] > 0
    assert 0 < data["step0_grad_rel_err_bf16_vs_fp32"] < 2e-2
    assert data["fp32"]["max_loss_dev"] < 1e-2 and data["compute"]["max_loss_dev"] < 1e-2
