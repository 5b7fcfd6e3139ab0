"""`hf-zero bench --lockstep`: the systems interleaved step by step in one process group (bench/lockstep.py).

The end-to-end run (3 ranks: padding) checks what interleaving could break: every system, built beside the others
in the same processes, trains step for step like DDP (the independent reference) on the same batches. The rest
spawns nothing: which systems cannot be interleaved, the arguments it refuses, the table.
"""
import json
import os
import subprocess
import sys

import pytest

from hf_zero.tools.bench import cli
from hf_zero.tools.bench.lockstep import format_lockstep_table, unsupported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, WARMUP = 3, 1


@pytest.mark.slow
def test_interleaved_systems_train_step_for_step_like_ddp(tmp_path):
    out = tmp_path / "lockstep.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_zero.cli", "bench", "--lockstep", "--preset", "tiny", "--num-processes", "3",
         "--systems", "zero1,zero3,fsdp2,deepspeed_zero2", "--steps", str(STEPS), "--warmup", str(WARMUP),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ddp", "zero1", "zero3", "fsdp2", "deepspeed_zero2"}  # DDP added: the baseline
    assert rows["deepspeed_zero2"]["status"] == "skipped" and "DeepSpeed" in rows["deepspeed_zero2"]["reason"]
    ddp = rows["ddp"]["losses"]
    assert len(ddp) == WARMUP + STEPS
    for name in ("zero1", "zero3", "fsdp2"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["losses"] == pytest.approx(ddp, rel=1e-5, abs=1e-6), name
        assert 0 < row["step_ms_p25"] <= row["step_ms_median"] <= row["step_ms_p75"]
        assert row["x_ddp"] > 0
    assert rows["ddp"]["x_ddp"] == 1.0  # the median of DDP's own per-round ratios
    assert "x DDP" in proc.stdout and "zero3" in proc.stdout


@pytest.mark.parametrize("system,reason", [("deepspeed_zero3", "DeepSpeed"), ("zero3+compile", "--compile"),
                                           ("zero3", None), ("fsdp2", None), ("zero3-hpz", None)])
def test_which_systems_can_be_interleaved(system, reason):
    got = unsupported(system)
    assert (got is None) if reason is None else (reason in got)


@pytest.mark.parametrize("extra,named", [(["--compile"], "--compile"), (["--profile", "p"], "--profile")])
def test_lockstep_refuses_what_it_cannot_interleave(extra, named, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--lockstep", "--preset", "tiny", *extra])
    assert cli.run(args) == 2
    err = capsys.readouterr().err
    assert "--lockstep" in err and named in err


def test_table_lists_each_system_with_its_ratio_or_status():
    rows = [{"system": "ddp", "status": "ok", "step_ms_median": 100.0, "step_ms_p25": 99.0, "step_ms_p75": 101.5,
             "x_ddp": 1.0},
            {"system": "zero3", "status": "ok", "step_ms_median": 110.0, "step_ms_p25": 108.0, "step_ms_p75": 115.0,
             "x_ddp": 0.912},
            {"system": "deepspeed_zero3", "status": "skipped"}]
    lines = format_lockstep_table(rows).splitlines()
    assert lines[2].split() == ["ddp", "100.0", "99.0-101.5", "1.000", "ok"]
    assert lines[3].split() == ["zero3", "110.0", "108.0-115.0", "0.912", "ok"]
    assert lines[4].split() == ["deepspeed_zero3", "skipped"]
