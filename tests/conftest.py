"""Shared pytest setup: the repository root on sys.path, one CPU thread for the references, and the rule of the
markers whose skip CI counts as a failure (every marker, `slow` included, is declared once, in pyproject.toml).

- `needs_root` tests (network namespaces: iproute2's ip / tc, unshare; memory cgroups) skip where the machine cannot
  give them what they need, with a reason that starts with "needs root" and names what is missing. With
  HF_ZERO_REQUIRE_ROOT_TESTS=1 (CI, which runs as root) such a skip is reported as a failure with that reason.
- `needs_deepspeed` tests (real DeepSpeed checkpoints, DeepSpeed's own config parser) skip where DeepSpeed does not
  import, naming why. With HF_ZERO_REQUIRE_DEEPSPEED_TESTS=1 (CI, which installs the `bench` extra that pins it)
  such a skip is reported as a failure with that reason.
- `needs_extras` tests (the notebooks, the bench's plot) skip where matplotlib or the notebook packages do not
  import. With HF_ZERO_REQUIRE_EXTRAS_TESTS=1 (CI, which installs both extras) such a skip is a failure.

A test that needs what CI has may not pass CI silently by skipping (tests/test_conftest_rules.py checks the rule).
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    # `import hf_zero` without installing and `import benchmarks` (the checkout's root-only benchmarks, never
    # installed); spawned workers inherit sys.path
    sys.path.insert(0, ROOT)
REQUIRE_ROOT_TESTS = "HF_ZERO_REQUIRE_ROOT_TESTS"
REQUIRE_DEEPSPEED_TESTS = "HF_ZERO_REQUIRE_DEEPSPEED_TESTS"
REQUIRE_EXTRAS_TESTS = "HF_ZERO_REQUIRE_EXTRAS_TESTS"
# marker -> (the variable under which its skip fails, what the test needs, why it must run where the variable is set)
REQUIRED_MARKERS = {
    "needs_root": (REQUIRE_ROOT_TESTS, "needs root", "CI runs as root, so it must run there"),
    "needs_deepspeed": (REQUIRE_DEEPSPEED_TESTS, "needs DeepSpeed",
                        "CI installs the `bench` extra, which pins DeepSpeed, so it must run there"),
    "needs_extras": (REQUIRE_EXTRAS_TESTS, "needs the notebook / bench extras",
                     "CI installs the `notebook` and `bench` extras, so it must run there"),
}

torch.set_num_threads(1)  # tiny models: threads only fight the gloo workers for the 2 cores


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A `needs_root` / `needs_deepspeed` / `needs_extras` test that skipped (in its setup, body or a fixture) under its variable set
    to 1 (REQUIRED_MARKERS) is reported as failed, with the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    for marker, (variable, needs, why) in REQUIRED_MARKERS.items():
        if item.get_closest_marker(marker) is not None and os.environ.get(variable) == "1":
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid} {needs} and skipped under {variable}=1 ({why}): {_skip_reason(report)}"
            return
