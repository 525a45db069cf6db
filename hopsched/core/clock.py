"""Wall-clock time as integer microseconds since the Unix epoch (UTC), and conversions."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

__all__ = ["MAX_DUE_US", "datetime_to_us", "now_us", "timedelta_to_us", "us_to_datetime"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
#: The last due time a datetime can name (the end of year 9999), µs since the epoch.
MAX_DUE_US = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // _US


def now_us() -> int:
    """The wall clock, integer microseconds since the Unix epoch (UTC)."""
    return time.time_ns() // 1_000


def datetime_to_us(value: datetime) -> int:
    """An aware datetime as integer microseconds since the epoch (exact, no float)."""
    return (value - _EPOCH) // _US


def timedelta_to_us(value: timedelta) -> int:
    """A timedelta as integer microseconds (exact, no float)."""
    return value // _US


_MIN_US = (datetime.min.replace(tzinfo=UTC) - _EPOCH) // _US


def us_to_datetime(value_us: int) -> datetime:
    """Microseconds since the epoch as an aware UTC datetime; one beyond what a datetime
    can name (years 1 to 9999) as its bound, not an ``OverflowError``: a header or a
    journal record another client wrote can say anything, and one such value made every
    listing command fail (a new-user trial's ``x-delay`` of 10^15 ms)."""
    return _EPOCH + timedelta(microseconds=min(max(value_us, _MIN_US), MAX_DUE_US))
