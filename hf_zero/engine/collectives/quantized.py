"""ZeRO++'s quantized communication (Wang et al. 2023, arXiv 2306.10209) as a strategy wrapped around another one.

- qwZ, the weight all-gather (`weights=True`, floating `out`): the rank block-quantizes its shard
  (engine/quantize.py), the inner strategy all-gathers the codes and the fp32 scales into temporaries, and the
  handle's completion dequantizes every rank's chunk into `out`, in out's dtype. The own chunk is dequantized too,
  so every rank holds the same values; when `inp` is out's own chunk (stages 1/2 gather in place) the rank's shard
  is thereby replaced by its quantized value.
- qgZ, the gradient reduce-scatter (`gradients=True`, floating `inp`): the rank cuts `inp` into W equal chunks and
  quantizes each on its own (blocks never straddle chunks), one `all_to_all_single` each for the codes and the
  scales sends chunk r to rank r, and the completion dequantizes the W chunks it received to fp32, sums them in
  rank order 0..W-1 (the same bits on every rank and in every run, whatever the backend's reduction order) and
  writes the sum into `out`, in out's dtype, before `on_done`. This is qgZ's one-hop form over one group; the
  paper's runs an intra-node all-to-all, then an inter-node one, dequantizing, reducing and requantizing between.
- an all-gather whose `inp` is uint8 into a floating `out` is already quantized (quantized frozen weights keep
  their shard `pack`ed: codes, then fp32 scales): one all-gather of those bytes, dequantized into `out`.
- all-reduce, other dtypes, and the kind switched off: the inner strategy, unchanged.

A block holding an inf / nan dequantizes to nan as a whole (engine/quantize.py), so an fp16 overflow on any rank
stays visible to the loss scaler after the reduce-scatter.

`wire_bytes` books what is really sent: W chunks of codes plus fp32 scales (`quantized_nbytes` per chunk).

Error feedback (`feedback`, a `quantize.ErrorFeedback`): before quantizing, the reduce-scatter adds to `inp` what
the last quantization of the same gradient group lost, and keeps what this one loses; the group is named by the
`tag` the engine gives every reduce-scatter (buckets come from a pool and are reused by other groups, so they
cannot be the key). It holds one fp32 residual per gradient group, the full group's size, on every rank.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..quantize import (ErrorFeedback, check_format, dequantize_chunks, quantize, quantize_chunks,
                        quantized_nbytes, unpack)
from .base import Collectives, Handle, issued


class Quantized(Collectives):
    """Block-quantized all-gather (qwZ) and reduce-scatter (qgZ) over `inner`'s group; the rest is `inner`'s.

    `block_size`: elements per fp32 scale; `bits`: 8 or 4; `weights` / `gradients`: quantize the all-gather /
    the reduce-scatter (off: that collective is `inner`'s, bit for bit). Its `name` (the ledger's key) says the
    code width: "quantized-int8" / "quantized-int4"."""

    name = "quantized"

    def __init__(self, inner: Collectives, block_size: int, bits: int = 8, weights: bool = True,
                 gradients: bool = True, feedback: Optional[ErrorFeedback] = None) -> None:
        check_format(block_size, bits)
        super().__init__(inner.group, inner.rank, inner.global_ranks)
        self.inner, self.block_size, self.bits = inner, block_size, bits
        self.weights, self.gradients, self.feedback = weights, gradients, feedback
        self.name = f"quantized-int{bits}"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        if out.is_floating_point() and inp.dtype is torch.uint8:
            return self._gather_packed(out, inp, async_op)
        if not (self.weights and out.is_floating_point()):
            return self.inner.all_gather(out, inp, async_op)
        w, n = self.world_size, inp.numel()
        if out.numel() != w * n:
            raise ValueError(f"all_gather: out holds {out.numel()} elements, not {w} x {n}")
        codes, scales = quantize(inp.reshape(-1), self.block_size, self.bits)  # before anything writes into out
        all_codes, all_scales = codes.new_empty(w * codes.numel()), scales.new_empty(w * scales.numel())
        works = [self.inner.all_gather(all_codes, codes, True), self.inner.all_gather(all_scales, scales, True)]

        def finish() -> None:
            dequantize_chunks(all_codes.view(w, -1), all_scales.view(w, -1), self.block_size, n, self.bits, out=out)

        return issued(works, finish, async_op)

    def _gather_packed(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        """`inp` is already quantized: the rank's chunk `pack`ed (codes, then fp32 scales; quantized frozen weights
        keep their shard so); one all-gather of the packed bytes, every rank's chunk dequantized into `out`."""
        w, n = self.world_size, out.numel() // self.world_size
        if out.numel() != w * n or inp.numel() != quantized_nbytes(n, self.block_size, self.bits):
            raise ValueError(f"all_gather: packed input of {inp.numel()} bytes is not {n} quantized values "
                             f"(block {self.block_size}, int{self.bits}) for out of {out.numel()} over {w} ranks")
        inp = inp.to(out.device, non_blocking=True)  # from host memory when parameters are offloaded
        everyone = inp.new_empty(w * inp.numel())

        def finish() -> None:
            codes, scales = unpack(everyone, n, self.block_size, self.bits)
            dequantize_chunks(codes, scales, self.block_size, n, self.bits, out=out)

        return issued(self.inner.all_gather(everyone, inp, True), finish, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       on_done: Optional[Callable[[], None]], tag: str = "") -> Handle:
        if not (self.gradients and inp.is_floating_point()):
            return self.inner.reduce_scatter(out, inp, async_op, on_done, tag)
        w, total = self.world_size, inp.numel()
        if total % w or out.numel() != total // w:
            raise ValueError(f"reduce_scatter: inp of {total} elements into out of {out.numel()} over {w} ranks "
                             f"(equal chunks needed)")
        n = total // w
        x = inp.reshape(-1)
        if self.feedback is not None:
            if not tag:
                raise ValueError("reduce_scatter with error feedback needs a tag naming the gradient group")
            x = self.feedback.compensate(tag, x)
        codes, scales = quantize_chunks(x, w, self.block_size, self.bits)  # row r goes to rank r
        if self.feedback is not None:
            self.feedback.remember(tag, x, dequantize_chunks(codes, scales, self.block_size, n, self.bits).view(-1))
        got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        works = [dist.all_to_all_single(got_codes, codes, group=self.group, async_op=True),
                 dist.all_to_all_single(got_scales, scales, group=self.group, async_op=True)]

        def finish() -> None:
            values = dequantize_chunks(got_codes, got_scales, self.block_size, n, self.bits)  # fp32 [w, n]
            acc = values[0].clone()
            for r in range(1, w):  # rank order, never the backend's
                acc += values[r]
            out.copy_(acc.view(out.shape))
            if on_done is not None:
                on_done()

        return issued(works, finish, async_op)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, async_op: bool,
                   on_done: Optional[Callable[[], None]]) -> Handle:
        return self.inner.all_reduce(tensor, op, async_op, on_done)

    def wire_bytes(self, kind: str, elements: int, dtype: torch.dtype) -> int:
        quantized = (kind == "all_gather" and self.weights) or (kind == "reduce_scatter" and self.gradients)
        if not (quantized and dtype.is_floating_point):
            return self.inner.wire_bytes(kind, elements, dtype)
        w = self.world_size
        return w * quantized_nbytes(elements // w, self.block_size, self.bits)  # per chunk: blocks never straddle
