"""hf_zero/tools/bench/spawn.py's wait_bounded, which every bench and capacity run waits on its ranks with: the
three ways a wait ends, on a clock the test advances (no process, no time spent)."""
from __future__ import annotations

from hf_zero.tools.bench.spawn import wait_bounded


class Ranks:
    """Exit codes per poll, replayed; the clock advances one second per pause."""

    def __init__(self, *polls):
        self.polls, self.i, self.now, self.pauses = list(polls), 0, 0.0, 0

    def codes(self):
        codes = self.polls[min(self.i, len(self.polls) - 1)]
        self.i += 1
        return codes

    def pause(self):
        self.pauses += 1
        self.now += 1.0


def test_returns_when_every_rank_has_exited():
    r = Ranks([None, None], [0, None], [0, 0])
    assert wait_bounded(r.codes, r.pause, grace_s=5, timeout_s=100, clock=lambda: r.now) is False
    assert r.pauses == 2


def test_a_failure_gives_the_others_the_grace_then_stops_waiting():
    """Rank 1 blocks for ever (a collective whose peer died): the wait ends grace_s after rank 0's failure, not at
    the timeout, and says it did not time out."""
    r = Ranks([None, None], [None, None], [1, None])
    assert wait_bounded(r.codes, r.pause, grace_s=5, timeout_s=100, clock=lambda: r.now) is False
    assert r.pauses == 2 + 6  # failure seen at t = 2; stops at the first poll more than 5 s later


def test_ranks_that_never_exit_time_out():
    r = Ranks([None, 0])
    assert wait_bounded(r.codes, r.pause, grace_s=5, timeout_s=10, clock=lambda: r.now) is True
    assert r.pauses == 11
