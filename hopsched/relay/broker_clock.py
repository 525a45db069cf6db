"""The relay's clock, corrected by its offset from the broker's clock (F41).

The broker writes the instant it dead-letters a hop out of a step queue into the hop's
``x-death`` ``time`` (an AMQP timestamp: whole seconds, by the broker's clock). Such a
hop normally reaches the relay within milliseconds, so ``receipt by the relay's clock -
x-death time`` is the relay's offset from the broker plus how long the hop waited in
the relay queue plus the sub-second part the timestamp dropped (0 to 1 s). The last
two are never negative: every sample is at least the offset, and the smallest recent
sample is an estimate that never under-states it (``OffsetEstimator``).

With second resolution, offsets under ``CLOCK_SKEW_THRESHOLD_US`` (2 s) are neither
reported nor corrected: a healthy relay shows 0 to 1 s (plus its queueing) too. A relay
ahead by more waits the estimate out: every decision reads ``BrokerClock``, the relay's
clock minus the estimate, which is never ahead of the broker's clock (at most the
estimate's excess, up to ~1 s, behind it).

Pure: no I/O, no logging; the relay logs and exports what ``BrokerClock`` says.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

__all__ = [
    "CLOCK_SKEW_THRESHOLD_US",
    "RESOLUTION_US",
    "SAMPLE_WINDOW_US",
    "BrokerClock",
    "OffsetEstimator",
    "correction_us",
]

#: A relay whose estimated offset from the broker's clock is past this (µs), either
#: way, is reported (ahead: an ERROR and the correction; behind: a WARNING). Two
#: seconds: one for the x-death time's whole seconds, one for queueing and the broker.
CLOCK_SKEW_THRESHOLD_US = 2_000_000

#: The x-death time's resolution (µs): whole seconds.
RESOLUTION_US = 1_000_000

#: Samples count for this long (µs, by the relay's clock) after a newer one: a clock
#: set right (NTP) is seen within a minute, and a relay with no traffic keeps its last
#: estimate rather than forgetting it.
SAMPLE_WINDOW_US = 60_000_000


class OffsetEstimator:
    """The smallest ``received - died`` sample (µs) of the last ``window_us`` before
    the newest sample: a sliding-window minimum (a monotonic deque, O(1) amortised)."""

    def __init__(self, window_us: int = SAMPLE_WINDOW_US) -> None:
        self.window_us = window_us
        self._samples: deque[tuple[int, int]] = deque()  # (received, sample), samples rising
        self.count = 0

    def record(self, received_us: int, died_us: int) -> None:
        """A hop the broker dead-lettered at ``died_us`` (its clock, whole seconds) reached
        the relay at ``received_us`` (the relay's uncorrected clock)."""
        sample = received_us - died_us
        samples = self._samples
        while samples and samples[-1][1] >= sample:
            samples.pop()
        samples.append((received_us, sample))
        while samples[0][0] < received_us - self.window_us:
            samples.popleft()
        self.count += 1

    @property
    def estimate_us(self) -> int | None:
        """The relay's offset from the broker, µs (positive: the relay is ahead), never
        below the true offset; None before the first sample."""
        return self._samples[0][1] if self._samples else None


def correction_us(estimate_us: int | None, threshold_us: int = CLOCK_SKEW_THRESHOLD_US) -> int:
    """What to subtract from the relay's clock: the estimate when it is ahead past
    ``threshold_us``, else 0 (below, second resolution cannot tell skew from rounding)."""
    if estimate_us is None or estimate_us <= threshold_us:
        return 0
    return estimate_us


class BrokerClock:
    """The relay's clock minus ``correction_us(estimate)``: call it for the time now, µs.

    Args:
        raw: the relay's own clock, µs since the epoch.
        threshold_us: see ``correction_us``.
    """

    def __init__(self, raw: Callable[[], int], threshold_us: int = CLOCK_SKEW_THRESHOLD_US) -> None:
        self.raw = raw
        self.threshold_us = threshold_us
        self.estimator = OffsetEstimator()
        self.correction_us = 0

    def __call__(self) -> int:
        return self.raw() - self.correction_us

    def record(self, died_us: int, received_us: int | None = None) -> None:
        """A hop dead-lettered at ``died_us`` by the broker reached the relay now (or at
        ``received_us``, the raw clock)."""
        self.estimator.record(self.raw() if received_us is None else received_us, died_us)
        wanted = correction_us(self.estimator.estimate_us, self.threshold_us)
        # Down at once (a smaller sample bounds the offset better); up only by more than
        # the resolution (a clock stepped ahead): the estimate rises by a fraction of a
        # second as its smallest sample leaves the window, and each rise makes the hops in
        # the steps, stamped by the corrected clock, seem back early.
        if wanted < self.correction_us or wanted > self.correction_us + RESOLUTION_US:
            self.correction_us = wanted

    @property
    def offset_us(self) -> int | None:
        """The estimated offset from the broker's clock, µs (positive: ahead); None
        before the first sample."""
        return self.estimator.estimate_us

    @property
    def skew(self) -> str | None:
        """``"ahead"`` or ``"behind"`` when the estimate is past the threshold, else None."""
        offset = self.offset_us
        if offset is None or abs(offset) <= self.threshold_us:
            return None
        return "ahead" if offset > 0 else "behind"
