"""Block-wise symmetric quantization of a 1-D float tensor: the building block of ZeRO++'s quantized communication
(Wang et al. 2023, arXiv 2306.10209: qwZ, the block-quantized weight all-gather; qgZ, the block-quantized gradient
reduce-scatter over all-to-all). engine/collectives/quantized.py puts it on the wire.

The format, for `bits` in (8, 4) and qmax = 2**(bits-1) - 1 (127, 7):

- The input is cut into blocks of `block_size` consecutive elements; the last block may be shorter.
- Per block, computed in fp32 whatever the input dtype: scale = absmax(block) / qmax (an fp32 scale per block), and
  code = clamp(round(x / scale), -qmax, qmax), rounded half to even (torch.round). A value dequantizes to
  code * scale in fp32, so within a block the error is at most scale / 2 = absmax / (2 * qmax) per element.
- A block of zeros has scale 0 and codes 0 and dequantizes to exact zeros. (So does a block whose absmax / qmax
  underflows fp32 to 0, absmax < ~1e-43: its error is at most that absmax.)
- A block holding an inf or a nan has scale nan and codes 0, so the whole block dequantizes to nan. On purpose: a
  gradient overflow must stay visible after the reduction to the fp16 loss scaler's check (which looks for inf /
  nan in the reduced shard and skips the step); clamping it to +-qmax * scale, or a scale of inf times a code of 0,
  could turn it into finite values or hide it. A nan is never hidden, and the rest of the tensor is untouched.
- Codes: 8 bits: one int8 per element (numel codes). 4 bits: uint8, two codes per byte: byte i holds code 2i in its
  low nibble and code 2i + 1 in its high nibble, each as a 4-bit two's complement (-7..7); an odd count leaves the
  last byte's high nibble 0. Padding never goes on the wire: codes cover exactly numel elements.

`quantize_chunks` / `dequantize_chunks` do the same for a 1-D tensor cut into equal chunks, each quantized on its
own (blocks never straddle two chunks): the reduce-scatter's form, one kernel sequence for all chunks.

Everything is vectorised (the padded input viewed as [chunks, blocks, block]); nothing loops per block in Python.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["QMAX", "ErrorFeedback", "check_format", "codes_numel", "dequantize", "dequantize_chunks", "num_blocks",
           "pack", "quantize", "quantize_chunks", "quantized_nbytes", "unpack"]

QMAX: Dict[int, int] = {8: 127, 4: 7}
SCALE_BYTES = 4  # scales travel as fp32


# ------------------------------------------------------------------------------------------------------- sizes
def num_blocks(numel: int, block_size: int) -> int:
    """Blocks (and so scales) of a tensor of `numel` elements: ceil(numel / block_size)."""
    check_format(block_size, 8)
    return -(-numel // block_size)


def codes_numel(numel: int, bits: int = 8) -> int:
    """Elements of the codes tensor for `numel` values: numel int8 at 8 bits, ceil(numel / 2) uint8 at 4 bits."""
    check_format(1, bits)
    return numel if bits == 8 else (numel + 1) // 2


def quantized_nbytes(numel: int, block_size: int, bits: int = 8) -> int:
    """Bytes on the wire for `numel` values: the codes plus one fp32 scale per block."""
    return codes_numel(numel, bits) + SCALE_BYTES * num_blocks(numel, block_size)


# ------------------------------------------------------------------------------------------------------- public
def quantize(x: torch.Tensor, block_size: int, bits: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the 1-D float tensor `x` (see the module docstring for the format).

    codes: int8 [numel] at 8 bits, uint8 [ceil(numel / 2)] at 4 bits; scales: fp32 [ceil(numel / block_size)].
    """
    check_format(block_size, bits)
    _check_input(x)
    codes, scales = _quantize_rows(x.reshape(1, -1), block_size, bits)
    return codes.view(-1), scales.view(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, bits: int = 8,
               dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The `numel` values that `quantize` encoded as (codes, scales), code * scale computed in fp32, then cast to
    `dtype`, or written into `out` (any float dtype and shape of `numel` elements, e.g. a bf16 view of a larger
    buffer; `dtype` is then ignored), which is returned."""
    values = dequantize_chunks(codes, scales, block_size, numel, bits, dtype, out, chunks=1)
    return values.view(numel) if out is None else out


def pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One uint8 tensor holding `codes` then the fp32 `scales`' bytes (quantized_nbytes of them, no padding): what a
    rank keeps of a quantized frozen shard, and what one all-gather sends (collectives/quantized.py)."""
    return torch.cat([codes.reshape(-1).view(torch.uint8), scales.reshape(-1).view(torch.uint8)])


def unpack(packed: torch.Tensor, numel: int, block_size: int, bits: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of rows of `pack`ed values of `numel` elements each: packed [rows, quantized_nbytes] (or 1-D,
    one row) -> codes [rows, codes_numel], scales [rows, num_blocks] (fp32, copied: a view could be misaligned)."""
    rows = packed.view(-1, quantized_nbytes(numel, block_size, bits))
    n = codes_numel(numel, bits)
    codes = rows[:, :n] if bits == 4 else rows[:, :n].view(torch.int8)
    return codes, rows[:, n:].clone(memory_format=torch.contiguous_format).view(torch.float32)


def quantize_chunks(x: torch.Tensor, chunks: int, block_size: int, bits: int = 8
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """`x` (1-D, numel divisible by `chunks`) cut into `chunks` equal chunks, each quantized on its own: row r of
    the returned (codes [chunks, codes_numel(n)], scales [chunks, num_blocks(n)]) is `quantize(chunk r)`, n =
    numel / chunks. Both are contiguous, so row r is one contiguous piece (what an all-to-all sends to rank r)."""
    check_format(block_size, bits)
    _check_input(x)
    if not isinstance(chunks, int) or chunks < 1 or x.numel() % chunks:
        raise ValueError(f"chunks={chunks!r} must be a positive int dividing x.numel()={x.numel()}")
    return _quantize_rows(x.reshape(chunks, -1), block_size, bits)


def dequantize_chunks(codes: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, bits: int = 8,
                      dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None,
                      chunks: Optional[int] = None) -> torch.Tensor:
    """The inverse of `quantize_chunks`: `chunks` rows (default: codes.shape[0] of a 2-D codes) of `numel`
    values each, [chunks, numel] in `dtype`, or written into `out` (chunks * numel elements, any float dtype;
    returned as its [chunks, numel] view when it has one)."""
    check_format(block_size, bits)
    if chunks is None:
        chunks = codes.shape[0] if codes.dim() == 2 else 1
    want = torch.uint8 if bits == 4 else torch.int8
    if codes.dtype != want:
        raise ValueError(f"codes of {bits}-bit quantization are {want}, got {codes.dtype}")
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} must be an int >= 0")
    n_codes, n_scales = codes_numel(numel, bits), num_blocks(numel, block_size)
    if codes.numel() != chunks * n_codes:
        raise ValueError(f"codes hold {codes.numel()} elements; {chunks} x {numel} values at {bits} bits need "
                         f"{chunks * n_codes}")
    if scales.numel() != chunks * n_scales:
        raise ValueError(f"scales hold {scales.numel()} elements; {chunks} x {numel} values in blocks of "
                         f"{block_size} need {chunks * n_scales}")
    if out is not None and (out.numel() != chunks * numel or not out.is_floating_point()):
        raise ValueError(f"out must be a float tensor of {chunks * numel} elements, got {out.dtype} "
                         f"of {out.numel()}")
    values = _dequantize_rows(codes.reshape(chunks, n_codes), scales.reshape(chunks, n_scales).float(),
                              block_size, numel, bits)
    if out is None:
        return values.to(dtype).contiguous()
    try:
        view = out.view(chunks, numel)
    except RuntimeError:  # a strided out: copy through its own shape
        out.copy_(values.reshape(out.shape))
        return out
    view.copy_(values)
    return view


# ------------------------------------------------------------------------------------------------------- core
def check_format(block_size: int, bits: int) -> None:
    """ValueError unless `block_size` is an int >= 1 and `bits` one of QMAX's (8, 4)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")
    if bits not in QMAX or isinstance(bits, bool):
        raise ValueError(f"bits={bits!r}; supported: {', '.join(map(str, QMAX))}")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}")


def _layout(numel: int, block_size: int) -> Tuple[int, int]:
    """(blocks, width): a row of `numel` padded with zeros to blocks * width. One block is `numel` wide, not
    `block_size`: a huge block over a small tensor must not allocate the block."""
    blocks = -(-numel // block_size)
    return blocks, (block_size if blocks > 1 else max(numel, 1))


def _quantize_rows(rows: torch.Tensor, block_size: int, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    qmax = QMAX[bits]
    r, n = rows.shape
    blocks, width = _layout(n, block_size)
    x = rows.to(torch.float32)
    if blocks * width > n:
        x = F.pad(x, (0, blocks * width - n))  # zeros change no absmax and encode as 0
    x = x.view(r, blocks, width)
    absmax = x.abs().amax(dim=2)  # inf for a block with an inf, nan for one with a nan (amax propagates nan)
    finite = torch.isfinite(absmax)
    scales = torch.where(finite, absmax / qmax, torch.full_like(absmax, float("nan")))
    divisor = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))  # zero / non-finite: no 0 / 0
    q = torch.where(finite.unsqueeze(2), x / divisor.unsqueeze(2), 0.0)  # non-finite blocks: codes 0, scale nan
    codes = q.round_().clamp_(-qmax, qmax).to(torch.int8).view(r, blocks * width)[:, :n]
    if bits == 4:
        return _pack4(codes), scales
    return codes.contiguous(), scales


def _dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, block_size: int, n: int,
                     bits: int) -> torch.Tensor:
    """fp32 [rows, n] from codes [rows, codes_numel(n)] and fp32 scales [rows, blocks]."""
    if bits == 4:
        codes = _unpack4(codes, n)
    r = codes.shape[0]
    blocks, width = _layout(n, block_size)
    c = codes.to(torch.float32)
    if blocks * width > n:
        c = F.pad(c, (0, blocks * width - n))
    return (c.view(r, blocks, width) * scales.unsqueeze(2)).view(r, blocks * width)[:, :n]


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7], [rows, n] -> uint8 [rows, ceil(n / 2)]: code 2i in byte i's low nibble, 2i + 1 in
    its high nibble, 4-bit two's complement."""
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1))
    nibbles = (codes & 0xF).to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def _unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [rows, m] -> int8 codes [rows, n] (n <= 2m), sign-extended from 4 bits."""
    r = packed.shape[0]
    both = torch.stack(((packed & 0xF), (packed >> 4)), dim=2).to(torch.int8).view(r, -1)[:, :n]
    return torch.where(both > 7, both - 16, both)


# ------------------------------------------------------------------------------------------------------- feedback
class ErrorFeedback:
    """Error feedback (error compensation) for a quantized value sent again and again, per key (any hashable, e.g.
    a flat group).

    Each round: `c = feedback.compensate(key, x)` (x plus what the last rounds' quantization lost, fp32), quantize
    and send `c`, `feedback.remember(key, c, dequantize(...))` (the new residual c - dequantized, kept in fp32).
    Then the sum of what was sent over rounds differs from the sum of the true inputs by the last residual only
    (at most one round's quantization error) instead of accumulating every round's error.

    Where the dequantized value is not finite (an overflowed fp16 gradient: the loss scaler skips that step) the
    residual is kept as 0, so one overflow does not poison every later round. Residuals are in the units of what
    was quantized: a caller that quantizes loss-scaled gradients resets (or rescales) them when the scale changes.
    """

    def __init__(self) -> None:
        self._residuals: Dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """`x` in fp32 plus the residual remembered for `key` (none yet: `x` in fp32, a new tensor either way)."""
        residual = self._residuals.get(key)
        if residual is None:
            return x.to(torch.float32, copy=True)
        if residual.shape != x.shape:
            raise ValueError(f"ErrorFeedback key {key!r}: residual of shape {tuple(residual.shape)}, "
                             f"input of shape {tuple(x.shape)}")
        return x.to(torch.float32) + residual

    def remember(self, key: Hashable, x_compensated: torch.Tensor, dequantized: torch.Tensor) -> None:
        """Keep `x_compensated - dequantized` (fp32; 0 where not finite) as `key`'s residual."""
        if x_compensated.shape != dequantized.shape:
            raise ValueError(f"ErrorFeedback key {key!r}: compensated shape {tuple(x_compensated.shape)} != "
                             f"dequantized shape {tuple(dequantized.shape)}")
        residual = x_compensated.to(torch.float32) - dequantized.to(torch.float32)
        self._residuals[key] = torch.where(torch.isfinite(residual), residual, 0.0)

    def reset(self) -> None:
        """Forget every residual."""
        self._residuals.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the residuals hold."""
        return sum(t.numel() * t.element_size() for t in self._residuals.values())
