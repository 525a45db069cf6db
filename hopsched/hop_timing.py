"""What a hop's arrival at the relay says: how late the broker dead-letters (the
overshoot, which sets the hop margin) and, from a producer's first hop, how far that
producer's clock is off the relay's.

A hop carries the instant its TTL runs out (``x-hopsched-hop-expires``) stamped by the
clock of whoever published it (``x-hopsched-hop-clock``): the relay's own stamps time the
broker; a producer's stamp, arriving promptly, times the producer's clock.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hopsched.envelope import (
    HEADER_HOP_CLOCK,
    HEADER_HOP_EXPIRES,
    RELAY_CLOCK,
    dead_letter_reason,
    dead_lettered_us,
)
from hopsched.overshoot import OvershootTracker
from hopsched.stats import RelayStats

__all__ = ["QUEUED_TOO_LONG_US", "HopTiming"]

log = logging.getLogger("hopsched.relay")

#: A first hop consumed this long (µs) after the broker dead-lettered it (its x-death
#: time, whole seconds) waited in the relay queue: its lateness says nothing of the
#: producer's clock. Two seconds: one for the rounding, one for the clocks of broker and
#: relay.
QUEUED_TOO_LONG_US = 2_000_000


class HopTiming:
    """Times each arriving hop into ``stats`` and ``overshoot``.

    Args:
        stats: the relay's counters (overshoot samples, producers' clock offsets).
        overshoot: the tracker the hop margin is planned from.
        cap_us: the largest overshoot sample taken, µs (the hold window: the margin is
            capped there anyway, and one absurd value, a relay down for hours, must not
            pin it there for minutes).
    """

    def __init__(self, stats: RelayStats, overshoot: OvershootTracker, cap_us: int) -> None:
        self.stats = stats
        self.overshoot = overshoot
        self.cap_us = cap_us

    def measure(self, headers: Mapping[str, Any], now: int) -> None:
        """A hop's overshoot (arrival ``now`` - its TTL's end, µs) from the relay's own
        stamps; from a producer's stamp, the producer's clock offset
        (``RelayStats.record_clock_sample``, which warns once it is past 1 s)."""
        expires = headers.get(HEADER_HOP_EXPIRES)
        # Only a TTL's end times a hop: one dead-lettered for a delivery limit, a length
        # limit or a reject left its step at another time (seen: "+4294967.2 s" off).
        if type(expires) is not int or dead_letter_reason(headers) != "expired":
            return
        sample = now - expires
        clock = headers.get(HEADER_HOP_CLOCK)
        if clock == RELAY_CLOCK:
            self.stats.record_overshoot(sample)
            self.overshoot.record(min(sample, self.cap_us), now)
        elif isinstance(clock, str):
            died = dead_lettered_us(headers)
            if died is None or now - died > QUEUED_TOO_LONG_US:
                return  # it waited in the relay queue (a backlog, no relay): not a clock
            offset = self.stats.record_clock_sample(
                clock, sample, waited_up_to_us=QUEUED_TOO_LONG_US
            )
            if offset is not None:
                log.warning(
                    "producer %s's clock seems %+.1f s off the relay's: its due times are "
                    "read by the relay's clock and shift by as much (run NTP on it)",
                    clock,
                    offset / 1_000_000,
                )
