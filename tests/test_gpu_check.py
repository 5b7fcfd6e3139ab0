"""examples/gpu_check.py runs end to end (on CPU here; its memory columns need CUDA). Every configuration trains
the same model on the same data, so ZeRO-R and offload options must leave the loss unchanged."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke_run_on_cpu():
    cmd = [sys.executable, os.path.join(ROOT, "examples", "gpu_check.py"), "--device", "cpu", "--layers", "2",
           "--width", "64", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--warmup", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["config"]: r for r in data["rows"]}
    assert {"stage3", "stage3 +ckpt cpu", "stage3 +ckpt partitioned", "stage2 +offload opt"} <= set(rows)
    base = rows["stage2"]["loss"]
    for name, row in rows.items():
        assert abs(row["loss"] - base) <= 1e-5 * abs(base), (name, row["loss"], base)
        assert row["tokens_per_s"] > 0
        assert (row["offloaded_bytes"] > 0) == ("offload" in name), (name, row["offloaded_bytes"])
