"""Comm's all-gather and reduce-scatter against torch's own collectives and a local sum, at world sizes 1-4, with
every collectives strategy.

On gloo, "auto" issues these per chunk: broadcasts, and a pairwise exchange of the chunks into scratch for the
reduce-scatter (engine/collectives/chunked.py); "flat" as one all_gather_into_tensor / reduce_scatter_tensor each,
the form NCCL runs (flat.py). The inputs are small integers
stored as floats, so every summation order gives the same bits and results can be compared exactly.
"""
import pytest
import torch
import torch.distributed as dist

from _dist import DistResults
from hf_zero.engine.buffers import BufferPool
from hf_zero.engine.comm import Comm, gloo_device_types

WORLD_SIZES = (1, 2, 3, 4)
STRATEGIES = ("auto", "flat", "chunked")
CHUNK = 37  # odd, so chunks do not line up with any power-of-two boundary


def _rank_input(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, (numel,), generator=g).float()


def collectives(rank, world_size, strategy="auto"):
    comm = Comm(collectives=strategy)
    n = CHUNK * world_size
    out = {}

    # reduce-scatter into a separate tensor, and in place into the input's own chunk
    inp = _rank_input(rank, n)
    sep = torch.empty(CHUNK)
    comm.reduce_scatter(sep, inp.clone(), "test rs").wait()
    buf = inp.clone()
    owned = buf[rank * CHUNK:(rank + 1) * CHUNK]
    done = []
    comm.reduce_scatter(owned, buf, "test rs in place", on_done=lambda: done.append(owned.clone())).wait()
    native = torch.empty(CHUNK)
    dist.reduce_scatter_tensor(native, inp.clone())
    out["rs"], out["rs_in_place"], out["rs_native"], out["rs_on_done"] = sep, owned.clone(), native, done[0]

    # all-gather from a separate shard, and in place from the output's own chunk; synchronous
    shard = _rank_input(rank, CHUNK)
    full = torch.full((n,), float("nan"))
    comm.all_gather(full, shard, "test ag").wait()
    full2 = torch.full((n,), float("nan"))
    full2[rank * CHUNK:(rank + 1) * CHUNK].copy_(shard)
    comm.all_gather(full2, full2[rank * CHUNK:(rank + 1) * CHUNK], "test ag in place", async_op=False)
    native_full = torch.empty(n)
    dist.all_gather_into_tensor(native_full, shard)
    out["ag"], out["ag_in_place"], out["ag_native"] = full, full2, native_full

    out["ledger"] = comm.snapshot()
    out["by_strategy"] = comm.ledger.by_strategy()
    out["chosen"] = comm.strategy("cpu").name

    # three reduce-scatters in flight at once, waited in issue order on odd ranks and in reverse on even ones, their
    # scratch taken from a pool: each completes whatever order ranks wait in, and the pool gets all of it back
    pool = BufferPool(0)
    comm.strategy("cpu").scratch = pool
    inputs = [_rank_input(rank + 10 * k, k * n) for k in (1, 2, 3)]
    outs = [torch.empty(k * CHUNK) for k in (1, 2, 3)]
    handles = [comm.reduce_scatter(o, i.clone(), f"test rs in flight {k}")
               for k, (o, i) in enumerate(zip(outs, inputs))]
    for h in (handles if rank % 2 else handles[::-1]):
        h.wait()
    out["rs_in_flight"], out["scratch_peak"], out["scratch_live"] = outs, pool.peak_bytes, pool.live_bytes
    comm.strategy("cpu").scratch = None
    return out


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(lambda world_size: [(f"collectives-{s}", collectives, {"strategy": s}) for s in STRATEGIES])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_equals_sum_of_every_ranks_chunk(dist_results, world_size, strategy):
    n = CHUNK * world_size
    total = sum(_rank_input(r, n) for r in range(world_size))
    for rank, res in enumerate(dist_results(world_size, f"collectives-{strategy}")):
        expected = total[rank * CHUNK:(rank + 1) * CHUNK]
        for key in ("rs", "rs_in_place", "rs_native", "rs_on_done"):
            assert torch.equal(res[key], expected), (rank, key)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatters_in_flight_complete_in_any_wait_order(dist_results, world_size, strategy):
    """Gloo's pairwise exchange posts every send and receive at issue, so three in flight complete whether a rank
    waits for them in issue order or in reverse; its scratch is the W - 1 chunks it receives, all in flight at
    once at the peak, all given back."""
    chosen = "chunked" if strategy == "auto" else strategy
    scratch = sum((world_size - 1) * k * CHUNK * 4 for k in (1, 2, 3)) if chosen == "chunked" else 0
    for rank, res in enumerate(dist_results(world_size, f"collectives-{strategy}")):
        for k, got in zip((1, 2, 3), res["rs_in_flight"]):
            total = sum(_rank_input(r + 10 * k, k * CHUNK * world_size) for r in range(world_size))
            assert torch.equal(got, total[rank * k * CHUNK:(rank + 1) * k * CHUNK]), (rank, k)
        assert (res["scratch_peak"], res["scratch_live"]) == (scratch, 0), rank


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_equals_concatenation(dist_results, world_size, strategy):
    expected = torch.cat([_rank_input(r, CHUNK) for r in range(world_size)])
    for res in dist_results(world_size, f"collectives-{strategy}"):
        for key in ("ag", "ag_in_place", "ag_native"):
            assert torch.equal(res[key], expected), key


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ledger_books_the_logical_collective(dist_results, world_size, strategy):
    """The same counts whatever the strategy, and beside them the same per strategy ("auto" is chunked on gloo)."""
    n = CHUNK * world_size
    chosen = "chunked" if strategy == "auto" else strategy
    for res in dist_results(world_size, f"collectives-{strategy}"):
        assert res["chosen"] == chosen
        ledger = res["ledger"]
        # one host: every element is intra-host
        want = {"calls": 2, "elements": 2 * n, "bytes": 2 * n * 4, "intra_elements": 2 * n, "intra_bytes": 2 * n * 4,
                "inter_elements": 0, "inter_bytes": 0}
        assert ledger["reduce_scatter"] == want
        assert ledger["all_gather"] == want
        assert set(res["by_strategy"]) == {chosen}
        mine = res["by_strategy"][chosen]
        assert mine["reduce_scatter"] == mine["all_gather"] == want
        assert mine["total"] == ledger["total"]


@pytest.mark.parametrize("backend,expected", [
    ("gloo", {"cpu", "cuda"}), ("nccl", set()), ("cpu:gloo,cuda:nccl", {"cpu"}), ("CUDA:NCCL, CPU:GLOO", {"cpu"}),
])
def test_gloo_device_types(backend, expected):
    assert gloo_device_types(backend) == expected


def test_the_option_offers_every_strategy():
    """ZeroConfig.collectives (declared in hf_zero/options, below the engine) allows exactly "auto" and the
    strategies engine/collectives registers: a new strategy file must be named in both."""
    from hf_zero.engine.collectives import CHOICES
    from hf_zero.options import OPTIONS

    option = next(o for o in OPTIONS if o.name == "collectives")
    assert set(option.kind.values) == set(CHOICES)
