"""Recurring rules: the next occurrence of an interval or a cron expression in a time
zone, and what the relay does when an occurrence comes due. Pure: no I/O; the clock
comes in as arguments.

A ``Rule`` is carried, encoded (``Rule.encode``, a compact JSON text), in header
``x-hopsched-rule`` of each occurrence in the ladder. When an occurrence is due the
relay asks ``plan_link`` what to deliver (the occurrence itself, the latest one missed,
or nothing) and which occurrence comes next; it publishes both, confirmed, before it
acks (docs/recurring.md).

Instants are integer µs since the Unix epoch, UTC.

* **Interval** (``every``): the occurrences are ``start + k * every`` for k = 0, 1, ...:
  elapsed time, the same in every zone (no DST effect).
* **Cron** (``cron`` and ``tz``): parsed and iterated by cronsim
  (https://github.com/cuu508/cronsim), which follows Debian cron: an expression with a
  fixed minute and hour (``30 2 * * *``) is read on the zone's wall clock, so a time in
  the spring-forward gap runs at the first instant after it (02:30 on a day the clocks
  jump from 02:00 to 03:00 runs at 03:00), and a time in the fall-back fold runs once,
  at its first (summer-time) instance. An expression whose minute or hour field starts
  with ``*`` (``*/15 * * * *``) is read in real time: it runs in the repeated hour of a
  fall-back day too, and nothing runs in the missing hour of a spring-forward day. Time
  zones are ``zoneinfo``'s (IANA names). A 6-field expression starts with seconds.

An occurrence is after ``start`` (included) and not after ``until`` (included); at most
``count`` occurrences are delivered (skipped ones do not count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from enum import StrEnum
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from hopsched.core.clock import MAX_DUE_US, datetime_to_us, timedelta_to_us, us_to_datetime
from hopsched.errors import InvalidScheduleError

__all__ = [
    "MIN_EVERY_US",
    "MISSED_AFTER_US",
    "CatchUp",
    "Link",
    "Recurrence",
    "Rule",
    "plan_link",
]

#: The shortest interval, µs (1 s, a cron expression's own granularity): shorter ones
#: would make the relay a busy loop.
MIN_EVERY_US = 1_000_000
#: An occurrence the relay reaches more than this long (µs) after its due time was
#: missed (no relay ran, the broker was down): ``CatchUp`` says what becomes of it.
#: Far above a relay's normal lateness (milliseconds, docs/guarantees.md).
MISSED_AFTER_US = 10_000_000
#: Occurrences a cron catch-up steps over at most before it jumps to the last one by
#: iterating backwards from now.
_FORWARD_STEPS = 1000


class CatchUp(StrEnum):
    """What the relay does with the occurrences due by the time it reaches one.

    ``LATEST`` (the default): the occurrences due by now collapse into the latest of them,
    delivered once (with its own due time); then the rule goes on. ``ALL``: every one is
    delivered, the late ones at once one after another. ``NONE``: occurrences missed
    (reached more than ``MISSED_AFTER_US`` late) are skipped; the latest due one is
    delivered only if it is not missed. Without an outage the three are the same.
    References: Kubernetes CronJob (``startingDeadlineSeconds``: only the latest missed
    schedule starts), Celery beat (a missed run runs once when beat comes back).
    """

    LATEST = "latest"
    ALL = "all"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Recurrence:
    """A recurring schedule as a value, to pass to ``Scheduler.schedule(...,
    recurrence=...)``: defined once, named, reused (as arq's ``cron()`` makes a
    ``CronJob``). ``Recurrence(every=timedelta(hours=1), count=24)`` or
    ``Recurrence(cron="0 9 * * 1-5", tz="Europe/Paris")``.

    The fields are ``schedule()``'s recurrence keywords, which still work; they are
    checked when scheduled (``Rule.make``), where "now" is known: an interval's first
    occurrence is one interval after that call unless ``start`` says otherwise.

    Attributes:
        every: the interval, a timedelta or seconds (at least 1 s).
        cron: or a cron expression (5 fields, or 6 with seconds first).
        tz: the IANA time zone ``cron`` is read in (default UTC); not for ``every``.
        start, until: aware datetimes: no occurrence before ``start``, none after
            ``until`` (default: no end).
        count: at most this many occurrences are delivered (default: no limit).
        catch_up: ``"latest"`` (default), ``"all"`` or ``"none"`` (``CatchUp``).
    """

    every: timedelta | float | None = None
    cron: str | None = None
    tz: str | None = None
    start: datetime | None = None
    until: datetime | None = None
    count: int | None = None
    catch_up: str = "latest"

    def rule(self, now_us: int) -> Rule:
        """This recurrence's rule as of ``now_us`` (µs since the epoch).

        Raises:
            InvalidScheduleError: as ``Rule.make``.
        """
        return Rule.make(
            now_us=now_us,
            every=self.every,
            cron=self.cron,
            tz=self.tz,
            start=self.start,
            until=self.until,
            count=self.count,
            catch_up=self.catch_up,
        )


@dataclass(frozen=True, slots=True)
class Rule:
    """A recurring schedule's rule (build it with ``Rule.make``).

    Attributes:
        every_us: the interval, µs; None for a cron rule.
        cron: the cron expression (5 fields, or 6 with seconds first); None for an interval.
        tz: the IANA time zone the cron expression is read in (``"UTC"`` for an interval).
        start_us: no occurrence before it (µs since the epoch); an interval's first.
        until_us: no occurrence after it; None: no end.
        count: at most this many occurrences are delivered; None: no limit.
        catch_up: see ``CatchUp``.
    """

    every_us: int | None
    cron: str | None
    tz: str
    start_us: int
    until_us: int | None = None
    count: int | None = None
    catch_up: CatchUp = CatchUp.LATEST

    @classmethod
    def make(
        cls,
        *,
        now_us: int,
        every: timedelta | float | None = None,
        cron: str | None = None,
        tz: str | None = None,
        start: datetime | None = None,
        until: datetime | None = None,
        count: int | None = None,
        catch_up: str = "latest",
    ) -> Rule:
        """Check a recurring ``schedule()`` call's arguments and build its rule.

        Args:
            now_us: the clock's reading, µs since the epoch.
            every: the interval, a timedelta or seconds (at least 1 s).
            cron: or a cron expression, e.g. ``"0 9 * * 1-5"``.
            tz: the time zone of ``cron`` (IANA name, default ``"UTC"``); not for ``every``.
            start: aware datetime, the first instant an occurrence may have (default: now
                for cron; now + ``every`` for an interval, its first occurrence).
            until: aware datetime, the last instant an occurrence may have.
            count: at most this many deliveries (>= 1).
            catch_up: ``"latest"``, ``"all"`` or ``"none"`` (``CatchUp``).

        Raises:
            InvalidScheduleError: naming the argument: both or neither of every and cron,
                an interval under 1 s, an invalid cron expression or unknown zone, tz
                with every, naive datetimes, until before start, count < 1, an unknown
                catch_up, a rule with no occurrence at all.
        """
        if (every is None) == (cron is None):
            raise InvalidScheduleError(
                "give exactly one of every= (a timedelta or seconds) and cron= (e.g. "
                "'0 9 * * 1-5') for a recurring schedule"
            )
        try:
            policy = CatchUp(catch_up)
        except ValueError:
            raise InvalidScheduleError(
                f"catch_up={catch_up!r}: use 'latest' (the default), 'all' or 'none'"
            ) from None
        every_us = None if every is None else _every_us(every)
        if cron is not None:
            zone = tz if tz is not None else "UTC"
            _check_cron(cron, zone)
        elif tz is not None:
            raise InvalidScheduleError(
                f"tz={tz!r} applies to cron= only: an interval is elapsed time, the same "
                "in every zone (give start= in the zone you mean instead)"
            )
        else:
            zone = "UTC"
        if start is not None:
            start_us = _aware_us("start", start)
        elif every_us is not None:
            start_us = now_us + every_us
        else:
            start_us = now_us
        until_us = None if until is None else _aware_us("until", until)
        if until_us is not None and until_us < start_us:
            raise InvalidScheduleError(
                f"until={until.isoformat() if until else until} is before the start "
                f"({us_to_datetime(start_us).isoformat()}): no occurrence would be delivered"
            )
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            raise InvalidScheduleError(f"count={count!r}: give a whole number of occurrences")
        if count is not None and count < 1:
            raise InvalidScheduleError(f"count={count}: give at least 1 (None: no limit)")
        rule = cls(every_us, cron, zone, start_us, until_us, count, policy)
        if rule.first_us() is None:
            raise InvalidScheduleError(
                f"the rule has no occurrence between {us_to_datetime(start_us).isoformat()} "
                f"and until={until.isoformat() if until else 'no end'} (cron={cron!r})"
            )
        return rule

    # --- occurrences -----------------------------------------------------------------------

    def first_us(self) -> int | None:
        """The first occurrence (at or after ``start_us``), µs; None if there is none."""
        return self.next_after_us(self.start_us - 1)

    def next_after_us(self, instant_us: int) -> int | None:
        """The first occurrence strictly after ``instant_us`` (µs since the epoch), and
        not before ``start_us`` nor after ``until_us``; None if there is none (``count``
        is the chain's to apply: it counts deliveries)."""
        after = max(instant_us, self.start_us - 1)
        if self.every_us is not None:
            steps = (after - self.start_us) // self.every_us + 1
            due = self.start_us + steps * self.every_us
        else:
            found = self._cron_after(after)
            if found is None:
                return None
            due = found
        if due > MAX_DUE_US or (self.until_us is not None and due > self.until_us):
            return None
        return due

    def next_after(self, instant: datetime) -> datetime | None:
        """``next_after_us`` for an aware datetime; the result in UTC (None: no more).

        Raises:
            InvalidScheduleError: ``instant`` is naive.
        """
        found = self.next_after_us(_aware_us("instant", instant))
        return None if found is None else us_to_datetime(found)

    def latest_due_us(self, since_us: int, now_us: int) -> int:
        """The last occurrence at or before ``now_us``, given that ``since_us`` (an
        occurrence) is one: ``since_us`` itself if none later is due yet."""
        if now_us <= since_us:
            return since_us
        if self.every_us is not None:
            latest = since_us + (now_us - since_us) // self.every_us * self.every_us
        else:
            latest = since_us
            for _ in range(_FORWARD_STEPS):
                following = self._cron_after(latest)
                if following is None or following > now_us:
                    break
                latest = following
            else:  # a long outage: jump to the last instant before now, backwards
                back = self._cron_before(now_us)
                latest = max(latest, back) if back is not None else latest
        if self.until_us is not None and latest > self.until_us:
            return max(since_us, self._last_until())
        return latest

    def count_between_us(self, since_us: int, before_us: int) -> int:
        """How many occurrences are at or after ``since_us`` (an occurrence) and before
        ``before_us``, µs; for a cron rule at most ``_FORWARD_STEPS`` (1,000) are counted."""
        if before_us <= since_us:
            return 0
        if self.every_us is not None:
            return -(-(before_us - since_us) // self.every_us)
        found, instant = 1, since_us
        while found < _FORWARD_STEPS:
            following = self._cron_after(instant)
            if following is None or following >= before_us:
                break
            found, instant = found + 1, following
        return found

    def _zone(self) -> tzinfo:
        return UTC if self.tz == "UTC" else ZoneInfo(self.tz)

    def _cron_after(self, instant_us: int) -> int | None:
        assert self.cron is not None
        instant = us_to_datetime(instant_us)
        local = instant.astimezone(self._zone())
        iterator = CronSim(self.cron, local)
        try:
            # cronsim reads fixed-time expressions on the wall clock, where an instant in
            # the second pass of a fall-back fold comes before ones it already passed: an
            # occurrence is strictly after the instant, or it is not the next one.
            while (found := datetime_to_us(next(iterator))) <= instant_us:
                pass
        except StopIteration:  # cronsim: no match within 50 years
            return None
        return found

    def _cron_before(self, instant_us: int) -> int | None:
        assert self.cron is not None
        local = us_to_datetime(instant_us + 1_000_000).astimezone(self._zone())
        iterator = CronSim(self.cron, local, reverse=True)
        try:
            while (found := datetime_to_us(next(iterator))) > instant_us:
                pass
        except StopIteration:
            return None
        return found

    def _last_until(self) -> int:
        assert self.until_us is not None
        if self.every_us is not None:
            return self.start_us + (self.until_us - self.start_us) // self.every_us * self.every_us
        back = self._cron_before(self.until_us)
        return back if back is not None else self.start_us

    # --- header value ----------------------------------------------------------------------

    def encode(self) -> str:
        """The rule as header ``x-hopsched-rule``: compact JSON, keys ``v`` (1), ``e``
        (interval µs) or ``c`` and ``z`` (cron, zone), ``s`` (start µs) and when set
        ``u`` (until µs), ``n`` (count), ``k`` (catch-up, when not ``latest``)."""
        fields: dict[str, Any] = {"v": 1}
        if self.every_us is not None:
            fields["e"] = self.every_us
        else:
            fields["c"] = self.cron
            fields["z"] = self.tz
        fields["s"] = self.start_us
        if self.until_us is not None:
            fields["u"] = self.until_us
        if self.count is not None:
            fields["n"] = self.count
        if self.catch_up is not CatchUp.LATEST:
            fields["k"] = self.catch_up.value
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def decode(cls, text: str) -> Rule:
        """The rule of a header value written by ``encode``.

        Raises:
            InvalidScheduleError: not a rule this version reads, naming what is wrong.
        """
        try:
            fields = json.loads(text)
        except ValueError:
            raise InvalidScheduleError(f"recurring rule {text[:80]!r} is not JSON") from None
        if not isinstance(fields, dict) or fields.get("v") != 1:
            raise InvalidScheduleError(f"recurring rule {text[:80]!r}: not version 1")
        every, cron, zone = fields.get("e"), fields.get("c"), fields.get("z", "UTC")
        start, until, count = fields.get("s"), fields.get("u"), fields.get("n")
        if (
            (every is None) == (cron is None)
            or not _int_or_none(every)
            or not _int_or_none(until)
            or not _int_or_none(count)
            or type(start) is not int
            or (cron is not None and not isinstance(cron, str))
            or not isinstance(zone, str)
            or (every is not None and every < MIN_EVERY_US)
            or (count is not None and count < 1)
        ):
            raise InvalidScheduleError(f"recurring rule {text[:80]!r}: a field is missing or bad")
        try:
            policy = CatchUp(fields.get("k", "latest"))
        except ValueError:
            raise InvalidScheduleError(f"recurring rule {text[:80]!r}: unknown catch-up") from None
        if cron is not None:
            _check_cron(cron, zone)
        return cls(every, cron, zone, start, until, count, policy)


def _int_or_none(value: object) -> bool:
    return value is None or type(value) is int


@dataclass(frozen=True, slots=True)
class Link:
    """What the relay does with a recurring occurrence it reached (``plan_link``).

    Attributes:
        deliver_us: the due time of the occurrence to deliver now (the one reached, or
            under ``CatchUp.LATEST`` the latest due); None: deliver nothing (missed,
            under ``CatchUp.NONE``).
        next_us: the due time of the next occurrence to schedule; None: the chain ends
            (``until`` passed, ``count`` reached).
        skipped: occurrences due by ``now_us`` not delivered: under ``CatchUp.LATEST``
            those collapsed into the latest, under ``CatchUp.NONE`` those and the latest
            when it was missed; 0 under ``CatchUp.ALL``. A cron catch-up counts at most
            ``_FORWARD_STEPS`` (1,000) of them. Not compared: what the relay counts, not
            what it does.
        ended_by: why the chain ends (``next_us`` None): ``"count"`` (``count``
            occurrences delivered) or ``"until"`` (no occurrence on the rule before
            ``until``, or none at all); None while it goes on.
    """

    deliver_us: int | None
    next_us: int | None
    skipped: int = field(default=0, compare=False)
    ended_by: str | None = field(default=None, compare=False)


def plan_link(rule: Rule, due_us: int, delivered: int, now_us: int) -> Link:
    """What to deliver of an occurrence due at ``due_us``, reached at ``now_us``, after
    ``delivered`` occurrences of its chain were delivered, and which comes next.

    The next occurrence is strictly after the one delivered (or skipped), on the rule;
    none once ``count`` occurrences are delivered or after ``until``.
    """
    skipped = 0
    if rule.catch_up is CatchUp.ALL:
        deliver: int | None = due_us
        last = due_us
    else:
        last = rule.latest_due_us(due_us, now_us)
        missed = now_us - last > MISSED_AFTER_US
        deliver = None if rule.catch_up is CatchUp.NONE and missed else last
        if last > due_us:
            skipped = rule.count_between_us(due_us, last)
        skipped += deliver is None
    delivered += deliver is not None
    if rule.count is not None and delivered >= rule.count:
        return Link(deliver, None, skipped, "count")
    following = rule.next_after_us(last)
    return Link(deliver, following, skipped, "until" if following is None else None)


def _every_us(every: timedelta | float) -> int:
    if isinstance(every, timedelta):
        every_us = timedelta_to_us(every)
    elif isinstance(every, bool) or not isinstance(every, int | float) or every != every:
        raise InvalidScheduleError(f"every={every!r}: give a timedelta or seconds")
    elif every > MAX_DUE_US / 1_000_000:
        every_us = MAX_DUE_US
    else:
        every_us = round(every * 1_000_000)
    if every_us < MIN_EVERY_US:
        raise InvalidScheduleError(
            f"every={every_us / 1e6:g} s: the shortest interval is {MIN_EVERY_US / 1e6:g} s"
        )
    return every_us


def _check_cron(cron: str, zone: str) -> None:
    if not isinstance(cron, str):
        raise InvalidScheduleError(f"cron={cron!r}: give a cron expression as text")
    try:
        zone_info: tzinfo = UTC if zone == "UTC" else ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidScheduleError(
            f"tz={zone!r} is not a time zone zoneinfo knows: give an IANA name such as "
            "'Europe/Paris' or 'America/New_York' (python -c 'import zoneinfo; "
            "print(zoneinfo.available_timezones())' lists them)"
        ) from None
    try:
        CronSim(cron, datetime(2000, 1, 1, tzinfo=zone_info))
    except (CronSimError, ValueError, IndexError) as error:
        raise InvalidScheduleError(
            f"cron={cron!r} is not a valid cron expression ({error}): five fields, minute "
            "hour day-of-month month day-of-week, e.g. '0 9 * * 1-5' (or six, seconds first)"
        ) from None


def _aware_us(name: str, value: datetime) -> int:
    if not isinstance(value, datetime):
        raise InvalidScheduleError(f"{name}={value!r}: must be a datetime")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidScheduleError(
            f"{name}={value.isoformat()} is a naive datetime: pass an aware one, e.g. "
            "datetime(2030, 1, 1, 9, tzinfo=ZoneInfo('Europe/Paris'))"
        )
    return datetime_to_us(value)
