"""Moved: the capacity table (`hf-zero bench --capacity`) is benchmarks/capacity/ in a checkout of hf_zero (its memory
cgroups need root; not packaged)."""
raise ImportError("hf_zero.tools.bench.capacity moved to benchmarks/capacity/ (benchmarks.capacity): it needs root "
                  "and is not packaged: run from a checkout of hf_zero as `python -m benchmarks.capacity` with the "
                  "same capacity flags; see benchmarks/README.md")
