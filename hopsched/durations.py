"""Parsing human durations such as ``90s``, ``5m``, ``2h``, ``250ms``, ``1.5d``."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal, InvalidOperation

__all__ = ["parse_duration"]

_UNITS_US = {
    "us": 1,
    "ms": 1_000,
    "s": 1_000_000,
    "m": 60_000_000,
    "h": 3_600_000_000,
    "d": 86_400_000_000,
}
_DURATION = re.compile(r"^\s*(?P<number>-?\d+(?:\.\d*)?|-?\.\d+)\s*(?P<unit>us|ms|s|m|h|d)\s*$")
#: Zero needs no unit: ``0``, ``-0``, ``0.0``.
_ZERO = re.compile(r"^\s*-?(?:0+(?:\.0*)?|\.0+)\s*$")


def parse_duration(text: str) -> timedelta:
    """``"90s"`` → ``timedelta(seconds=90)``. Units: us, ms, s, m, h, d; zero needs none
    (``"0"``). Exact (no float); fractions of a microsecond round up. Negative durations
    parse as such (``"-5s"``): the caller decides what they mean.

    Raises:
        ValueError: not a number followed by one of the units.
    """
    if _ZERO.match(text):
        return timedelta(0)
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: write a number and a unit, e.g. 250ms, 90s, 5m, 2h, 1d"
        )
    try:
        micros = Decimal(match["number"]) * _UNITS_US[match["unit"]]
        return timedelta(microseconds=int(micros.to_integral_value(rounding="ROUND_CEILING")))
    except (InvalidOperation, OverflowError):
        raise ValueError(f"{text!r} is too long a duration") from None
