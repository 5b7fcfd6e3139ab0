"""Bytes as people write and read them: `parse_bytes` for --budget, `gib` and `mib` for the log and the table."""
from __future__ import annotations

import argparse
import math
from typing import Optional

GIB = 2**30
MIB = 2**20
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """"1.5GiB", "1536MiB", "2e9", "1.6GB" (decimal units: KB, MB, GB; binary: KiB, MiB, GiB, or K, M, G), as
    argparse's `type`: anything else raises ArgumentTypeError naming the text."""
    s = str(text).strip().lower().replace("_", "")
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i].strip(), s[i:]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes (e.g. 1.5GiB, 1536MiB, 2e9)") from None
    if not math.isfinite(value) or value < 1:  # "nan", "inf" and "0.1" parse as floats but are no budget
        raise argparse.ArgumentTypeError(f"{text!r}: a budget must be a positive, finite number of bytes")
    return int(value)


def gib(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / GIB:.2f} GiB"


def mib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / MIB:,.0f}"
