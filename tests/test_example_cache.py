"""The example's cache (examples/data_utils.py: on_main_then_all) must not change the run's random stream: the
first run on a fresh machine builds the model (SmolLM2 converted from GGUF, whose `from_config` initialises
weights from the global RNG) and the next ones find it, and both must shuffle the data the same way, or a user
comparing two runs with the same seed sees different losses from the first step."""
from __future__ import annotations

import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import data_utils  # noqa: E402


def _draws():
    return torch.rand(4).tolist(), random.random()


def test_building_the_cache_leaves_the_random_stream_as_finding_it_does(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    try:
        _check_the_stream(accelerator, tmp_path)
    finally:  # Accelerate's state is a per-process singleton: later tests in this process build their own
        AcceleratorState._reset_state(reset_partial_state=True)


def _check_the_stream(accelerator, tmp_path):

    def build(out):  # a model initialised from the global RNG, as convert_smollm2's from_config does
        torch.nn.Linear(64, 64)
        random.random()
        (out / "config.json").write_text("{}")

    streams = []
    for _ in range(2):  # first call builds, second finds the folder
        torch.manual_seed(42)
        random.seed(42)
        data_utils.on_main_then_all(accelerator, tmp_path / "model", "config.json", build, "a model")
        streams.append(_draws())
    assert (tmp_path / "model" / "config.json").is_file()
    assert streams[0] == streams[1]
