"""`python -m benchmarks.capacity` (from a checkout; formerly `hf-zero bench --capacity`): the largest Llama each
system trains within a per-rank memory budget (the paper's headline: ZeRO fits models that data parallelism cannot).
Needs root for its memory cgroups (benchmarks/README.md); without them the budget is compared, not enforced.

For each system, mode (full fine-tune, LoRA) and world size, layers are added to a Llama of fixed width and the
largest layer count that trains `--train-steps` optimizer steps within `--budget` bytes per rank is searched
(cells.py): from the estimator's prediction for the cell (estimate.py), galloping up or down until the boundary is
bracketed, then bisection (search.py: `largest_fitting`, for any monotone predicate). A good prediction costs three
or four trials, each a process launch per rank.

The budget is enforced, not compared: each rank runs in its own memory cgroup (cgroups.py: cgroup v1
`memory.limit_in_bytes`, or v2 `memory.max`) created under this process's own cgroup and joined before the rank's
interpreter starts (budget.py: a shell writes its pid into the cgroup, then execs Python), so every byte the rank
touches is charged to it. A rank that goes over is killed by the kernel's OOM killer; the cgroup's `oom_kill`
counter says so and the size is recorded as "does not fit". `--cgroups shared` puts all ranks in one cgroup of
ranks x budget (they may then lend each other memory); `--cgroups off` (or a machine without a usable memory cgroup)
runs every size unlimited and compares each rank's peak RSS (VmHWM) with the budget: the table then says so.

How each system builds its model is the way its users build one that does not fit on a rank whole (systems.py,
trainers.py); hf_zero's ranks read a random checkpoint that the parent writes one layer file at a time (weights.py:
`RandomCheckpoint`, never the whole model in memory), straight into their shards (stage 3: the rank's byte ranges
only). LoRA is PEFT's (`--lora-rank`, q_proj and v_proj). Every system trains in fp32 (this CPU has no bf16 units);
a peer may be asked for with its parameters stored in bf16 ("fsdp2:bf16"), its cheapest storage. The estimator's
prediction for the same budget is printed beside each row: the largest layer count whose model states fit, the
paper's formulas for the peers and hf_zero's own plan (plan mode) for hf_zero; model states only, so the gap to the
measurement is the runtime (Python, torch, the libraries), activations and buffers (gathered units, buckets).

`--layers L` runs each system once at L layers instead of searching (the 7B demonstration in docs/benchmarks.md:
`--shape llama7b --layers 32 --modes lora --capacity-systems zero3-int8,...`).
"""
from .budget import CGROUP_MODES, RanksOutcome, run_ranks
from .cells import Cell, search_cell, seed_layers
from .cgroups import CgroupSupport, MemoryCgroup, memory_cgroup_support
from .cli import add_capacity_arguments, add_shared_arguments, main, run_capacity
from .estimate import Estimator
from .search import Search, largest_fitting
from .systems import ALL_SYSTEMS, MODES, SHAPES, SYSTEMS, parse_modes, parse_system, parse_systems
from .table import format_table, plot_cells
from .trials import RunOptions, Trial, run_trial
from .units import parse_bytes
from .weights import RandomCheckpoint, model_config, write_safetensors

__all__ = ["ALL_SYSTEMS", "CGROUP_MODES", "Cell", "CgroupSupport", "Estimator", "MODES", "MemoryCgroup",
           "RandomCheckpoint", "RanksOutcome", "RunOptions", "SHAPES", "SYSTEMS", "Search", "Trial",
           "add_capacity_arguments", "add_shared_arguments", "format_table", "largest_fitting", "main",
           "memory_cgroup_support", "model_config", "parse_bytes", "parse_modes", "parse_system", "parse_systems",
           "plot_cells", "run_capacity", "run_ranks", "run_trial", "search_cell", "seed_layers", "write_safetensors"]
