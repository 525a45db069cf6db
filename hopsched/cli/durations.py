"""Parsing human durations such as ``90s``, ``5m``, ``1m30s``, ``2h``, ``250ms``, ``1.5d``."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal, InvalidOperation

__all__ = ["describe_duration", "parse_duration"]

_UNITS_US = {
    "us": 1,
    "ms": 1_000,
    "s": 1_000_000,
    "m": 60_000_000,
    "h": 3_600_000_000,
    "d": 86_400_000_000,
}
_TERM = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>us|ms|s|m|h|d)\s*")
_SIGNED = re.compile(r"^\s*(?P<sign>-?)(?P<terms>.*?)\s*$", re.DOTALL)
#: Zero needs no unit: ``0``, ``-0``, ``0.0``.
_ZERO = re.compile(r"^\s*-?(?:0+(?:\.0*)?|\.0+)\s*$")
#: Terms of a compound duration go from the largest unit down, each unit once.
_ORDER = ["d", "h", "m", "s", "ms", "us"]
_EXAMPLES = "e.g. 250ms, 90s, 5m, 1m30s, 2h, 1d12h"


def parse_duration(text: str) -> timedelta:
    """``"90s"`` → ``timedelta(seconds=90)``; compound ``"1m30s"``, ``"1h 30m"``,
    ``"2d12h"`` add up their terms (largest unit first, each unit once). Units: us, ms,
    s, m, h, d; zero needs none (``"0"``). Exact (no float); fractions of a microsecond
    round up. A leading ``-`` makes the whole duration negative (``"-1m30s"`` is -90 s):
    the caller decides what it means.

    Raises:
        ValueError: not numbers each followed by one of the units, in that order.
    """
    if _ZERO.match(text):
        return timedelta(0)
    signed = _SIGNED.match(text)
    assert signed is not None  # the pattern matches any text
    terms, position, units = signed["terms"], 0, []
    micros = Decimal(0)
    while position < len(terms):
        match = _TERM.match(terms, position)
        if match is None:
            break
        units.append(match["unit"])
        try:
            micros += Decimal(match["number"]) * _UNITS_US[match["unit"]]
        except InvalidOperation:
            raise ValueError(f"{text!r} is too long a duration") from None
        position = match.end()
    if not units or position < len(terms):
        raise ValueError(f"{text!r} is not a duration: write a number and a unit, {_EXAMPLES}")
    ranks = [_ORDER.index(unit) for unit in units]
    if ranks != sorted(set(ranks)):
        raise ValueError(
            f"{text!r}: write the terms of a compound duration from the largest unit down, "
            f"each unit once, {_EXAMPLES}"
        )
    if signed["sign"]:
        micros = -micros
    try:
        return timedelta(microseconds=int(micros.to_integral_value(rounding="ROUND_CEILING")))
    except (InvalidOperation, OverflowError):
        raise ValueError(f"{text!r} is too long a duration") from None


def describe_duration(span: timedelta) -> str:
    """A duration as its two largest units, in ``parse_duration``'s syntax (``"5m2s"``,
    ``"3h20m"``, ``"12d4h"``; under a second ``"0s"``), with years beside it from a year
    on (``"2530d17h (6.9 years)"``). Negative spans are described by their size."""
    seconds = abs(int(span.total_seconds()))
    parts: list[str] = []
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count or parts:
            parts.append(f"{count}{unit}")
    text = "".join(part for part in parts[:2] if not part.startswith("0")) or "0s"
    days = abs(span.days)
    return f"{text} ({days / 365.25:.1f} years)" if days >= 365 else text
