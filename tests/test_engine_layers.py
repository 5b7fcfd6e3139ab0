"""The engine's layering, read from the source (no process): strategies see tensors, the topology names routes and
imports no strategy code, nothing in the engine imports Accelerate or Transformers, and the control plane answers
a one-rank world without a collective."""
import ast
from pathlib import Path

import pytest
import torch

ENGINE = Path(__file__).resolve().parents[1] / "hf_zero" / "engine"


def _imports(path: Path):
    """Every module a file imports, relative ones resolved against hf_zero.engine (or its collectives package)."""
    tree = ast.parse(path.read_text())
    package = "hf_zero.engine.collectives" if path.parent.name == "collectives" else "hf_zero.engine"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            out.add(".".join(base + ([node.module] if node.module else [])))
    return out


def test_a_strategy_imports_nothing_of_the_engine_but_quantize():
    for path in sorted((ENGINE / "collectives").glob("*.py")):
        ours = {m for m in _imports(path) if m.startswith("hf_zero")}
        assert ours <= {"hf_zero.engine.quantize"} | {m for m in ours if m.startswith("hf_zero.engine.collectives")}, \
            (path.name, ours)


def test_the_topology_names_routes_and_imports_no_strategy_code():
    ours = {m for m in _imports(ENGINE / "topology.py") if m.startswith("hf_zero")}
    assert not any(m.startswith("hf_zero.engine.collectives") or m == "hf_zero.engine.quantize" for m in ours), ours


def test_the_engine_imports_neither_accelerate_nor_transformers():
    for path in sorted(ENGINE.rglob("*.py")):
        bad = {m for m in _imports(path) if m.split(".")[0] in ("accelerate", "transformers")}
        assert not bad, (path.name, bad)


def test_a_one_rank_control_plane_answers_without_a_collective():
    from hf_zero.engine.control import LocalControl, control_for

    import torch.distributed as dist
    assert not dist.is_initialized()
    c = control_for(None)
    assert type(c) is LocalControl
    assert c.agree(None) is None and c.agree("disk full") == "rank 0: disk full"
    assert c.share({"a": 1}) == {"a": 1} and c.exchange(3) == [3]
    t = torch.arange(3.0)
    c.broadcast(t)
    assert torch.equal(t, torch.arange(3.0))
    hosts, sizes = c.hosts()
    assert len(hosts) == 1 and len(sizes) == 1


@pytest.mark.parametrize("bits", [8, 4])
def test_a_packed_shard_gathers_into_its_dequantized_values(bits):
    """The Quantized strategy over one rank (Local): an already quantized, packed shard all-gathers into the
    values quantize/dequantize give for it, in the output's dtype."""
    from hf_zero.engine.collectives import Local, Quantized
    from hf_zero.engine.quantize import dequantize, pack, quantize

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    codes, scales = quantize(x, 64, bits)
    out = torch.empty(1001, dtype=torch.bfloat16)
    Quantized(Local(None, 0, [0]), 64, bits, gradients=False).all_gather(out, pack(codes, scales), False)
    want = dequantize(codes, scales, 64, 1001, bits, dtype=torch.bfloat16)
    assert torch.equal(out, want)
