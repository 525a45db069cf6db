"""``due_time_us``: the due instant from ``at=`` or ``delay=`` (pure, the clock passed in)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hopsched.client.prepare import due_time_us
from hopsched.core.clock import MAX_DUE_US, datetime_to_us, us_to_datetime
from hopsched.core.ladder import Hold, Ladder
from hopsched.errors import HopschedError, InvalidScheduleError

NOW_US = 1_721_041_200_000_000  # 2024-07-15T11:00:00Z
SECOND = 1_000_000


def epoch_us(value: datetime) -> int:
    """Microseconds since the epoch, computed independently of hopsched.core.clock."""
    whole = value.replace(microsecond=0)
    return int(whole.timestamp()) * SECOND + value.microsecond


def ceil_us(delay_s: float) -> int:
    """The delay as the caller wrote it (its shortest repr), in µs, rounded up."""
    return math.ceil(Decimal(repr(delay_s)) * SECOND)


# --- F13: naive and odd-offset datetimes ---------------------------------------------------


@pytest.mark.parametrize(
    "naive",
    [
        pytest.param(datetime.now() + timedelta(minutes=30), id="now-plus-30min"),
        pytest.param(datetime(2024, 7, 15, 12, 0), id="london-summer-wall-clock"),
        pytest.param(datetime(2030, 1, 1), id="midnight"),
    ],
)
def test_F13_naive_datetime_is_rejected_saying_how_to_fix_it(naive: datetime) -> None:
    with pytest.raises(InvalidScheduleError) as caught:
        due_time_us(naive, None, NOW_US)

    message = str(caught.value)
    assert "naive" in message
    assert "aware" in message
    assert "timezone" in message or "time zone" in message
    assert naive.isoformat() in message
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, HopschedError)


class NoOffset(tzinfo):
    """A tzinfo that does not know its offset: the datetime counts as naive."""

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str | None:
        return None


def test_F13_tzinfo_without_an_offset_is_rejected_as_naive() -> None:
    with pytest.raises(InvalidScheduleError, match="naive"):
        due_time_us(datetime(2030, 1, 1, tzinfo=NoOffset()), None, NOW_US)


SUMMER = datetime(2024, 7, 15, 11, 0, 0, 123_456, tzinfo=UTC)
WINTER = datetime(2024, 1, 15, 11, 0, 0, 654_321, tzinfo=UTC)


@pytest.mark.parametrize(
    ("instant", "zone", "offset"),
    [
        pytest.param(SUMMER, "UTC", timedelta(0), id="utc"),
        pytest.param(SUMMER, "Europe/London", timedelta(hours=1), id="london-summer-bst"),
        pytest.param(WINTER, "Europe/London", timedelta(0), id="london-winter-gmt"),
        pytest.param(SUMMER, "Asia/Kolkata", timedelta(hours=5, minutes=30), id="kolkata"),
        pytest.param(SUMMER, "America/St_Johns", -timedelta(hours=2, minutes=30),
                     id="st-johns-summer"),
        pytest.param(WINTER, "America/St_Johns", -timedelta(hours=3, minutes=30),
                     id="st-johns-winter"),
    ],
)  # fmt: skip
def test_F13_the_same_instant_in_any_zone_has_the_same_due_time(
    instant: datetime, zone: str, offset: timedelta
) -> None:
    local = instant.astimezone(ZoneInfo(zone))

    assert local.utcoffset() == offset
    assert due_time_us(local, None, NOW_US) == epoch_us(instant)


@pytest.mark.parametrize(
    ("wall_clock", "utc"),
    [
        pytest.param(datetime(2024, 7, 15, 12, 0, tzinfo=ZoneInfo("Europe/London")),
                     datetime(2024, 7, 15, 11, 0, tzinfo=UTC), id="london-bst"),
        pytest.param(datetime(2024, 7, 15, 16, 30, tzinfo=ZoneInfo("Asia/Kolkata")),
                     datetime(2024, 7, 15, 11, 0, tzinfo=UTC), id="kolkata"),
        pytest.param(datetime(2024, 7, 15, 8, 30, tzinfo=ZoneInfo("America/St_Johns")),
                     datetime(2024, 7, 15, 11, 0, tzinfo=UTC), id="st-johns-ndt"),
        pytest.param(datetime(2024, 1, 15, 7, 30, tzinfo=ZoneInfo("America/St_Johns")),
                     datetime(2024, 1, 15, 11, 0, tzinfo=UTC), id="st-johns-nst"),
        pytest.param(datetime(2024, 7, 15, 16, 30, tzinfo=timezone(timedelta(hours=5.5))),
                     datetime(2024, 7, 15, 11, 0, tzinfo=UTC), id="fixed-offset"),
        pytest.param(datetime(2024, 10, 27, 1, 30, tzinfo=ZoneInfo("Europe/London")),
                     datetime(2024, 10, 27, 0, 30, tzinfo=UTC), id="london-repeated-hour-first"),
        pytest.param(datetime(2024, 10, 27, 1, 30, fold=1, tzinfo=ZoneInfo("Europe/London")),
                     datetime(2024, 10, 27, 1, 30, tzinfo=UTC), id="london-repeated-hour-second"),
    ],
)  # fmt: skip
def test_F13_local_wall_clock_times_fire_at_their_utc_instant(
    wall_clock: datetime, utc: datetime
) -> None:
    assert due_time_us(wall_clock, None, NOW_US) == epoch_us(utc)


@given(
    instant=st.datetimes(
        min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
    ),
    zone=st.sampled_from(["Europe/London", "Asia/Kolkata", "America/St_Johns", "Pacific/Chatham"]),
)
def test_F13_due_time_does_not_depend_on_the_zone(instant: datetime, zone: str) -> None:
    local = instant.astimezone(ZoneInfo(zone))

    assert due_time_us(local, None, NOW_US) == due_time_us(instant, None, NOW_US)
    assert due_time_us(instant, None, NOW_US) == epoch_us(instant)


def test_at_ignores_the_clock() -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)

    assert due_time_us(at, None, 0) == due_time_us(at, None, NOW_US) == epoch_us(at)


def test_at_in_the_past_gives_a_past_due_time() -> None:
    an_hour_ago = datetime(2024, 7, 15, 10, 0, tzinfo=UTC)

    assert due_time_us(an_hour_ago, None, NOW_US) == NOW_US - 3_600 * SECOND


# --- F03: zero, negative and fractional delays ---------------------------------------------


@pytest.mark.parametrize(
    ("delay_s", "asked_us"),
    [
        pytest.param(0, 0, id="int-zero"),
        pytest.param(0.0, 0, id="float-zero"),
        pytest.param(-0.0, 0, id="negative-zero"),
        pytest.param(0.0004, 400, id="0.4ms"),
        pytest.param(0.0015, 1_500, id="1.5ms"),
        pytest.param(0.9999999, 1_000_000, id="999.9999ms"),
        pytest.param(0.0000001, 1, id="0.1us-rounds-up"),
        pytest.param(0.0000015, 2, id="1.5us-rounds-up"),
        pytest.param(1e-300, 1, id="tiny-rounds-up"),
        pytest.param(-5, -5 * SECOND, id="minus-5s-int"),
        pytest.param(-5.0, -5 * SECOND, id="minus-5s"),
        pytest.param(-0.0000015, -1, id="minus-1.5us"),
        pytest.param(86_400, 86_400 * SECOND, id="one-day-int"),
    ],
)
def test_F03_delay_rounds_up_and_is_never_earlier_than_asked(delay_s: float, asked_us: int) -> None:
    due_us = due_time_us(None, delay_s, NOW_US)
    asked_us = max(0, asked_us)  # zero or less means now

    assert due_us >= NOW_US + asked_us
    assert due_us <= NOW_US + asked_us + 1
    assert type(due_us) is int


@pytest.mark.parametrize(
    ("delay_s", "expected_us"),
    [(0.0004, 400), (0.0015, 1_500), (0.9999999, 1_000_000), (-5.0, 0)],
)
def test_F03_exact_due_times(delay_s: float, expected_us: int) -> None:
    assert due_time_us(None, delay_s, NOW_US) == NOW_US + expected_us


@pytest.mark.parametrize("delay_s", [0, 0.0004, 0.0015, -5.0])
def test_F03_zero_tiny_and_past_delays_are_delivered_at_once(delay_s: float) -> None:
    due_us = due_time_us(None, delay_s, NOW_US)

    action = Ladder().plan(now_us=NOW_US, due_us=due_us)

    assert action == Hold(max(0, due_us - NOW_US))


@given(
    tenths_of_us=st.integers(-(10**14), 10**14),
    now_us=st.integers(0, NOW_US * 2),
)
def test_F03_float_delays_with_sub_microsecond_digits_round_up(
    tenths_of_us: int, now_us: int
) -> None:
    delay_s = float(Decimal(tenths_of_us) / 10**7)
    asked_us = ceil_us(delay_s)

    due_us = due_time_us(None, delay_s, now_us)

    assert asked_us == math.ceil(Decimal(tenths_of_us) / 10)
    asked_us = max(0, asked_us)  # zero or less means now
    assert now_us + asked_us <= due_us <= now_us + asked_us + 1


@pytest.mark.parametrize(
    ("delay", "expected_us"),
    [
        pytest.param(timedelta(0), 0, id="zero"),
        pytest.param(timedelta(microseconds=1), 1, id="1us"),
        pytest.param(timedelta(microseconds=400), 400, id="0.4ms"),
        pytest.param(timedelta(milliseconds=1, microseconds=500), 1_500, id="1.5ms"),
        pytest.param(timedelta(microseconds=999_999), 999_999, id="999.999ms"),
        pytest.param(timedelta(seconds=-5), 0, id="minus-5s-means-now"),
        pytest.param(timedelta(days=180), 180 * 86_400 * SECOND, id="180-days"),
        pytest.param(timedelta(days=3650, microseconds=7), 3650 * 86_400 * SECOND + 7,
                     id="10-years-and-7us"),
    ],
)  # fmt: skip
def test_F03_timedelta_delay_is_exact(delay: timedelta, expected_us: int) -> None:
    assert due_time_us(None, delay, NOW_US) == NOW_US + expected_us


@given(delay=st.timedeltas(max_value=timedelta(days=1_000_000)), now_us=st.integers(0, NOW_US * 2))
def test_timedelta_delay_is_exact_for_any_timedelta(delay: timedelta, now_us: int) -> None:
    expected = (delay.days * 86_400 + delay.seconds) * SECOND + delay.microseconds

    assert due_time_us(None, delay, now_us) == now_us + max(0, expected)


# --- invalid arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("at", "delay"),
    [
        pytest.param(None, None, id="neither"),
        pytest.param(datetime(2030, 1, 1, tzinfo=UTC), 5.0, id="both-float"),
        pytest.param(datetime(2030, 1, 1, tzinfo=UTC), timedelta(seconds=5), id="both-timedelta"),
        pytest.param(datetime(2030, 1, 1, tzinfo=UTC), 0, id="both-zero-delay"),
    ],
)
def test_exactly_one_of_at_and_delay(at: datetime | None, delay: timedelta | float | None) -> None:
    with pytest.raises(InvalidScheduleError, match="exactly one of at="):
        due_time_us(at, delay, NOW_US)


@pytest.mark.parametrize(
    "delay",
    [
        pytest.param(math.nan, id="nan"),
        pytest.param(math.inf, id="inf"),
        pytest.param(-math.inf, id="minus-inf"),
        pytest.param(True, id="true"),
        pytest.param(False, id="false"),
        pytest.param("5", id="str"),
        pytest.param(Decimal("1.5"), id="decimal"),
    ],
)
def test_bad_delay_is_rejected(delay: object) -> None:
    with pytest.raises(InvalidScheduleError, match="delay=") as caught:
        due_time_us(None, delay, NOW_US)  # type: ignore[arg-type]

    assert "timedelta or finite seconds" in str(caught.value)


@pytest.mark.parametrize(
    "at",
    [
        pytest.param("2030-01-01T00:00:00Z", id="str"),
        pytest.param(1_893_456_000, id="epoch-int"),
        pytest.param(True, id="bool"),
    ],
)
def test_at_must_be_a_datetime(at: object) -> None:
    with pytest.raises(InvalidScheduleError, match="must be a datetime"):
        due_time_us(at, None, NOW_US)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "delay",
    [
        pytest.param(timedelta(days=3_000_000), id="3-million-days"),
        pytest.param(1e300, id="huge-float-seconds"),
    ],
)
def test_a_due_time_after_year_9999_is_refused(delay: timedelta | float) -> None:
    with pytest.raises(InvalidScheduleError, match="after year 9999"):
        due_time_us(None, delay, NOW_US)


def test_the_last_representable_instant_is_accepted() -> None:
    last = datetime.max.replace(tzinfo=UTC)

    assert due_time_us(last, None, NOW_US) == (last - datetime(1970, 1, 1, tzinfo=UTC)) // (
        timedelta(microseconds=1)
    )


@pytest.mark.parametrize("delay", [-5, -0.0004, timedelta(seconds=-5), timedelta(0)])
def test_a_delay_of_zero_or_less_means_now(delay: timedelta | float) -> None:
    assert due_time_us(None, delay, NOW_US) == NOW_US


def test_an_at_in_the_past_keeps_its_instant() -> None:
    past = datetime(2020, 1, 1, tzinfo=UTC)

    assert due_time_us(past, None, NOW_US) == datetime_to_us(past)


@given(
    delay=st.floats(min_value=0, max_value=2**31, allow_nan=False)
    | st.decimals(min_value=0, max_value=10**6, places=6).map(float)
)
def test_a_float_delay_is_its_shortest_decimal_in_microseconds_rounded_up(delay: float) -> None:
    """The fast path for whole-µs floats gives what the exact Decimal path gives."""
    assert due_time_us(None, delay, 0) == math.ceil(Decimal(repr(delay)) * 1_000_000)


@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_any_microsecond_count_reads_as_a_datetime_within_its_bounds(value_us: int) -> None:
    """A header or journal record can say anything: shown at the bound, never raised."""
    earliest = datetime_to_us(datetime.min.replace(tzinfo=UTC))
    shown = datetime_to_us(us_to_datetime(value_us))
    assert shown == min(max(value_us, earliest), MAX_DUE_US)
