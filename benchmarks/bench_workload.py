"""The workload: delay distributions, parsed from text and drawn from a seed. Pure: no I/O."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import timedelta

from hopsched.cli.durations import parse_duration

__all__ = ["LONG_DELAY_US", "Delays", "Workload", "parse_delays"]

#: F01's long delay: 24 h, in µs.
LONG_DELAY_US = 24 * 3600 * 1_000_000

_F01_SHORT_MAX_US = 60 * 1_000_000
_F01_LONG_EVERY = 100  # F01: 10 long ones among 1,000 short ones


def _us(text: str) -> int:
    """A duration such as ``10ms``, ``5s``, ``10m`` or ``0`` in µs."""
    if text.strip() == "0":
        return 0
    return parse_duration(text) // timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class Delays:
    """A delay distribution: ``loguniform``, ``uniform``, ``fixed`` or ``mixed`` (F01).

    ``low_us``/``high_us`` bound the delays (``fixed`` uses ``low_us``); ``mixed`` is
    field case F01 (head-of-line blocking): short delays uniform in [0, 60 s] with one
    24 h delay after every 100 short ones.
    """

    kind: str
    low_us: int = 0
    high_us: int = 0

    def __str__(self) -> str:
        if self.kind == "mixed":
            return "mixed"
        if self.kind == "fixed":
            return f"fixed:{self.low_us / 1e6:g}s"
        return f"{self.kind}:{self.low_us / 1e6:g}s:{self.high_us / 1e6:g}s"

    def draw(self, count: int, rng: random.Random) -> list[int]:
        """``count`` delays in µs."""
        if self.kind == "fixed":
            return [self.low_us] * count
        if self.kind == "uniform":
            return [rng.randint(self.low_us, self.high_us) for _ in range(count)]
        if self.kind == "loguniform":
            low, high = math.log(self.low_us), math.log(self.high_us)
            return [math.ceil(math.exp(rng.uniform(low, high))) for _ in range(count)]
        delays = []
        for index in range(count):
            if index % (_F01_LONG_EVERY + 1) == _F01_LONG_EVERY // 2:
                delays.append(LONG_DELAY_US)
            else:
                delays.append(rng.randint(0, _F01_SHORT_MAX_US))
        return delays


def parse_delays(text: str) -> Delays:
    """``loguniform:10ms:10m``, ``uniform:0:60s``, ``fixed:5s`` or ``mixed``.

    Raises:
        ValueError: the text names no known distribution or its bounds are bad.
    """
    kind, *bounds = text.strip().split(":")
    if kind == "mixed" and not bounds:
        return Delays("mixed", 0, LONG_DELAY_US)
    if kind == "fixed" and len(bounds) == 1:
        return Delays("fixed", _us(bounds[0]), _us(bounds[0]))
    if kind in ("uniform", "loguniform") and len(bounds) == 2:
        low, high = _us(bounds[0]), _us(bounds[1])
        if low > high or (kind == "loguniform" and low <= 0):
            relation = "<" if kind == "loguniform" else "<="
            raise ValueError(f"{text!r}: need 0 {relation} low <= high")
        return Delays(kind, low, high)
    raise ValueError(
        f"{text!r}: use loguniform:LOW:HIGH, uniform:LOW:HIGH, fixed:D or mixed "
        "(durations like 10ms, 5s, 10m)"
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """What every strategy is given: the same delays, paced at the same rate.

    ``count`` for ``mixed`` is the number of short messages; the long ones come on top.
    """

    count: int
    rate: float
    delays: Delays
    payload_bytes: int
    seed: int

    def delays_us(self) -> list[int]:
        """The delays in µs, in scheduling order (same seed, same list)."""
        rng = random.Random(self.seed)
        if self.delays.kind == "mixed":
            total = self.count + self.count // _F01_LONG_EVERY
            return self.delays.draw(total, rng)
        return self.delays.draw(self.count, rng)

    def describe(self) -> dict[str, object]:
        delays = self.delays_us()
        return {
            "count": len(delays),
            "rate_per_s": self.rate,
            "delays": str(self.delays),
            "payload_bytes": self.payload_bytes,
            "seed": self.seed,
            "long_delays_24h": sum(1 for d in delays if d >= LONG_DELAY_US),
            "max_delay_s": max(delays, default=0) / 1e6,
        }
