"""The error contract of ``schedule()``'s checks (pure, no broker): whatever a caller
puts in a message's properties and headers, ``check_request`` and ``encode_properties``
either accept it (and it encodes to what was asked) or raise ``InvalidScheduleError``;
never ``struct.error``, ``TypeError``, ``OverflowError`` or ``UnicodeEncodeError``."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import aio_pika
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp.commands import Basic

import hopsched
from hopsched import amqp
from hopsched.client.prepare import (
    MAX_BODY_BYTES,
    SHORT_STRINGS,
    ScheduleRequest,
    check_request,
    encode_properties,
    reroute,
)

NOW_US = 1_800_000_000_000_000
SETTINGS = hopsched.Settings(prefix="p")
TOPOLOGY = hopsched.Topology.from_settings(SETTINGS)


class RawMessage(aio_pika.Message):
    """An aio-pika message whose pamqp properties are exactly what the test set (aio-pika
    converts some values on the way; a caller's own AbstractMessage may not)."""

    def __init__(self, properties: Basic.Properties) -> None:
        super().__init__(b"body")
        self._raw = properties

    @property
    def properties(self) -> Basic.Properties:  # type: ignore[override]
        return self._raw


def raw(**values: Any) -> RawMessage:
    properties = Basic.Properties()
    for name, value in values.items():
        setattr(properties, name, value)  # after __init__: pamqp's own checks skipped
    return RawMessage(properties)


def check(request: ScheduleRequest) -> Any:
    return check_request(
        request,
        now_us=NOW_US,
        ladder=SETTINGS.ladder,
        topology=TOPOLOGY,
        targets=SETTINGS.target_policy,
        login=SETTINGS.login,
        frame_max=131_072,
    )


def prepare(message: aio_pika.abc.AbstractMessage | bytes) -> bytes:
    return encode_properties(check(ScheduleRequest(message, "q", delay=1)), "host/1")


AWARE_1970 = datetime(1970, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        pytest.param({"priority": 300}, "priority=300: must be 0 to 255", id="priority-300"),
        pytest.param({"priority": 256}, "priority=256", id="priority-256"),
        pytest.param({"priority": -1}, "priority=-1", id="priority-negative"),
        pytest.param({"priority": 1.5}, "priority=1.5", id="priority-float"),
        pytest.param({"priority": "5"}, "priority='5'", id="priority-str"),
        pytest.param({"priority": True}, "priority=True", id="priority-bool"),
        pytest.param({"delivery_mode": 0}, "delivery_mode=0: must be 1", id="mode-0"),
        pytest.param({"delivery_mode": 3}, "delivery_mode=3", id="mode-3"),
        pytest.param({"delivery_mode": 256}, "delivery_mode=256", id="mode-256"),
        pytest.param({"timestamp": -1}, "timestamp=-1", id="timestamp-negative"),
        pytest.param({"timestamp": 2**32}, "timestamp=4294967296", id="timestamp-2106"),
        pytest.param({"timestamp": 2**64}, "timestamp=", id="timestamp-2**64"),
        pytest.param({"timestamp": 1.5}, "timestamp=1.5", id="timestamp-float"),
        pytest.param(
            {"timestamp": datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)},
            "timestamp=",
            id="timestamp-1969",
        ),
        pytest.param({"timestamp": datetime(2030, 1, 1)}, "naive datetime", id="timestamp-naive"),
        pytest.param({"content_type": 5}, "content_type=5: must be a str", id="str-int"),
        pytest.param({"reply_to": b"q"}, "reply_to=b'q'", id="str-bytes"),
        pytest.param({"app_id": "é" * 128}, "app_id", id="str-256-bytes"),
        pytest.param({"message_id": "a\ud800"}, "lone surrogate", id="str-surrogate"),
        pytest.param({"message_type": "x" * 256}, "type", id="type-long"),
        pytest.param({"user_id": 5}, "user_id=5", id="user-id-int"),
    ],
)
def test_a_property_out_of_range_is_refused_naming_it(values: dict[str, Any], says: str) -> None:
    """Found by a new-user trial: ``priority=300`` raised a raw ``struct.error``."""
    with pytest.raises(hopsched.InvalidScheduleError, match=None) as refused:
        prepare(raw(**values))

    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("expiration", "says"),
    [
        pytest.param("-1", "is negative", id="negative"),
        pytest.param("315360000001", "over 10 years", id="over-10-years"),
        pytest.param("1.5", "plain digits", id="fraction"),
        pytest.param("", "is empty", id="empty"),
        pytest.param("+5", "has a sign", id="signed"),
        pytest.param(5.0, "has type float", id="float"),
        pytest.param(-1, "negative", id="int-negative"),
    ],
)
def test_an_expiration_property_out_of_range_is_refused(expiration: Any, says: str) -> None:
    with pytest.raises(hopsched.InvalidScheduleError, match="expiration") as refused:
        prepare(raw(expiration=expiration))

    assert says in str(refused.value)


@pytest.mark.parametrize(
    "expiration",
    [-1, 10**30, math.inf, -math.inf, math.nan, timedelta(seconds=-1), "100"],
    ids=["negative", "huge", "inf", "-inf", "nan", "timedelta-negative", "str"],
)
def test_an_aio_pika_expiration_out_of_range_is_refused_naming_it(expiration: Any) -> None:
    """aio-pika converts seconds to RabbitMQ's ms string on the way (and fails on inf)."""
    message = aio_pika.Message(b"x", expiration=expiration)

    with pytest.raises(hopsched.InvalidScheduleError, match="expiration"):
        prepare(message)


@pytest.mark.parametrize("name", SHORT_STRINGS)
def test_every_short_string_property_over_255_bytes_is_refused(name: str) -> None:
    if name != "user_id":  # (which must be the login user's name)
        prepare(raw(**{name: "é" * 127}))  # 254 bytes
    with pytest.raises(hopsched.InvalidScheduleError, match="at most 255 bytes"):
        prepare(raw(**{name: "é" * 127 + "ab"}))  # 256 bytes


def test_what_is_not_a_schedule_request_or_routes_nowhere_is_refused() -> None:
    for request in (b"x", None, ("m", "q")):
        with pytest.raises(hopsched.InvalidScheduleError, match="must be a ScheduleRequest"):
            check(request)  # type: ignore[arg-type]
    with pytest.raises(hopsched.InvalidScheduleError, match="no queue is named ''"):
        check(ScheduleRequest(b"x", "", delay=1))


@pytest.mark.parametrize(
    "at",
    [
        datetime(2000, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(1960, 1, 1, tzinfo=UTC),  # before 1970: due at the epoch
    ],
)
def test_F43_a_due_time_before_2001_is_refused_as_the_relay_would_park_it(at: datetime) -> None:
    with pytest.raises(hopsched.InvalidScheduleError) as refused:
        check(ScheduleRequest(b"x", "q", at=at))

    assert str(refused.value) == (
        f"at={at.isoformat()} is before 2001-01-01: a relay parks so early a due time as a "
        "unit mistake (implausible_due); for at once, pass delay=0 (CLI: --in 0)"
    )


def test_F43_a_due_time_in_the_past_from_2001_on_is_taken() -> None:
    for at in (datetime(2001, 1, 1, tzinfo=UTC), datetime(2024, 1, 1, tzinfo=UTC)):
        assert check(ScheduleRequest(b"x", "q", at=at)).envelope.due_us < NOW_US
    assert check(ScheduleRequest(b"x", "q", delay=-5)).envelope.due_us == NOW_US


async def test_the_schedulers_many_calls_refuse_what_is_not_a_list_before_connecting() -> None:
    """Found by a new-user trial: ``schedule_many([b"x"])`` raised AttributeError, and
    ``cancel_many("order-42")`` cancelled the ids 'o', 'r', 'd', ... (a str iterates)."""
    scheduler = hopsched.Scheduler(hopsched.Settings(url="amqp://guest:guest@127.0.0.1:1/"))

    for requests in (None, 5, ScheduleRequest(b"x", "q", delay=1)):
        with pytest.raises(hopsched.InvalidScheduleError, match="iterable of ScheduleRequest"):
            await scheduler.schedule_many(requests)  # type: ignore[arg-type]
    with pytest.raises(hopsched.InvalidScheduleError, match=r"request 0: .*ScheduleRequest"):
        await scheduler.schedule_many([b"x"])  # type: ignore[list-item]
    for schedules in ("order-42", b"order-42", None):
        with pytest.raises(hopsched.InvalidScheduleError, match="list of schedule ids"):
            await scheduler.cancel_many(schedules)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["declare", "check_target", "replace"])
@pytest.mark.parametrize("value", ["yes", "no", 0, 1, None])
async def test_a_flag_that_is_not_a_bool_is_refused_before_connecting(
    flag: str, value: object
) -> None:
    """Found by a new-user trial: ``check_target="yes"`` was taken as true (and "no" as
    true too): a flag is True or False, or the call is refused naming it."""
    scheduler = hopsched.Scheduler(hopsched.Settings(url="amqp://guest:guest@127.0.0.1:1/"))
    flags: dict[str, Any] = {flag: value}
    with pytest.raises(hopsched.InvalidScheduleError, match=rf"{flag}=.*: must be True or False"):
        await scheduler.schedule(b"x", delay=1, routing_key="q", schedule_id="i", **flags)
    if flag != "replace":
        with pytest.raises(hopsched.InvalidScheduleError, match=rf"^{flag}=.*True or False"):
            await scheduler.schedule_many([ScheduleRequest(b"x", "q", delay=1)], **flags)


async def test_an_id_of_none_is_refused_by_what_takes_an_existing_schedule() -> None:
    """Found by a new-user trial: ``cancel(None)`` cancelled a fresh random id and
    returned a ``Cancelled``; ``get(None)`` and ``reschedule(None, ...)`` said "unknown"."""
    scheduler = hopsched.Scheduler(hopsched.Settings(url="amqp://guest:guest@127.0.0.1:1/"))
    calls = [
        scheduler.cancel(None),  # type: ignore[arg-type]
        scheduler.cancel_many([None]),  # type: ignore[list-item]
        scheduler.get(None),  # type: ignore[arg-type]
        scheduler.reschedule(None, delay=5),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(hopsched.InvalidScheduleError, match="schedule_id=None: give the id"):
            await call


def test_the_aio_pika_message_of_the_trial_is_refused() -> None:
    for priority in (300, -1):
        with pytest.raises(hopsched.InvalidScheduleError, match=f"priority={priority}"):
            prepare(aio_pika.Message(b"x", priority=priority))


@pytest.mark.parametrize(
    "values",
    [
        {"priority": 0},
        {"priority": 255},
        {"delivery_mode": 1},
        {"delivery_mode": 2},
        {"timestamp": 0},
        {"timestamp": 2**32 - 1},
        {"timestamp": AWARE_1970},
        {"timestamp": datetime(2106, 2, 7, 6, 28, 15, tzinfo=UTC)},
        {"timestamp": datetime(2030, 1, 1, 9, tzinfo=timezone(timedelta(hours=-5)))},
        {"content_type": "a" * 255},
        {"app_id": "é" * 127},
    ],
)
def test_a_property_at_its_bound_is_carried_exactly(values: dict[str, Any]) -> None:
    decoded = amqp.Properties.decode(prepare(raw(**values)))

    for name, value in values.items():
        if name == "delivery_mode":  # hops are persistent; the caller's is in the envelope
            assert decoded.headers is not None
            carried = dict(decoded.headers).get("x-hopsched-delivery-mode")
            assert carried == (None if value == 2 else value)  # absent: persistent
            continue
        if isinstance(value, datetime):
            value = int(value.timestamp())
        assert getattr(decoded, name) == value


def test_a_body_no_broker_takes_is_refused_before_anything_is_sent() -> None:
    class Huge(bytes):
        def __len__(self) -> int:
            return MAX_BODY_BYTES + 1

    with pytest.raises(hopsched.InvalidScheduleError, match="512 MiB"):
        prepare(Huge(b"x"))


# --- the property: nothing but InvalidScheduleError --------------------------------------

INTS = st.sampled_from(
    [-(2**63) - 1, -(2**63), -1, 0, 1, 2, 3, 255, 256, 2**31, 2**32 - 1, 2**32, 2**63, 2**64]
)
FLOATS = st.sampled_from(
    [0.0, 1.5, -1.5, 3.4028234663852886e38, 3.5e38, 1e-46, math.nan, math.inf, -math.inf]
)
TEXT = st.sampled_from(["", "a", "a" * 128, "a" * 129, "a" * 255, "a" * 256, "é" * 128])
TEXT = TEXT | st.text(max_size=20)  # lone surrogates included
DATETIMES = st.sampled_from(
    [
        datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC),
        AWARE_1970,
        datetime(2106, 2, 7, 6, 28, 15, tzinfo=UTC),
        datetime(2106, 2, 7, 6, 28, 16, tzinfo=UTC),
        datetime(9999, 12, 31, tzinfo=UTC),
        datetime(2030, 1, 1),
        datetime(1, 1, 1, tzinfo=UTC),
    ]
)
DECIMALS = st.sampled_from(
    [
        Decimal("2147483647"),
        Decimal("2147483648"),
        Decimal("-2147483648"),
        Decimal("-2147483649"),
        Decimal("1e-255"),
        Decimal("1e-256"),
        Decimal("NaN"),
        Decimal("Infinity"),
        Decimal("0.1"),
    ]
)
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    FLOATS,
    TEXT,
    DATETIMES,
    DECIMALS,
    st.binary(max_size=8),
    st.sampled_from([(1, 2), {1, 2}, frozenset(), object(), timedelta(seconds=5), b"\x00\xff"]),
)
HEADER_VALUES = st.recursive(
    ANY_VALUE,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
HEADER_KEYS = TEXT | st.sampled_from([1, None, b"k", ("a",)])
PROPERTY_NAMES = [*SHORT_STRINGS, "priority", "delivery_mode", "timestamp", "expiration"]


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    properties=st.dictionaries(st.sampled_from(PROPERTY_NAMES), ANY_VALUE, max_size=4),
    headers=st.none() | st.dictionaries(HEADER_KEYS, HEADER_VALUES, max_size=4),
)
def test_any_property_or_header_gives_a_message_or_an_invalid_schedule_error(
    properties: dict[str, Any], headers: dict[Any, Any] | None
) -> None:
    message = raw(**properties, headers=headers)
    try:
        encoded = prepare(message)
    except hopsched.InvalidScheduleError:
        return
    decoded = amqp.Properties.decode(encoded)  # what it accepted, it encoded
    if properties.get("priority") is not None:
        assert decoded.priority == properties["priority"]


# --- routing a nacked first hop around its step -----------------------------------------


def checked_for(delay_s: float, avoid: frozenset[int] = frozenset()) -> Any:
    return check_request(
        ScheduleRequest(b"body", "q", delay=delay_s),
        now_us=NOW_US,
        ladder=SETTINGS.ladder,
        topology=TOPOLOGY,
        targets=SETTINGS.target_policy,
        login=SETTINGS.login,
        frame_max=131_072,
        avoid=avoid,
    )


def test_a_first_hop_rerouted_around_its_step_goes_by_the_next_smaller_one() -> None:
    checked = checked_for(600)
    later_us = NOW_US + 300_000  # the nack came 0.3 s later

    rerouted = reroute(
        checked, now_us=later_us, ladder=SETTINGS.ladder, topology=TOPOLOGY, avoid={524_288}
    )

    assert (checked.queue, checked.step_ms) == ("p.step.524288", 524_288)
    assert (rerouted.queue, rerouted.routing_key, rerouted.step_ms) == (
        "p.step.262144",
        "p.step.262144",
        262_144,
    )
    assert rerouted.hop_expires_us == later_us + 262_144_000  # its own step's stamp
    assert rerouted.envelope == checked.envelope  # the same due time, id and target
    assert checked_for(600, frozenset({524_288})).queue == "p.step.262144"


def test_a_reroute_with_nothing_smaller_to_go_by_keeps_the_call_as_it_was() -> None:
    checked = checked_for(10)  # by step 4096 first
    steps = frozenset(step for step in SETTINGS.ladder.steps if step <= checked.step_ms)

    assert (
        reroute(checked, now_us=NOW_US, ladder=SETTINGS.ladder, topology=TOPOLOGY, avoid=steps)
        is checked
    )
