"""Moved: the two-host bench (`hf-zero bench --hosts 2`) is benchmarks/two_hosts.py in a checkout of hf_zero (its
network namespaces need root; not packaged)."""
raise ImportError("hf_zero.tools.bench.multihost moved to benchmarks/two_hosts.py (benchmarks.two_hosts): it needs "
                  "root and is not packaged: run from a checkout of hf_zero as `python -m benchmarks.two_hosts "
                  "--hosts 2 [--link-rate R]` with bench's flags; see benchmarks/README.md")
