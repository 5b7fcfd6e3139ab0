"""Shared pytest setup: the repository root on sys.path, one CPU thread for the references, and the `needs_root` rule
(both markers, `slow` and `needs_root`, are declared once, in pyproject.toml).

`needs_root` tests (network namespaces: iproute2's ip / tc, unshare; memory cgroups) skip where the machine cannot
give them what they need, with a reason that starts with "needs root" and names what is missing. With
HF_ZERO_REQUIRE_ROOT_TESTS=1 (CI, which runs as root) such a skip is reported as a failure with that reason: a test
that needs root may not pass silently by skipping where root is there.
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

torch.set_num_threads(1)  # tiny models: threads only fight the gloo workers for the 2 cores


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under HF_ZERO_REQUIRE_ROOT_TESTS=1 a `needs_root` test that skipped (in its setup, body or a fixture) is
    reported as failed, with the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("needs_root") is not None
            and os.environ.get(REQUIRE_ROOT_TESTS) == "1"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} needs root and skipped under {REQUIRE_ROOT_TESTS}=1 (CI runs as root, so "
                           f"it must run there): {_skip_reason(report)}")
