"""collectives/quantized.py (ZeRO++'s qwZ all-gather and qgZ reduce-scatter) at world sizes 1-4 on gloo, around the
flat and the chunked strategy, against the plain-PyTorch reference of tests/test_quantize.py: every result must be
bit-equal to what the reference computes from every rank's input (which the test process rebuilds from the seeds).

Shards of 37 elements (blocks of 16 do not divide them: a short last block per chunk) and of 32 (they do).
"""
import pytest
import torch

from _dist import DistResults
from hf_zero.engine.collectives import Chunked, Flat, Quantized
from hf_zero.engine.comm import Comm
from test_quantize import ref_round_trip, same_bits

WORLD_SIZES = (1, 2, 3, 4)
INNERS = {"flat": Flat, "chunked": Chunked}
BITS = (8, 4)
BLOCK = 16
CHUNKS = (37, 32)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAN = float("nan")


def shard_input(rank, numel, dtype, salt=0):
    """Rank `rank`'s values: normal, magnitudes spread over orders of magnitude, in `dtype`."""
    g = torch.Generator().manual_seed(1000 * rank + 7 * numel + salt)
    return (torch.randn(numel, generator=g) * torch.logspace(-2, 2, numel)).to(dtype)


def grad_input(rank, world_size, chunk, dtype, overflow=False):
    """Rank `rank`'s reduce-scatter input: `world_size` chunks of `chunk`."""
    x = shard_input(rank, world_size * chunk, dtype, salt=1)
    if overflow and rank == 1:  # rank 1's gradient overflowed at element 3 of every chunk
        x.view(world_size, chunk)[:, 3] = float("inf")
    return x


# ------------------------------------------------------------------------------------------------------ the workers
def _all_cases(rank, world_size, inner, bits, chunk, dtype, out, key):
    w = world_size
    own = slice(rank * chunk, (rank + 1) * chunk)
    shard = shard_input(rank, chunk, dtype)
    full = torch.full((w * chunk,), NAN, dtype=dtype)
    q = Quantized(inner, BLOCK, bits)
    q.all_gather(full, shard.clone(), async_op=True).wait()
    in_place = torch.full((w * chunk,), NAN, dtype=dtype)
    in_place[own].copy_(shard)
    q.all_gather(in_place, in_place[own], async_op=False)

    inp = grad_input(rank, w, chunk, dtype)
    rs = torch.full((chunk,), NAN, dtype=dtype)
    done = []
    handle = q.reduce_scatter(rs, inp.clone(), True, lambda: done.append(rs.clone()))
    before_wait = len(done)
    handle.wait()
    buf = inp.clone()
    owned = buf[own]
    q.reduce_scatter(owned, buf, False, None)
    out[key] = {"ag": full, "ag_in_place": in_place, "rs": rs, "rs_on_done": done[0] if done else None,
                "rs_on_done_before_wait": before_wait, "rs_in_place": owned.clone()}


def quantized_collectives(rank, world_size):
    out = {}
    group_ranks = list(range(world_size))
    for name, cls in INNERS.items():
        inner = cls(None, rank, group_ranks)
        for bits in BITS:
            for chunk in CHUNKS:
                for dname, dtype in DTYPES.items():
                    _all_cases(rank, world_size, inner, bits, chunk, dtype, out, (name, bits, chunk, dname))
    return out


def switched_off(rank, world_size):
    """Quantized with weights / gradients off, next to the inner strategy's own results on the same inputs."""
    out = {}
    w, chunk = world_size, 37
    own = slice(rank * chunk, (rank + 1) * chunk)
    for name, cls in INNERS.items():
        inner = cls(None, rank, list(range(w)))
        for weights, gradients in ((False, False), (False, True), (True, False)):
            q = Quantized(inner, BLOCK, 8, weights=weights, gradients=gradients)
            res = {}
            for who, strategy in (("q", q), ("inner", inner)):
                shard = shard_input(rank, chunk, torch.bfloat16)
                full = torch.full((w * chunk,), NAN, dtype=torch.bfloat16)
                full[own].copy_(shard)
                strategy.all_gather(full, full[own], True).wait()
                rs = torch.full((chunk,), NAN, dtype=torch.bfloat16)
                strategy.reduce_scatter(rs, grad_input(rank, w, chunk, torch.bfloat16), True, None).wait()
                res[who] = {"ag": full, "rs": rs}
            out[(name, weights, gradients)] = res
        # integer tensors are never quantized
        ints = torch.arange(5, dtype=torch.int64) + 10 * rank
        gathered = torch.zeros(5 * w, dtype=torch.int64)
        Quantized(inner, BLOCK, 4).all_gather(gathered, ints, True).wait()
        out[(name, "ints")] = gathered
    return out


def overflow(rank, world_size):
    """fp16 gradients, one rank's overflowed: the owner's block holding it comes out nan, the rest finite."""
    out = {}
    chunk = 37
    for bits in BITS:
        q = Quantized(Flat(None, rank, list(range(world_size))), BLOCK, bits)
        rs = torch.full((chunk,), 0.0, dtype=torch.float16)
        q.reduce_scatter(rs, grad_input(rank, world_size, chunk, torch.float16, overflow=True), True, None).wait()
        out[bits] = rs
    return out


def ledger(rank, world_size):
    """The same collectives through a Comm whose cpu strategy is Quantized: its ledger, and the all-reduce."""
    out = {}
    for name, cls in INNERS.items():
        for bits in BITS:
            for chunk in CHUNKS:
                for weights in (True, False):
                    comm = Comm()
                    strategy = Quantized(cls(comm.group, comm.rank, comm.global_ranks), BLOCK, bits, weights=weights)
                    comm._strategies["cpu"] = strategy
                    full = torch.zeros(world_size * chunk, dtype=torch.bfloat16)
                    comm.all_gather(full, shard_input(rank, chunk, torch.bfloat16), "ag").wait()
                    rs = torch.zeros(chunk)
                    comm.reduce_scatter(rs, grad_input(rank, world_size, chunk, torch.float32), "rs").wait()
                    summed = torch.full((chunk,), float(rank + 1))
                    comm.all_reduce(summed, "ar").wait()
                    out[(name, bits, chunk, weights)] = {"snapshot": comm.snapshot(), "name": strategy.name,
                                                         "by_strategy": comm.ledger.by_strategy(), "ar": summed}
    return out


SCENARIOS = [("collectives", quantized_collectives), ("switched_off", switched_off), ("overflow", overflow),
             ("ledger", ledger)]


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(lambda world_size: [(name, fn, {}) for name, fn in SCENARIOS])


# ------------------------------------------------------------------------------------------------------ references
def expected_all_gather(world_size, bits, chunk, dtype):
    """Every rank's shard through the reference's quantize -> dequantize (fp32), concatenated, cast once."""
    return torch.cat([ref_round_trip(shard_input(r, chunk, dtype), BLOCK, bits)
                      for r in range(world_size)]).to(dtype)


def expected_reduce_scatter(world_size, bits, chunk, dtype, rank, overflowed=False):
    """Sum over ranks 0..W-1, in that order and in fp32, of each rank's chunk `rank` through the reference."""
    parts = [ref_round_trip(grad_input(r, world_size, chunk, dtype, overflowed)[rank * chunk:(rank + 1) * chunk],
                            BLOCK, bits) for r in range(world_size)]
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc.to(dtype)


# ------------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_equals_every_ranks_dequantized_shard(dist_results, world_size, inner, bits):
    results = dist_results(world_size, "collectives")
    for chunk in CHUNKS:
        for dname, dtype in DTYPES.items():
            want = expected_all_gather(world_size, bits, chunk, dtype)
            assert not torch.equal(want, torch.cat([shard_input(r, chunk, dtype) for r in range(world_size)]))
            for rank, res in enumerate(results):
                got = res[(inner, bits, chunk, dname)]
                assert same_bits(got["ag"], want), (rank, chunk, dname)
                assert same_bits(got["ag_in_place"], want), (rank, chunk, dname, "in place")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_equals_the_fp32_sum_of_dequantized_chunks(dist_results, world_size, inner, bits):
    results = dist_results(world_size, "collectives")
    for chunk in CHUNKS:
        for dname, dtype in DTYPES.items():
            for rank, res in enumerate(results):
                want = expected_reduce_scatter(world_size, bits, chunk, dtype, rank)
                got = res[(inner, bits, chunk, dname)]
                assert torch.isfinite(want).all()
                assert same_bits(got["rs"], want), (rank, chunk, dname)
                assert same_bits(got["rs_in_place"], want), (rank, chunk, dname, "in place")
                # on_done ran at wait(), not before, and saw out already filled
                assert got["rs_on_done_before_wait"] == 0
                assert got["rs_on_done"] is not None and same_bits(got["rs_on_done"], want), (rank, chunk, dname)


@pytest.mark.parametrize("world_size", [w for w in WORLD_SIZES if w >= 3])  # two bf16 addends round like their fp32 sum
def test_the_sum_is_taken_in_fp32_not_in_the_gradient_dtype(world_size):
    """The reference's fp32 sum differs from a bf16 sum of the same chunks somewhere (else the test above could not
    tell them apart)."""
    chunk = 37
    for rank in range(world_size):
        parts = [ref_round_trip(grad_input(r, world_size, chunk, torch.bfloat16)[rank * chunk:(rank + 1) * chunk],
                                BLOCK, 8).to(torch.bfloat16) for r in range(world_size)]
        low = parts[0]
        for p in parts[1:]:
            low = low + p
        if not torch.equal(low, expected_reduce_scatter(world_size, 8, chunk, torch.bfloat16, rank)):
            return
    pytest.fail("the bf16 and fp32 sums agree everywhere: pick other inputs")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_overflow_on_one_rank_is_nan_in_its_block_after_the_reduction(dist_results, world_size):
    results = dist_results(world_size, "overflow")
    for bits in BITS:
        for rank, res in enumerate(results):
            want = expected_reduce_scatter(world_size, bits, 37, torch.float16, rank, overflowed=world_size > 1)
            got = res[bits]
            assert same_bits(got, want), (rank, bits)
            if world_size > 1:  # element 3 is in block 0 (elements 0-15): that block nan, the others finite
                assert torch.isnan(got[:16]).all() and torch.isfinite(got[16:]).all(), (rank, bits)


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_switched_off_is_the_inner_strategy_bit_for_bit(dist_results, world_size, inner):
    results = dist_results(world_size, "switched_off")
    exact = torch.cat([shard_input(r, 37, torch.bfloat16) for r in range(world_size)])
    for rank, res in enumerate(results):
        for weights, gradients in ((False, False), (False, True), (True, False)):
            got = res[(inner, weights, gradients)]
            assert torch.equal(got["inner"]["ag"], exact)
            if not weights:
                assert torch.equal(got["q"]["ag"], got["inner"]["ag"]), (rank, weights, gradients)
            else:
                assert same_bits(got["q"]["ag"], expected_all_gather(world_size, 8, 37, torch.bfloat16))
            if not gradients:
                assert torch.equal(got["q"]["rs"], got["inner"]["rs"]), (rank, weights, gradients)
            else:
                want = expected_reduce_scatter(world_size, 8, 37, torch.bfloat16, rank)
                assert same_bits(got["q"]["rs"], want)
        ints = torch.cat([torch.arange(5) + 10 * r for r in range(world_size)])
        assert torch.equal(res[(inner, "ints")], ints)


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_ledger_books_paper_elements_and_the_quantized_bytes(dist_results, world_size, inner):
    """Paper counting in the kinds as with every strategy; under the strategy's name the bytes really sent: per rank
    chunk its codes (numel bytes at 8 bits, ceil(numel / 2) at 4) plus 4 bytes per block of 16."""
    w = world_size
    for rank, res in enumerate(dist_results(world_size, "ledger")):
        for bits in BITS:
            for chunk in CHUNKS:
                for weights in (True, False):
                    got = res[(inner, bits, chunk, weights)]
                    n = w * chunk
                    snap, name = got["snapshot"], got["name"]
                    assert name == f"quantized-int{bits}"
                    assert snap["all_gather"]["elements"] == n and snap["all_gather"]["bytes"] == 2 * n  # bf16
                    assert snap["reduce_scatter"]["elements"] == n and snap["reduce_scatter"]["bytes"] == 4 * n
                    assert snap["all_reduce"]["elements"] == 2 * chunk and snap["all_reduce"]["bytes"] == 8 * chunk
                    per_chunk = (chunk if bits == 8 else (chunk + 1) // 2) + 4 * -(-chunk // BLOCK)
                    mine = got["by_strategy"][name]
                    assert set(got["by_strategy"]) == {name}
                    assert mine["reduce_scatter"]["bytes"] == w * per_chunk
                    assert mine["all_gather"]["bytes"] == (w * per_chunk if weights else 2 * n)
                    assert mine["all_reduce"]["bytes"] == 8 * chunk  # the inner's, never quantized
                    assert mine["reduce_scatter"]["elements"] == n and mine["all_gather"]["calls"] == 1
                    assert torch.equal(got["ar"], torch.full((chunk,), float(w * (w + 1) // 2)))
