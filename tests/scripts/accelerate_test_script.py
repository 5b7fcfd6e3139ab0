"""Accelerate's own `accelerate/test_utils/scripts/test_script.py`, with HfZeroAccelerator in place of Accelerator.

argv: STAGE. Its training checks compare distributed training with one-process SGD (same seed) to 1e-6; its bf16
and fp16 sections assume Accelerate's convention (fp32 parameters under autocast), while hf_zero keeps bf16/fp16
compute copies with the fp32 master in the optimizer (see docs/mixed_precision.md): those two sections are switched off here
and the mixed-precision recipe is tested against its single-process reference in tests/test_real_code.py.
"""
import functools
import sys

import hf_zero  # noqa: F401  (first: a gloo world on CPU)
from accelerate.test_utils.scripts import test_script

from hf_zero import HfZeroAccelerator, ZeroPlugin

stage = int(sys.argv[1])
test_script.Accelerator = functools.partial(HfZeroAccelerator, zero_plugin=ZeroPlugin(stage=stage))
test_script.is_bf16_available = lambda: False
test_script.is_fp16_available = lambda: False
test_script.main()
print(f"HF_ZERO_TEST_SCRIPT_PASSED stage {stage}", flush=True)
