"""Small helpers shared by the notebooks under notebooks/: parameters from the environment, free ports, per-rank
report files and saving plots.

The notebooks run top to bottom on a laptop CPU, on a GPU box and in CI; CI shrinks them through environment
variables (HF_ZERO_NB_*) read in each notebook's first cell. Ranks started by ``notebook_launcher`` cannot hand
Python objects back to the notebook, so each rank writes one JSON file and the notebook reads them all.
Matplotlib is imported inside the functions that need it: it is an optional extra (``pip install hf_zero[notebook]``).
"""
from __future__ import annotations

import json
import os
import random
import socket
from typing import Any, Dict, List, Optional

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def env_int(name: str, default: int) -> int:
    """An integer parameter from the environment (CI sets small ones), else the notebook's default."""
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    return float(value) if value else default


def output_dir(notebook: str) -> str:
    """Where a notebook writes its plots and reports: $HF_ZERO_NB_OUT if set, else ./outputs/<notebook> (ignored
    by git under notebooks/)."""
    path = os.environ.get("HF_ZERO_NB_OUT") or os.path.join("outputs", notebook)
    os.makedirs(path, exist_ok=True)
    return os.path.abspath(path)


def free_port(low: int = 20000, high: int = 32767, tries: int = 200) -> int:
    """A TCP port nobody listens on now, for MASTER_PORT. A fixed port collides with earlier launches and with other
    jobs on the machine; a port from the OS's ephemeral range (what binding port 0 gives) can be handed to another
    process's outgoing connection before the launcher binds it, so pick one below that range."""
    rng = random.Random()
    for _ in range(tries):
        port = rng.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))  # all interfaces, as the rendezvous store binds it
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {low}..{high}")


def write_rank_report(directory: str, rank: int, report: Dict[str, Any]) -> str:
    """Write one rank's results as rank<r>.json, atomically (the notebook never reads half a file)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    return path


def read_rank_reports(directory: str, world_size: Optional[int] = None) -> List[Dict[str, Any]]:
    """Every rank's report from `directory`, in rank order; with `world_size`, a missing rank is an error."""
    names = sorted((n for n in os.listdir(directory) if n.startswith("rank") and n.endswith(".json")),
                   key=lambda n: int(n[4:-5]))
    reports = []
    for name in names:
        with open(os.path.join(directory, name)) as f:
            reports.append(json.load(f))
    if world_size is not None and [r["rank"] for r in reports] != list(range(world_size)):
        raise RuntimeError(f"{directory}: expected reports from ranks 0..{world_size - 1}, found {names}")
    return reports


def save_and_show(fig: Any, path: str, dpi: int = 110) -> str:
    """Save `fig` as a PNG at `path` (for CI and for reading later) and display it in the notebook."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.show()
    return path


def is_png(path: str) -> bool:
    """True for a non-empty file that starts with the PNG signature."""
    if not os.path.isfile(path) or os.path.getsize(path) <= len(PNG_SIGNATURE):
        return False
    with open(path, "rb") as f:
        return f.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE
