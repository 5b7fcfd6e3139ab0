"""Two "hosts" on this one machine, made of Linux namespaces, for the multi-host tests: a re-export of
benchmarks/hosts.py (its docstring says what each host is), which `python -m benchmarks.two_hosts` uses too.

    with two_hosts_or_skip() as hosts:              # or the `two_hosts` fixture of tests/test_multihost.py
        port = hosts.free_port(0)
        a, b = hosts.run([cmd_for_host_a, cmd_for_host_b], env={"X": "1"}, timeout=300)
        rc, out, err = a                            # each result unpacks as (returncode, stdout, stderr)

`TwoHosts(link_rate="200mbit")` limits each direction of the link between the hosts (tc's tbf on each veth end);
`TwoHosts()` raises `HostsUnavailable` (with the reason) where namespaces cannot be made; `two_hosts_or_skip` then
skips the test with a reason that starts with "needs root" and names what is missing. Such tests carry the
`needs_root` marker (CI, root, fails them when they skip: tests/conftest.py).
"""
from __future__ import annotations

import os

import pytest

from benchmarks.hosts import (SETUP_TIMEOUT_S, HostRun, HostsTimeout, HostsUnavailable, TwoHosts, base_env, parse_rate,
                              run_local, wait_all, worker_logs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

__all__ = ["ROOT", "SETUP_TIMEOUT_S", "HostRun", "HostsTimeout", "HostsUnavailable", "TwoHosts", "base_env",
           "parse_rate", "run_local", "skip_reason", "two_hosts_or_skip", "wait_all", "worker_logs"]


def skip_reason(exc: HostsUnavailable, link_rate=None) -> str:
    """Why a test that needs the two hosts skips: what they need, then what is missing here (the exception's
    message: not root, which tool is not installed, or what `ip` / `unshare` / `tc` refused)."""
    tools = "iproute2's `ip`" + (" and `tc`" if link_rate is not None else "") + " and util-linux's `unshare`"
    return f"needs root, {tools} (two network-namespace hosts): {exc}"


def two_hosts_or_skip(**kwargs) -> TwoHosts:
    """`TwoHosts(**kwargs)`, or the test skips (`skip_reason`) where they cannot be made."""
    try:
        return TwoHosts(**kwargs)
    except HostsUnavailable as exc:
        pytest.skip(skip_reason(exc, kwargs.get("link_rate")))
