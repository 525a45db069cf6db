"""What a hop's arrival at the relay says: how far the relay's clock is off the broker's
(its x-death time, ``hopsched.relay.broker_clock``), how late the broker dead-letters (the
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

from hopsched.core.clock import now_us
from hopsched.core.envelope import (
    HEADER_HOP_CLOCK,
    HEADER_HOP_EXPIRES,
    RELAY_CLOCK,
    Death,
    latest_death,
)
from hopsched.core.overshoot import OvershootTracker
from hopsched.relay.broker_clock import BrokerClock
from hopsched.relay.stats import RelayStats

__all__ = ["PROMPT_HOP_US", "QUEUED_TOO_LONG_US", "HopTiming"]

log = logging.getLogger("hopsched.relay")

#: A first hop consumed this long (µs) after the broker dead-lettered it (its x-death
#: time, whole seconds) waited in the relay queue: its lateness says nothing of the
#: producer's clock. Two seconds: one for the rounding, one for the clocks of broker and
#: relay.
QUEUED_TOO_LONG_US = 2_000_000


#: A hop the relay stamped that arrives more than this (µs) after its TTL's end by the
#: relay's clock (overshoot plus its wait in the relay queue) is no sample of the clock's
#: offset: a sample exceeds the offset by that wait plus the x-death time's dropped
#: fraction (up to 1 s), and 0.5 + 1 s stays below the 2 s threshold. The broker's
#: overshoot is a few to a hundred ms (docs/guarantees.md). A crowded relay whose hops
#: waited 1-2 s there seemed 2.2 s ahead with the 2 s bound of ``QUEUED_TOO_LONG_US``.
PROMPT_HOP_US = 500_000


class HopTiming:
    """Times each arriving hop into ``broker_clock``, ``stats`` and ``overshoot``.

    Args:
        stats: the relay's counters (overshoot samples, producers' clock offsets).
        overshoot: the tracker the hop margin is planned from.
        cap_us: the largest overshoot sample taken, µs (the hold window: the margin is
            capped there anyway, and one absurd value, a relay down for hours, must not
            pin it there for minutes).
        broker_clock: the relay's clock corrected by its offset from the broker's
            (default: a ``BrokerClock`` of the wall clock).
    """

    def __init__(
        self,
        stats: RelayStats,
        overshoot: OvershootTracker,
        cap_us: int,
        broker_clock: BrokerClock | None = None,
    ) -> None:
        self.stats = stats
        self.overshoot = overshoot
        self.cap_us = cap_us
        self.broker_clock = broker_clock or BrokerClock(now_us)
        self._skew_reported: str | None = None  # this log interval's, "ahead"/"behind"
        self._own_sample = False  # a prompt hop the relay stamped was sampled

    def observe_broker(
        self,
        headers: Mapping[str, Any],
        *,
        death: Death | None = None,
        backlog: bool = False,
        crowded: bool = False,
    ) -> bool:
        """Before anything is decided about a hop just received: its x-death time against
        the relay's own clock (``BrokerClock.record``). A hop the relay stamped that
        may have waited in the relay queue (arrived over ``PROMPT_HOP_US`` past its TTL's
        end, both by the relay's clock, so whatever its offset) is no sample: a backlog
        would look like a clock ahead. A hop it did not stamp (a producer's first
        hop) cannot show whether it waited: it is a sample only until the relay's first
        prompt hop of its own, and not with ``backlog`` (it was in the relay queue when
        the relay began consuming, or is redelivered) nor ``crowded`` (the relay held
        unacked half its prefetch lately: its queue may back up). A crowded relay took its
        queue's wait for a clock 2.1 s ahead without the last rule, and parked hops that
        then seemed back early. Returns whether the correction changed. Logs an ERROR
        (ahead: corrected) or a WARNING (behind) the first time in a log interval the
        estimate is past the threshold. ``death``: ``latest_death(headers)``, if the
        caller read it already."""
        died, reason = death if death is not None else latest_death(headers)
        if died is None or reason != "expired":
            return False
        clock = self.broker_clock
        expires = headers.get(HEADER_HOP_EXPIRES)
        if headers.get(HEADER_HOP_CLOCK) == RELAY_CLOCK and type(expires) is int:
            if clock() - expires > PROMPT_HOP_US:
                return False
            self._own_sample = True
        elif backlog or crowded or self._own_sample:
            return False
        correction = clock.correction_us
        clock.record(died)
        changed = clock.correction_us != correction
        skew = clock.skew
        self.stats.relay_clock_offset_us = clock.offset_us
        if skew is None or skew == self._skew_reported:
            return changed
        self._skew_reported = skew
        offset_s = (clock.offset_us or 0) / 1_000_000
        if skew == "ahead":
            log.error(
                "the relay's clock is %+.1f s off the broker's (ahead, by the x-death times "
                "the broker writes): it would deliver that early; it waits the offset out, "
                "but run NTP on the relay's host",
                offset_s,
            )
        else:
            log.warning(
                "the relay's clock is %+.1f s off the broker's (behind, by the x-death times "
                "the broker writes): every message is delivered that late; run NTP on the "
                "relay's host (producers' clocks are measured against the broker's)",
                offset_s,
            )
        return changed

    def new_interval(self) -> None:
        """A new log interval: the clock's skew is logged again if it is still there."""
        self._skew_reported = None

    def measure(self, headers: Mapping[str, Any], now: int, *, death: Death | None = None) -> None:
        """A hop's overshoot (arrival ``now`` - its TTL's end, µs) from the relay's own
        stamps; from a producer's stamp, the producer's clock offset
        (``RelayStats.record_clock_sample``, which warns once it is past 1 s).
        ``death``: ``latest_death(headers)``, if the caller read it already."""
        expires = headers.get(HEADER_HOP_EXPIRES)
        died, reason = death if death is not None else latest_death(headers)
        # Only a TTL's end times a hop: one dead-lettered for a delivery limit, a length
        # limit or a reject left its step at another time (seen: "+4294967.2 s" off).
        if type(expires) is not int or reason != "expired":
            return
        sample = now - expires
        clock = headers.get(HEADER_HOP_CLOCK)
        if clock == RELAY_CLOCK:
            self.stats.record_overshoot(sample)
            self.overshoot.record(min(sample, self.cap_us), now)
        elif isinstance(clock, str):
            if died is None or now - died > QUEUED_TOO_LONG_US:
                return  # it waited in the relay queue (a backlog, no relay): not a clock
            # A relay behind the broker (not corrected) makes every producer look ahead
            # by its offset: measure the producers against the broker's clock then.
            behind = self.broker_clock.skew == "behind"
            relay_offset = self.broker_clock.offset_us or 0
            offset = self.stats.record_clock_sample(
                clock,
                sample - relay_offset if behind else sample,
                waited_up_to_us=QUEUED_TOO_LONG_US,
                # the relay's offset is known to the second only
                resolution_us=1_000_000 if behind else 0,
            )
            if offset is not None:
                log.warning(
                    "producer %s's clock seems %+.1f s off the %s's: its due times are "
                    "read by the relay's clock and shift by as much (run NTP on it)",
                    clock,
                    offset / 1_000_000,
                    "broker" if behind else "relay",
                )
