"""examples/gpu_check.py runs end to end (on CPU here; its memory columns need CUDA). Every configuration trains
the same model on the same data, so ZeRO-R and offload options must leave the loss unchanged."""
import json
import os
import subprocess
import sys

import pytest

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


@pytest.mark.slow
def test_gpu_memory_check_smoke_run_on_cpu(tmp_path):
    """Smoke test of benchmarks/gpu_memory.py (issue #43's GPU check), on CPU with a tiny Llama: it runs to the end
    and its JSON carries the dry run's peak, hf_zero's and plain torch's step times and the engine's budgets."""
    out = tmp_path / "gpu_memory.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_memory", "--device", "cpu", "--tiny", "--seq", "32", "--batch", "2",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    dry, mine, plain = data["rows"]
    assert dry["dry_run_peak"] > 0 and mine["median_step_s"] > 0 and plain["median_step_s"] > 0
    stats = mine["memory_stats"]
    assert stats["comm_buffers_peak"] <= stats["comm_buffers_budget"]
