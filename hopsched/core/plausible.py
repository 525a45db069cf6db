"""Whether a due time is one a schedule can mean (field case F43). Pure: no I/O, no clock.

A raw producer that writes ``x-hopsched-due`` in seconds (``time.time()``) or in
milliseconds (JavaScript's ``Date.now()``, Java's ``System.currentTimeMillis()``) instead
of microseconds names an instant in January 1970: read as µs, it is long past due and
would be delivered at once, days or decades early. No schedule means a due time before
``EARLIEST_DUE_US`` (2001-01-01): the relay parks such a message (``implausible_due``),
saying which unit the value looks like. ``schedule()`` refuses one.

The unit readings cannot be confused: a date from 2001 to 9999 in seconds is at most
2.6e11, in milliseconds at least 9.7e11.
"""

from __future__ import annotations

from datetime import UTC, datetime

from hopsched.core.clock import MAX_DUE_US, datetime_to_us, us_to_datetime

__all__ = ["EARLIEST_DUE_US", "implausible_due", "unit_hint"]

#: The earliest due time taken as meant, µs since the epoch: 2001-01-01T00:00:00Z.
EARLIEST_DUE_US = datetime_to_us(datetime(2001, 1, 1, tzinfo=UTC))


def _iso(value_us: int) -> str:
    return us_to_datetime(value_us).isoformat(timespec="seconds").replace("+00:00", "Z")


def _plausible(value_us: int) -> bool:
    return EARLIEST_DUE_US <= value_us <= MAX_DUE_US


def _readings(value: int) -> tuple[tuple[str, int], ...]:
    """``value`` read in each unit a producer may have meant, as µs."""
    return (
        ("seconds", value * 1_000_000),
        ("milliseconds", value * 1_000),
        ("nanoseconds", value // 1_000),
    )


def unit_hint(value: int) -> str | None:
    """The unit an integer due time looks like when it is not µs: ``"seconds"``,
    ``"milliseconds"`` or ``"nanoseconds"`` (read as µs it is before 2001 or after 9999,
    read in that unit a date from 2001 to 9999); None if it is a plausible µs value or
    none of these."""
    if _plausible(value):
        return None
    return next((unit for unit, as_us in _readings(value) if _plausible(as_us)), None)


def implausible_due(due_us: int) -> str | None:
    """Why ``x-hopsched-due`` ``due_us`` (µs since the epoch, ``>= 0``) cannot be meant,
    naming the unit it looks like and the value it should have been; None if it is on or
    after ``EARLIEST_DUE_US``."""
    if due_us >= EARLIEST_DUE_US:
        return None
    unit = unit_hint(due_us)
    if unit is not None:
        meant = dict(_readings(due_us))[unit]
        return (
            f"x-hopsched-due {due_us} looks like {unit} since the epoch ({_iso(meant)}); it must "
            f"be microseconds ({meant}): fix the producer and schedule the body anew"
        )
    return (
        f"x-hopsched-due {due_us} is {_iso(due_us)}, before 2001-01-01: no schedule means that; "
        "it must be the due time in microseconds since the Unix epoch: fix the producer "
        "and schedule the body anew"
    )
