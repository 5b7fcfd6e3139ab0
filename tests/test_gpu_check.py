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


def _long_context_run(tmp_path, *extra):
    out = tmp_path / "gpu_long_context.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_long_context", "--device", "cpu", "--tiny", "--json", str(out),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_gpu_long_context_smoke_run_on_cpu(tmp_path):
    """Smoke test of benchmarks/gpu_long_context.py (issue #44's GPU check), on CPU with a tiny Llama: every trial
    of both systems fits up to the cap (64..256), hf_zero's step-1 loss is plain's within bf16's tolerance, and the
    trials show what the check relies on: hf_zero's logits are the last position's only (the tiled loss ran), and
    no attention got a materialised mask (sdpa's causal mode, no S x S tensor)."""
    data = _long_context_run(tmp_path)
    plain, mine = data["systems"]["plain"], data["systems"]["hf_zero"]
    assert [t["seq"] for t in plain["trials"]] == [64, 128, 256]
    assert [t["seq"] for t in mine["trials"]] == [64, 256]  # the check's length, then plain's longest onwards
    assert data["summary"]["plain"] == data["summary"]["hf_zero"] == 256
    assert data["summary"]["limited_by"] == {"plain": "cap", "hf_zero": "cap"}
    for t in plain["trials"] + mine["trials"]:
        assert t["status"] == "fit" and len(t["losses"]) == 2 and all(s > 0 for s in t["step_s"]), t
        assert t["attention_mask"] is None, t
        tiled = t["system"] == "hf_zero"
        assert t["logits_shape"] == [1, 1 if tiled else t["seq"], 512], t
    check = data["loss_check"]["hf_zero"]
    assert check["ok"] and check["seq"] == 64 and check["diff_rel"][0] <= 1e-2


@pytest.mark.slow
def test_gpu_long_context_losses_equal_plain_in_fp32(tmp_path):
    """The check's hf_zero systems (tiled loss and MLP over 4 tiles, CPU checkpoints, stage 3; with and without the
    optimizer offloaded) train the model plain Transformers trains: in fp32 both steps' losses equal plain's, and
    step 2's differs from step 1's (the first step's update reached the loss)."""
    data = _long_context_run(tmp_path, "--precision", "fp32", "--systems", "plain,hf_zero,hf_zero_offload",
                             "--start", "128", "--max-seq", "128")
    plain = data["systems"]["plain"]["trials"][0]["losses"]
    assert abs(plain[1] - plain[0]) > 1e-3
    for system in ("hf_zero", "hf_zero_offload"):
        losses = data["systems"][system]["trials"][0]["losses"]
        for mine, ref in zip(losses, plain, strict=True):
            assert abs(mine - ref) <= 1e-5 * abs(ref), (system, losses, plain)
        assert data["loss_check"][system]["ok"]


def _fake_trials(limit, clock=None, setup_s=5.0, seconds_per_token2=0.0):
    """A stand-in for one GPU trial: fits iff seq <= limit; each trial advances `clock` by its setup and 2 steps."""
    calls = []

    def run(seq, timeout_s):
        calls.append(seq)
        step = seconds_per_token2 * seq * seq
        if clock is not None:
            clock[0] += setup_s + 2 * step
        fit = seq <= limit
        return {"seq": seq, "status": "fit" if fit else "oom", "step_s": [step, step] if fit else [],
                "wall_s": setup_s + 2 * step}

    return run, calls


def test_gpu_long_context_search_bisects_to_the_memory_limit():
    from benchmarks.gpu_long_context import search

    run, calls = _fake_trials(100_000)
    result = search(run, 8192, 1 << 22, deadline=1e9, bisections=2, granule=1024, now=lambda: 0.0)
    assert calls == [8192, 16384, 32768, 65536, 131072, 98304, 114688]
    assert (result["longest_fit"], result["first_fail"], result["limited_by"]) == (98304, 114688, "memory")
    run, calls = _fake_trials(5000)  # the start does not fit: halve, then bisect
    result = search(run, 8192, 1 << 22, deadline=1e9, bisections=2, granule=1024, now=lambda: 0.0)
    assert calls == [8192, 4096, 6144, 5120]
    assert (result["longest_fit"], result["first_fail"]) == (4096, 5120)
    run, calls = _fake_trials(1 << 30)
    result = search(run, 64, 256, deadline=1e9, now=lambda: 0.0)
    assert calls == [64, 128, 256] and result["limited_by"] == "cap" and result["first_fail"] is None


def test_gpu_long_context_search_stays_within_its_budget():
    """Step time grows as S^2 (attention): the search skips the trial that would overrun the budget instead of
    starting it, and reports the longest length it established."""
    from benchmarks.gpu_long_context import search

    clock = [0.0]
    run, calls = _fake_trials(1 << 30, clock, setup_s=5.0, seconds_per_token2=1e-9)
    result = search(run, 8192, 1 << 22, deadline=100.0, now=lambda: clock[0])
    assert calls == [8192, 16384, 32768, 65536, 131072]  # 256K would take 5 + 2 * 68.7 s, with 29 s left
    assert clock[0] <= 100.0
    assert (result["longest_fit"], result["limited_by"]) == (131072, "budget")
    skipped = result["trials"][-1]
    assert skipped["seq"] == 262144 and skipped["status"] == "skipped" and skipped["predicted_s"] > skipped["left_s"]
