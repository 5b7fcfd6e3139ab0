"""Two "hosts" on this one machine, made of Linux namespaces, for the multi-host tests: a re-export of
hf_zero/tools/hosts.py (its docstring says what each host is), which `hf-zero bench --hosts 2` uses too.

    with TwoHosts() as hosts:                       # or the `two_hosts` fixture of tests/test_multihost.py
        port = hosts.free_port(0)
        a, b = hosts.run([cmd_for_host_a, cmd_for_host_b], env={"X": "1"}, timeout=300)
        rc, out, err = a                            # each result unpacks as (returncode, stdout, stderr)

`TwoHosts(link_rate="200mbit")` limits each direction of the link between the hosts (tc's tbf on each veth end);
`TwoHosts()` raises `HostsUnavailable` (with the reason) where namespaces cannot be made, and the tests skip on it.
"""
from __future__ import annotations

import os

from hf_zero.tools.hosts import (SETUP_TIMEOUT_S, HostRun, HostsTimeout, HostsUnavailable, TwoHosts, base_env,
                                 parse_rate, run_local, wait_all, worker_logs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

__all__ = ["ROOT", "SETUP_TIMEOUT_S", "HostRun", "HostsTimeout", "HostsUnavailable", "TwoHosts", "base_env",
           "parse_rate", "run_local", "wait_all", "worker_logs"]
