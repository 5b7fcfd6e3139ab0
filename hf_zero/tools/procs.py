"""Moved: the namespace hosts' process helpers are benchmarks/procs.py in a checkout of hf_zero (not packaged)."""
raise ImportError("hf_zero.tools.procs moved to benchmarks/procs.py (benchmarks.procs): it is not packaged: run from "
                  "a checkout of hf_zero, e.g. `from benchmarks.procs import run_local` with the checkout's root on "
                  "sys.path; see benchmarks/README.md")
