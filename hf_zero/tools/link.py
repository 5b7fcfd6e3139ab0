"""Moved: the link between the namespace hosts is benchmarks/link.py in a checkout of hf_zero (not packaged)."""
raise ImportError("hf_zero.tools.link moved to benchmarks/link.py (benchmarks.link): it is not packaged: run from a "
                  "checkout of hf_zero, e.g. `from benchmarks.link import parse_rate` with the checkout's root on "
                  "sys.path; see benchmarks/README.md")
