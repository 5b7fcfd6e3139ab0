"""Moved: the two namespace hosts are benchmarks/hosts.py in a checkout of hf_zero (they need root; not packaged)."""
raise ImportError("hf_zero.tools.hosts moved to benchmarks/hosts.py (benchmarks.hosts): it needs root and is not "
                  "packaged: run from a checkout of hf_zero, e.g. `from benchmarks.hosts import TwoHosts` with the "
                  "checkout's root on sys.path; see benchmarks/README.md")
