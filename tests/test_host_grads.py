"""ZeRO-Offload's gradient copies (engine/host_grads.py), pure logic: through the staging queue, the host shard gets
exactly the sum of what was added, never more than `depth` copies wait, and `drain()` leaves none. The reference is
a plain sum of the same tensors. (On a GPU the staging tensor is pinned and an event orders the host add after
the copy; here both sides are host memory, so `staged=True` runs the queue alone.)"""
import pytest
import torch

from hf_zero.engine.host_grads import HostGradients


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_staged_adds_sum_exactly_and_stay_within_depth(depth):
    torch.manual_seed(0)
    shard = torch.zeros(12, dtype=torch.float32)
    ranges = [(0, 4), (4, 12), (0, 12), (2, 6), (8, 12)]
    pieces = [torch.randn(b - a, dtype=torch.bfloat16) for a, b in ranges]
    want = torch.zeros(12, dtype=torch.float32)
    sink = HostGradients(depth=depth, staged=True)
    for (a, b), piece in zip(ranges, pieces):
        want[a:b] += piece.float()
        source = piece.clone()
        sink.add(shard[a:b], source)
        source.fill_(float("nan"))  # the bucket is reused once add() returns: the copy must already be taken
        assert len(sink.pending) <= depth
    sink.drain()
    assert not sink.pending
    assert torch.equal(shard, want)


def test_one_memory_adds_at_once():
    """Unstaged, with the shard and the range in one memory (no offload, or a CPU run): the add happens in add()."""
    shard = torch.zeros(4)
    sink = HostGradients()
    sink.add(shard[1:3], torch.ones(2))
    assert not sink.pending and shard.tolist() == [0, 1, 1, 0]
