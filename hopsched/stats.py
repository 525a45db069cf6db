"""Lateness statistics: an HDR histogram of microseconds, reported in milliseconds."""

from __future__ import annotations

from hdrh.histogram import HdrHistogram

__all__ = ["LatenessStats"]

_HIGHEST_US = 7 * 24 * 3600 * 1_000_000  # a week; larger values are clamped to it


class LatenessStats:
    """Lateness (receive or publish instant - due time) of many messages.

    Values are recorded in µs with 3 significant digits (HdrHistogram); an early
    value (negative lateness) is counted in ``early`` and recorded as 0.
    """

    def __init__(self) -> None:
        self._histogram = HdrHistogram(1, _HIGHEST_US, 3)
        self.early = 0

    def record(self, lateness_us: int) -> None:
        if lateness_us < 0:
            self.early += 1
        self._histogram.record_value(min(max(lateness_us, 0), _HIGHEST_US))

    @property
    def count(self) -> int:
        return int(self._histogram.get_total_count())

    def percentile_ms(self, percentile: float) -> float:
        """The lateness at ``percentile`` (0-100) in ms; 0.0 when nothing was recorded."""
        return float(self._histogram.get_value_at_percentile(percentile)) / 1000

    @property
    def max_ms(self) -> float:
        return float(self._histogram.get_max_value()) / 1000

    @property
    def mean_ms(self) -> float:
        return float(self._histogram.get_mean_value()) / 1000

    def reset(self) -> None:
        self._histogram.reset()
        self.early = 0

    def summary(self) -> str:
        """``p50=… p99=… max=… ms`` for log lines."""
        if not self.count:
            return "lateness n/a"
        return (
            f"lateness p50={self.percentile_ms(50):.1f} p99={self.percentile_ms(99):.1f} "
            f"max={self.max_ms:.1f} ms"
        )
