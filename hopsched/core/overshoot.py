"""How late hops come back, and the hop margin that follows from it. Pure: no I/O, no clock.

A hop's overshoot is its arrival at the relay minus the instant its step's TTL ran
out (publish instant + step). On an idle RabbitMQ 3.10 on two cores it is 2.5-3 ms;
under load it grows, and a hop that overshoots its margin makes the message late.
The relay plans with a margin of 1.5 x the recent peak overshoot (at least the
configured one), so a loaded broker gets more time in hand instead of late messages.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OvershootTracker"]


@dataclass(slots=True)
class OvershootTracker:
    """A peak of recent hop overshoots that halves every ``half_life_us`` without news.

    Attributes:
        half_life_us: how fast an old peak is forgotten, µs (default 10 s).
        safety: the margin is this multiple of the peak.
    """

    half_life_us: int = 10_000_000
    safety: float = 1.5
    _peak_us: float = 0.0
    _peak_at_us: int = 0

    def record(self, overshoot_us: int, now_us: int) -> None:
        """Note one hop that came back ``overshoot_us`` µs after its TTL (early: 0)."""
        self._peak_us = max(self.peak_us(now_us), float(max(0, overshoot_us)))
        self._peak_at_us = now_us

    def peak_us(self, now_us: int) -> float:
        """The decayed peak overshoot at ``now_us``, µs."""
        if self._peak_us == 0.0:
            return 0.0
        elapsed_us = max(0, now_us - self._peak_at_us)
        decay: float = 0.5 ** (elapsed_us / self.half_life_us)
        return self._peak_us * decay

    def margin_ms(self, now_us: int, *, floor_ms: int, cap_ms: int) -> int:
        """The hop margin to plan with, ms: ``safety`` x peak, within [floor, max(floor, cap)]."""
        wanted_ms = -(-int(self.safety * self.peak_us(now_us)) // 1000)
        return max(floor_ms, min(wanted_ms, cap_ms))
