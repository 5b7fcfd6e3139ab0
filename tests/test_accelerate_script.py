"""Accelerate's own test script (`accelerate/test_utils/scripts/test_script.py`) through the real `accelerate
launch` on 2 gloo ranks, with HfZeroAccelerator in place of Accelerator.

Stages 1 and 2 must pass it: its training checks compare against one-process SGD on the same data. At stage 3 the
script reads `model.a` of the unwrapped model after training, outside any forward: hf_zero must answer with its
Python error naming the parameter (the values are partitioned), never with a signal (it used to die by SIGSEGV).
"""
import os
import re
import subprocess
import sys

import pytest

from test_accelerate import _env, _free_port

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "accelerate_test_script.py")


def _launch(stage):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), SCRIPT, str(stage)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("stage", [1, 2])
def test_accelerate_test_script_passes(stage):
    res = _launch(stage)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert out.count(f"HF_ZERO_TEST_SCRIPT_PASSED stage {stage}") == 2, out[-3000:]
    assert "Training yielded the same results on one CPU or distributed setup with batch split." in out


def test_accelerate_test_script_stage3_ends_in_a_python_error_not_a_signal():
    res = _launch(3)
    out = res.stdout + res.stderr
    if res.returncode == 0:
        assert out.count("HF_ZERO_TEST_SCRIPT_PASSED stage 3") == 2, out[-3000:]
        return
    assert "ParameterNotGatheredError" in out, out[-6000:]
    assert "gathered_parameters" in out and "a is partitioned" in out, out[-6000:]
    # torchrun reports each worker's exit code; once one worker failed it stops the others with SIGTERM (-15).
    # A crash is any other signal (SIGSEGV -11, SIGABRT -6, ...).
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]
    assert codes and 1 in codes and all(c in (1, -15) for c in codes), (codes, out[-6000:])
