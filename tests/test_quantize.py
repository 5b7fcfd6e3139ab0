"""engine/quantize.py (ZeRO++'s block quantization) against a reference written here in plain PyTorch, one Python
loop iteration per block, and against the format's own bounds. No processes.

`ref_quantize` / `ref_dequantize` / `ref_pack4` are the independent reference; tests/test_quantized_collectives.py
imports them too.
"""
import math

import pytest
import torch

from hf_zero.engine.quantize import (ErrorFeedback, dequantize, dequantize_chunks, quantize, quantize_chunks,
                                     quantized_nbytes)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = (8, 4)
NAN = float("nan")


# ------------------------------------------------------------------------------------------------------ reference
def ref_qmax(bits):
    return 2 ** (bits - 1) - 1


def ref_quantize(x, block, bits):
    """(int8 codes one per element, fp32 scales) of 1-D `x`, one block at a time, as the format says."""
    qmax = ref_qmax(bits)
    x = x.float()
    codes, scales = [], []
    for start in range(0, x.numel(), block):
        b = x[start:start + block]
        if bool(torch.isnan(b).any()) or bool(torch.isinf(b).any()):
            scales.append(torch.tensor(NAN))
            codes.append(torch.zeros(b.numel(), dtype=torch.int8))
            continue
        amax = b.abs().max()
        if float(amax) == 0.0:
            scales.append(torch.tensor(0.0))
            codes.append(torch.zeros(b.numel(), dtype=torch.int8))
            continue
        s = amax / qmax
        scales.append(s)
        codes.append(torch.clamp(torch.round(b / s), -qmax, qmax).to(torch.int8))
    if not codes:
        return torch.zeros(0, dtype=torch.int8), torch.zeros(0)
    return torch.cat(codes), torch.stack(scales).float()


def ref_dequantize(codes, scales, block):
    """fp32 values of int8 `codes` (one per element) and `scales`; a nan scale makes its whole block nan."""
    out = []
    for i, start in enumerate(range(0, codes.numel(), block)):
        c = codes[start:start + block].float()
        s = scales[i]
        out.append(torch.full_like(c, NAN) if bool(torch.isnan(s)) else c * s)
    return torch.cat(out) if out else torch.zeros(0)


def ref_round_trip(x, block, bits):
    """fp32 dequantize(quantize(x)) by the reference."""
    return ref_dequantize(*ref_quantize(x, block, bits), block)


def ref_pack4(codes):
    """uint8 bytes of int8 codes in [-7, 7]: code 2i in byte i's low nibble, 2i + 1 in its high nibble."""
    vals = [int(c) & 0xF for c in codes]
    if len(vals) % 2:
        vals.append(0)
    return torch.tensor([vals[i] | (vals[i + 1] << 4) for i in range(0, len(vals), 2)], dtype=torch.uint8)


def ref_unpack4(packed, numel):
    vals = []
    for byte in packed.tolist():
        for nib in (byte & 0xF, byte >> 4):
            vals.append(nib - 16 if nib >= 8 else nib)
    return torch.tensor(vals[:numel], dtype=torch.int8)


def same_bits(a, b):
    """Equal dtype, shape, nan positions and every other value."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(torch.where(nan_a, 0, a), torch.where(nan_b, 0, b))


def sample(numel, dtype, seed=0):
    """Normal values whose magnitude varies by orders of magnitude along the tensor, so blocks differ in scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, max(numel, 1))[:numel]
    return x.to(dtype)


def unpacked(codes, numel, bits):
    return ref_unpack4(codes, numel) if bits == 4 else codes


SHAPES = [(1, 16), (5, 16), (16, 16), (17, 16), (37, 16), (1000, 64), (4096, 256), (7, 1), (3, 1000)]


# ------------------------------------------------------------------------------------------------------ the format
@pytest.mark.parametrize("numel,block", SHAPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_scales_and_values_equal_the_reference(dtype, bits, numel, block):
    x = sample(numel, dtype, seed=numel)
    codes, scales = quantize(x, block, bits)
    want_codes, want_scales = ref_quantize(x, block, bits)
    assert scales.dtype == torch.float32 and scales.shape == (math.ceil(numel / block),)
    assert torch.equal(scales, want_scales)
    if bits == 8:
        assert codes.dtype == torch.int8 and torch.equal(codes, want_codes)
    else:
        assert codes.dtype == torch.uint8 and torch.equal(codes, ref_pack4(want_codes))
    got = dequantize(codes, scales, block, numel, bits)
    assert got.dtype == torch.float32 and torch.equal(got, ref_dequantize(want_codes, want_scales, block))
    for out_dtype in DTYPES:  # computed in fp32, then cast once
        assert torch.equal(dequantize(codes, scales, block, numel, bits, dtype=out_dtype),
                           ref_dequantize(want_codes, want_scales, block).to(out_dtype))


@pytest.mark.parametrize("numel,block", SHAPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_is_at_most_half_a_scale_per_block(dtype, bits, numel, block):
    x = sample(numel, dtype, seed=7 * numel)
    xf = x.float()
    got = dequantize(*quantize(x, block, bits), block, numel, bits)
    qmax = ref_qmax(bits)
    for start in range(0, numel, block):
        b, y = xf[start:start + block], got[start:start + block]
        half_scale = float(b.abs().max()) / (2 * qmax)
        err = float((b - y).abs().max())
        assert err <= half_scale * (1 + 1e-6), (start, err, half_scale)
        assert float(y.abs().max()) <= float(b.abs().max()) * (1 + 1e-6)  # the block's largest value is (nearly) kept


def test_rounding_is_to_nearest_not_truncation():
    """A value 0.6 of a step above a code rounds up (floor or truncation toward zero would not)."""
    x = torch.tensor([127.0, 10.6, -10.6, 0.4, -0.4, 2.5, 3.5])  # scale 1: codes are the rounded values
    codes, scales = quantize(x, 7, 8)
    assert float(scales[0]) == 1.0
    assert codes.tolist() == [127, 11, -11, 0, 0, 2, 4]  # torch.round: half to even


def test_blocks_are_consecutive_elements_with_a_short_last_block():
    x = torch.tensor([1.0, 2.0, 100.0, 4.0, 8.0])
    _, scales = quantize(x, 2, 8)
    assert torch.equal(scales, torch.tensor([2.0, 100.0, 8.0]) / 127)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_are_exact_zeros(dtype, bits):
    x = sample(64, dtype)
    x[16:32] = 0
    x[48:] = -0.0
    codes, scales = quantize(x, 16, bits)
    assert float(scales[1]) == 0.0 and float(scales[3]) == 0.0
    assert not torch.isnan(scales).any()
    got = dequantize(codes, scales, 16, 64, bits)
    assert torch.equal(got[16:32], torch.zeros(16)) and torch.equal(got[48:], torch.zeros(16))
    assert torch.equal(unpacked(codes, 64, bits)[16:32], torch.zeros(16, dtype=torch.int8))
    all_zero = dequantize(*quantize(torch.zeros(5, dtype=dtype), 2, bits), 2, 5, bits)
    assert torch.equal(all_zero, torch.zeros(5))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_block_with_inf_or_nan_is_nan_as_a_whole_and_only_that_block(dtype, bits):
    x = sample(100, dtype, seed=3)  # blocks of 16: the last one holds 4
    x[20] = float("inf")
    x[50] = float("-inf")
    x[70] = NAN
    x[99] = NAN  # in the short last block
    codes, scales = quantize(x, 16, bits)
    got = dequantize(codes, scales, 16, 100, bits, dtype=dtype)
    bad = {1, 3, 4, 6}
    for i in range(7):
        block = got[16 * i:16 * (i + 1)]
        if i in bad:
            assert torch.isnan(scales[i]) and torch.isnan(block).all(), i
        else:
            assert torch.isfinite(block).all(), i
    assert same_bits(got, ref_round_trip(x, 16, bits).to(dtype))


def test_an_fp16_overflow_stays_visible():
    """An fp16 gradient that overflowed to inf must come out non-finite (the loss scaler's check), never clamped."""
    x = torch.tensor([1.0, 70000.0, -3.0, 2.0], dtype=torch.float32).to(torch.float16)  # 70000 -> inf in fp16
    got = dequantize(*quantize(x, 4, 8), 4, 4, 8, dtype=torch.float16)
    assert not torch.isfinite(got).any()


@pytest.mark.parametrize("bits", BITS)
def test_block_larger_than_the_tensor_and_single_elements(bits):
    for numel, block in ((1, 1), (1, 16), (3, 1 << 40), (10, 10 ** 9)):  # a huge block allocates nothing big
        x = sample(numel, torch.float32, seed=numel)
        codes, scales = quantize(x, block, bits)
        assert scales.numel() == 1
        assert torch.equal(dequantize(codes, scales, block, numel, bits), ref_round_trip(x, block, bits))
    codes, scales = quantize(torch.tensor([-0.3]), 16, bits)  # one element is its block's absmax: exact code qmax
    assert unpacked(codes, 1, bits).tolist() == [-ref_qmax(bits)]
    assert dequantize(codes, scales, 16, 1, bits).tolist() == [pytest.approx(-0.3, rel=1e-6)]


def test_empty_tensor():
    codes, scales = quantize(torch.zeros(0), 16, 8)
    assert codes.numel() == 0 and scales.numel() == 0
    assert dequantize(codes, scales, 16, 0).numel() == 0


def test_int4_packing_layout_with_an_odd_count():
    x = torch.arange(-7, 8, dtype=torch.float32)  # 15 values, absmax 7: scale 1, codes = the values
    codes, scales = quantize(x, 15, 4)
    assert float(scales[0]) == 1.0
    assert codes.dtype == torch.uint8 and codes.numel() == 8
    # by hand: (-7, -6) -> 0x9 | 0xA << 4; ...; (6, 7) -> 0x6 | 0x7 << 4; the lone last code 7 -> 0x07
    assert codes.tolist()[0] == 0x9 | (0xA << 4)
    assert codes.tolist()[6] == 0x5 | (0x6 << 4)
    assert codes.tolist()[7] == 0x07
    assert codes.tolist() == ref_pack4(x.to(torch.int8)).tolist()
    assert torch.equal(dequantize(codes, scales, 15, 15, 4), x)
    for numel in (1, 2, 3, 31, 33):
        y = sample(numel, torch.float32, seed=numel)
        c, s = quantize(y, 8, 4)
        assert c.numel() == (numel + 1) // 2
        assert torch.equal(ref_unpack4(c, numel), ref_quantize(y, 8, 4)[0])


@pytest.mark.parametrize("numel,block,bits,nbytes", [
    (1000, 64, 8, 1000 + 4 * 16), (1000, 64, 4, 500 + 4 * 16), (37, 16, 8, 37 + 4 * 3), (37, 16, 4, 19 + 4 * 3),
    (1, 16, 8, 1 + 4), (1, 16, 4, 1 + 4), (0, 16, 8, 0), (256, 256, 8, 256 + 4), (2 ** 20, 2048, 4, 2 ** 19 + 4 * 512),
])
def test_quantized_nbytes(numel, block, bits, nbytes):
    assert quantized_nbytes(numel, block, bits) == nbytes
    codes, scales = quantize(torch.ones(numel), block, bits)
    assert codes.numel() * codes.element_size() + scales.numel() * scales.element_size() == nbytes


# ------------------------------------------------------------------------------------------------------ chunks, out
@pytest.mark.parametrize("bits", BITS)
def test_chunks_are_quantized_separately(bits):
    x = sample(4 * 37, torch.bfloat16, seed=11)
    codes, scales = quantize_chunks(x, 4, 16, bits)
    assert codes.shape[0] == scales.shape[0] == 4 and codes.is_contiguous() and scales.is_contiguous()
    for r in range(4):
        want_codes, want_scales = ref_quantize(x[37 * r:37 * (r + 1)], 16, bits)
        assert torch.equal(scales[r], want_scales)
        assert torch.equal(codes[r], want_codes if bits == 8 else ref_pack4(want_codes))
    got = dequantize_chunks(codes, scales, 16, 37, bits)
    assert got.shape == (4, 37)
    assert torch.equal(got.reshape(-1), torch.cat([ref_round_trip(x[37 * r:37 * (r + 1)], 16, bits)
                                                   for r in range(4)]))


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_into_a_view_of_a_larger_buffer(bits):
    x = sample(37, torch.float32, seed=5)
    buf = torch.full((100,), 3.0, dtype=torch.bfloat16)
    view = buf[40:77]
    returned = dequantize(*quantize(x, 16, bits), 16, 37, bits, out=view)
    assert returned.data_ptr() == view.data_ptr()
    assert torch.equal(view, ref_round_trip(x, 16, bits).to(torch.bfloat16))
    assert (buf[:40] == 3).all() and (buf[77:] == 3).all()


# ------------------------------------------------------------------------------------------------------ feedback
@pytest.mark.parametrize("bits", BITS)
def test_error_feedback_keeps_the_sum_of_what_was_sent_within_one_steps_error(bits):
    """The same gradient sent 50 times: without feedback the sum drifts by 50 round-off errors; with it, the sum of
    the dequantized values stays within one step's error (max over steps of absmax / (2 qmax) per block)."""
    block, steps, qmax = 16, 50, ref_qmax(bits)
    x = sample(100, torch.float32, seed=1)
    feedback = ErrorFeedback()
    sent = torch.zeros(100, dtype=torch.float64)
    plain = torch.zeros(100, dtype=torch.float64)
    bound = torch.zeros(100, dtype=torch.float64)
    for step in range(steps):
        xt = x * (1 + 0.01 * step)  # a slowly changing gradient
        c = feedback.compensate("g", xt)
        assert c.dtype == torch.float32
        d = dequantize(*quantize(c, block, bits), block, 100, bits)
        feedback.remember("g", c, d)
        sent += d.double() - xt.double()
        plain += dequantize(*quantize(xt, block, bits), block, 100, bits).double() - xt.double()
        half = torch.stack([c[i:i + block].abs().max() / (2 * qmax) for i in range(0, 100, block)])
        bound = torch.maximum(bound, half.repeat_interleave(block)[:100].double())
    assert (sent.abs() <= bound * (1 + 1e-4) + 1e-6).all()
    assert (plain.abs() > bound).any()  # the test means something: without feedback the error accumulates
    assert feedback.nbytes == 100 * 4
    feedback.reset()
    assert feedback.nbytes == 0
    assert torch.equal(feedback.compensate("g", x), x)


def test_error_feedback_per_key_and_non_finite_residuals():
    feedback = ErrorFeedback()
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0, 7.0])
    feedback.remember("a", a, torch.tensor([0.75, 2.0]))
    feedback.remember("b", b, torch.tensor([NAN, NAN, 7.5]))  # an overflowed step: its residual is not kept
    assert torch.equal(feedback.compensate("a", torch.zeros(2, dtype=torch.bfloat16)), torch.tensor([0.25, 0.0]))
    assert torch.equal(feedback.compensate("b", torch.zeros(3)), torch.tensor([0.0, 0.0, -0.5]))
    assert torch.equal(feedback.compensate("new", a), a)
    with pytest.raises(ValueError, match="residual of shape"):
        feedback.compensate("a", torch.zeros(3))


# ------------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("call,message", [
    (lambda: quantize(torch.ones(4), 0), "block_size=0 must be an int >= 1"),
    (lambda: quantize(torch.ones(4), -3), "block_size=-3"),
    (lambda: quantize(torch.ones(4), 2.5), "block_size=2.5"),
    (lambda: quantize(torch.ones(4), True), "block_size=True"),
    (lambda: quantize(torch.ones(4), 4, bits=2), "bits=2; supported: 8, 4"),
    (lambda: quantize(torch.ones(4), 4, bits=16), "bits=16"),
    (lambda: quantize(torch.ones(4, dtype=torch.int32), 4), "floating-point tensor, got torch.int32"),
    (lambda: quantize(torch.ones(2, 2), 4), r"1-D, got shape \(2, 2\)"),
    (lambda: quantize([1.0, 2.0], 4), "torch.Tensor, got list"),
    (lambda: quantize_chunks(torch.ones(10), 3, 4), "chunks=3 must be a positive int dividing"),
    (lambda: dequantize(torch.zeros(4, dtype=torch.uint8), torch.zeros(1), 4, 4, 8), "are torch.int8, got torch.uint8"),
    (lambda: dequantize(torch.zeros(4, dtype=torch.int8), torch.zeros(1), 4, 4, 4), "are torch.uint8"),
    (lambda: dequantize(torch.zeros(3, dtype=torch.int8), torch.zeros(1), 4, 4), "codes hold 3 elements"),
    (lambda: dequantize(torch.zeros(4, dtype=torch.int8), torch.zeros(2), 4, 4), "scales hold 2 elements"),
    (lambda: dequantize(torch.zeros(4, dtype=torch.int8), torch.zeros(1), 4, 4, out=torch.zeros(5)),
     "out must be a float tensor of 4 elements"),
    (lambda: quantized_nbytes(10, 0), "block_size=0"),
])
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
