"""The link between the two hosts of hosts.py: tc's rate strings (`parse_rate("100mbit")` = 1e8 bits/s), the
arguments of the token-bucket filter that limits each direction of it (`tbf_args`), and the two scripts
`TwoHosts.measure_link` runs to time one bulk TCP transfer over it (`SINK` on host A, `SOURCE` on host B). It
imports nothing of hf_zero.
"""
from __future__ import annotations

import re
from typing import List, Optional, Union


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
               "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40}


def parse_rate(rate: Union[str, float, int]) -> float:
    """Bits per second of a rate written as tc writes it: "100mbit", "1gbit", "2.5kbit", "10mbps" (bytes), or a
    bare number (bits/s). Raises ValueError for anything else or a rate that is not positive."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(rate))
        unit = m.group(2).lower() if m else ""
        if not m or (unit and unit not in _RATE_UNITS):
            raise ValueError(f"link rate {rate!r}: give a number and one of tc's units ({', '.join(_RATE_UNITS)}), "
                             f"e.g. 100mbit")
        value = float(m.group(1)) * _RATE_UNITS.get(unit, 1)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"link rate {rate!r} must be a positive number of bits per second")
    return value


def tbf_args(bps: float, burst: Optional[int], latency: str) -> List[str]:
    """tc's arguments of the token bucket for `bps`: the rate in whole bits/s (no unit for tc to read otherwise),
    the bucket (`burst` bytes, default 4 ms of the rate, at least 32 KiB) and the queue's latency bound."""
    if burst is None:
        burst = max(32 * 1024, int(bps / 8 * 0.004))
    return ["rate", f"{int(round(bps))}bit", "burst", str(int(burst)), "latency", latency]


# Receives one TCP stream on host A and prints its bytes and the seconds from its first byte to its end.
SINK = r"""
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - (t0 or time.perf_counter()), flush=True)
"""
SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
left = int(sys.argv[3]); block = b"\0" * (1 << 20)
while left > 0:
    c.sendall(block[:min(left, len(block))]); left -= min(left, len(block))
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""
