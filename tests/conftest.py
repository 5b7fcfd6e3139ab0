"""Shared pytest setup: the `slow` marker, the repository root on sys.path, one CPU thread for the references."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # `import hf_zero` without installing; spawned workers inherit sys.path

torch.set_num_threads(1)  # tiny models: threads only fight the gloo workers for the 2 cores


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than 60 s; deselect with -m 'not slow'")
