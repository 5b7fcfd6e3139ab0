"""collectives/quantized.py (ZeRO++'s qwZ all-gather and qgZ reduce-scatter) at world sizes 1-4 on gloo, around the
flat and the chunked strategy, against the plain-PyTorch reference of tests/test_quantize.py: every result must be
bit-equal to what the reference computes from every rank's input (which the test process rebuilds from the seeds).

Shards of 37 elements (blocks of 16 do not divide them: a short last block per chunk) and of 32 (they do).

Also qgZ's exact slots (engine/routes.py `ExactSlots`): the rule that keeps 1-D and sub-block parameters out of the
quantization (no process), and the route over real gloo groups against the same reference.
"""
import pytest
import torch

from _dist import DistResults
from hf_zero.engine.collectives import Chunked, Flat, Quantized
from hf_zero.engine.comm import Comm, Ledger, Quantization
from hf_zero.engine.planning import GroupPlan, Slot
from hf_zero.engine.quantize import quantized_nbytes
from hf_zero.engine.routes import ExactSlots, exact_ranges, gradient_tag, keeps_exact
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


# A flat group as the planner lays one out: matrices with 1-D tensors and a sub-block matrix between them.
# (name, shape); offsets follow. The exact slots by hand: b1 [80, 90), then ln and s [135, 148).
SLOTS = (("w1", (8, 10)), ("b1", (10,)), ("w2", (5, 9)), ("ln", (7,)), ("s", (2, 3)), ("w3", (4, 6)))
EXACT_BY_HAND = [(80, 90), (135, 148)]


def group_plan(world_size):
    plan = GroupPlan(index=3, unit=1, dtype=torch.float32, trainable=True)
    for name, shape in SLOTS:
        numel = torch.Size(shape).numel()
        plan.slots.append(Slot(name, (name,), shape, torch.float32, plan.numel, numel))
        plan.numel += numel
    plan.padded_numel = -(-plan.numel // world_size) * world_size
    plan.shard_numel = plan.padded_numel // world_size
    return plan


def slot_bucket(rank, world_size):
    """Rank `rank`'s gradient bucket of group_plan: the matrices of order 1-10, the exact slots tiny multiples of
    2**-20 (so their sum is exact in any order), zero padding."""
    plan = group_plan(world_size)
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.zeros(plan.padded_numel)
    x[:plan.numel] = torch.randn(plan.numel, generator=g) * 5
    for a, b in EXACT_BY_HAND:
        x[a:b] = torch.randint(-50, 50, (b - a,), generator=g).float() * 2.0 ** -20
    return x


def exact_slots(rank, world_size):
    """ExactSlots around a quantized Comm (int8 and int4, blocks of 16) and the plain Comm, both on one ledger."""
    out = {}
    plan = group_plan(world_size)
    n = plan.shard_numel
    for bits in BITS:
        ledger = Ledger()
        quantized = Comm(ledger=ledger, quantization=Quantization(gradients_bits=bits, block_size=BLOCK))
        route = ExactSlots(quantized, Comm(ledger=ledger), [plan], BLOCK)
        bucket = slot_bucket(rank, world_size)
        owned = bucket[rank * n:(rank + 1) * n]
        done = []
        handle = route.reduce_scatter(owned, bucket, gradient_tag(plan), on_done=lambda: done.append(owned.clone()))
        before_wait = len(done)
        handle.wait()
        out[bits] = {"out": owned.clone(), "on_done": done, "before_wait": before_wait, "wire": ledger.by_strategy(),
                     "names": (quantized.strategy("cpu").name, Comm().strategy("cpu").name)}
    return out


SCENARIOS = [("collectives", quantized_collectives), ("switched_off", switched_off), ("overflow", overflow),
             ("ledger", ledger), ("exact_slots", exact_slots)]


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


# ------------------------------------------------------------------------------------------------ qgZ's exact slots
def test_qgz_keeps_1d_and_sub_block_parameters_exact():
    """DeepSpeed's rule (1-D tensors reduced unquantized) plus tensors smaller than one block, which cannot have a
    scale of their own; every matrix of a block or more is quantized, whatever its shape."""
    for shape in ((64,), (1,), (), (2, 7), (15, 1), (3, 5)):
        assert keeps_exact(shape, 16), shape
    for shape in ((4, 4), (64, 192), (1, 4096), (2, 3, 4)):
        assert not keeps_exact(shape, 16), shape
    assert keeps_exact((16, 16), 257) and not keeps_exact((16, 16), 256)


def test_exact_ranges_of_a_flat_group_merge_neighbours():
    assert exact_ranges(group_plan(3), BLOCK) == EXACT_BY_HAND
    assert exact_ranges(group_plan(3), 4) == [(80, 90), (135, 142)]  # s (6 elements) is a block or more of 4
    empty = GroupPlan(index=0, unit=0, dtype=torch.float32, trainable=True)
    empty.slots.append(Slot("w", ("w",), (4, 4), torch.float32, 0, 16))
    assert exact_ranges(empty, BLOCK) == []


def test_exact_slots_refuses_a_bucket_it_has_no_layout_for():
    """A tag that names no flat group (the reducer's tags and gradient_tag parted ways) raises before any
    collective instead of quantizing the bucket whole again."""
    route = ExactSlots(None, None, [group_plan(2)], BLOCK)
    with pytest.raises(ValueError, match="no flat group's layout"):
        route.reduce_scatter(torch.zeros(86), torch.zeros(172), "grads of group 4 (unit 1)")


def expected_exact_slots(world_size, bits, rank):
    """Chunk `rank` of the sum: at the exact slots the plain fp32 sum of every rank's values; elsewhere the
    reference's quantized chunks (exact slots zeroed before quantizing) summed in rank order in fp32."""
    plan = group_plan(world_size)
    n = plan.shard_numel
    buckets = [slot_bucket(r, world_size) for r in range(world_size)]
    zeroed = [b.clone() for b in buckets]
    for z in zeroed:
        for a, b in EXACT_BY_HAND:
            z[a:b] = 0
    parts = [ref_round_trip(z[rank * n:(rank + 1) * n], BLOCK, bits) for z in zeroed]
    want = parts[0].clone()
    for p in parts[1:]:
        want += p
    exact = sum(buckets)
    for a, b in EXACT_BY_HAND:
        lo, hi = max(a, rank * n), min(b, (rank + 1) * n)
        if lo < hi:
            want[lo - rank * n:hi - rank * n] = exact[lo:hi]
    return want


@pytest.mark.parametrize("world_size", [w for w in WORLD_SIZES if w > 1])
def test_exact_slots_are_summed_exactly_and_the_rest_quantized(dist_results, world_size):
    """Every rank's chunk equals the reference bit for bit; the tiny 1-D values, which the quantizer alone rounds
    to zero against the matrices in their blocks, arrive as their exact sum; on_done runs at wait() with out
    filled; the ledger books the quantized bucket under the quantized strategy and the exact values' all-reduce
    (2 x 23 elements, fp32) under the plain one."""
    plan = group_plan(world_size)
    n = plan.shard_numel
    exact_numel = sum(b - a for a, b in EXACT_BY_HAND)
    lost = ref_round_trip(slot_bucket(0, world_size)[80:96], BLOCK, 4)[:10]  # b1 quantized with w2's head
    assert torch.equal(lost, torch.zeros(10)), "the inputs do not show the rounding the route avoids"
    for rank, res in enumerate(dist_results(world_size, "exact_slots")):
        for bits in BITS:
            got = res[bits]
            want = expected_exact_slots(world_size, bits, rank)
            assert same_bits(got["out"], want), (rank, bits, (got["out"] - want).abs().max())
            assert got["before_wait"] == 0 and len(got["on_done"]) == 1 and same_bits(got["on_done"][0], want)
            qname, plain = got["names"]
            wire = got["wire"]
            assert set(wire) == {qname, plain}, wire
            assert wire[qname]["reduce_scatter"]["bytes"] == world_size * quantized_nbytes(n, BLOCK, bits), wire
            assert wire[qname]["reduce_scatter"]["elements"] == plan.padded_numel
            assert wire[plain]["all_reduce"]["elements"] == 2 * exact_numel, wire
            assert wire[plain]["all_reduce"]["bytes"] == 8 * exact_numel, wire
            assert wire[plain]["total"]["bytes"] == 8 * exact_numel, wire
