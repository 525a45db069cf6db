"""The envelope codec and the header rewrites of each relay step (pure, no broker).

The wire tests encode headers with pamqp, the codec aio-pika and aiormq use, and decode
them again, as a hop through the broker and the relay does.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import decode, encode

from hopsched.amqp.wire import Table
from hopsched.core.clock import MAX_DUE_US
from hopsched.core.envelope import (
    BROKER_DEAD_LETTER_HEADERS,
    BROKER_DELIVERY_COUNT_HEADER,
    ENVELOPE_VERSION,
    HEADER_DELIVERY_MODE,
    HEADER_DUE,
    HEADER_EXCHANGE,
    HEADER_EXPIRATION,
    HEADER_FEATURES,
    HEADER_HOP_CLOCK,
    HEADER_HOP_EXPIRES,
    HEADER_HOPS,
    HEADER_ID,
    HEADER_OWNER,
    HEADER_PARKED_AT,
    HEADER_PARKED_KIND,
    HEADER_PARKED_REASON,
    HEADER_PARKED_USER_ID,
    HEADER_ROUTING_KEY,
    HEADER_VERSION,
    NO_DEATH,
    RELAY_CLOCK,
    Envelope,
    delivery_headers,
    hop_headers,
    latest_death,
    parked_headers,
    unparked_headers,
)
from hopsched.errors import EnvelopeError, HopschedError

DUE_US = 1_700_000_000_123_456


def wire(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` after one trip over AMQP: encoded and decoded as a field table."""
    encoded = encode.field_table(dict(headers))
    consumed, table = decode.field_table(encoded)
    assert consumed == len(encoded)
    return table


def valid_headers(**changes: Any) -> dict[str, Any]:
    headers = Envelope("id-1", DUE_US, "orders", "order.created", hops=3).to_headers()
    headers.update(changes)
    return headers


def utf8_at_most(limit: int) -> st.SearchStrategy[str]:
    return st.text(max_size=limit).filter(lambda text: len(text.encode()) <= limit)


envelopes = st.builds(
    Envelope,
    schedule_id=st.text(),
    due_us=st.integers(0, MAX_DUE_US),
    exchange=utf8_at_most(255),
    routing_key=utf8_at_most(255),
    hops=st.integers(0, 2**31),
    expiration=st.none() | st.integers(0, 2**32).map(str),
    delivery_mode=st.none() | st.sampled_from([0, 1]),
    rule=st.none() | st.just('{"v":1,"e":60000000,"s":0}'),
    user=st.none() | st.text(),
    # names a newer scheduler may write; "recurring" is implied by a rule, never stored
    features=st.frozensets(
        st.from_regex(r"[a-z][a-z0-9_-]{0,15}", fullmatch=True).filter(lambda n: n != "recurring")
    ),
)


# --- Envelope round trip ----------------------------------------------------------------


@given(envelope=envelopes)
def test_envelope_survives_to_headers_and_back(envelope: Envelope) -> None:
    assert Envelope.from_headers(envelope.to_headers()) == envelope


@given(envelope=envelopes)
def test_envelope_survives_the_wire_twice(envelope: Envelope) -> None:
    once = wire(envelope.to_headers())
    twice = wire(once)

    assert Envelope.from_headers(once) == envelope
    assert Envelope.from_headers(twice) == envelope
    assert type(twice[HEADER_DUE]) is int
    assert twice[HEADER_DUE] == envelope.due_us


def test_to_headers_writes_the_version_and_leaves_optional_fields_out() -> None:
    headers = Envelope("id-1", DUE_US, "", "queue-a").to_headers()

    assert headers == {
        HEADER_VERSION: ENVELOPE_VERSION,
        HEADER_ID: "id-1",
        HEADER_DUE: DUE_US,
        HEADER_EXCHANGE: "",
        HEADER_ROUTING_KEY: "queue-a",
        HEADER_HOPS: 0,
    }


def test_to_headers_keeps_the_callers_expiration_and_delivery_mode() -> None:
    headers = Envelope("id-1", DUE_US, "", "q", expiration="60000", delivery_mode=1).to_headers()

    assert headers[HEADER_EXPIRATION] == "60000"
    assert headers[HEADER_DELIVERY_MODE] == 1


def test_features_name_recurring_for_a_rule_and_nothing_for_a_one_shot() -> None:
    one_shot = Envelope("id-1", DUE_US, "orders", "order.created")
    recurring = Envelope("id-1", DUE_US, "orders", "order.created", rule="{}", occurrence=1)

    assert HEADER_FEATURES not in one_shot.to_headers()
    assert recurring.to_headers()[HEADER_FEATURES] == "recurring"
    newer = Envelope.from_headers(valid_headers(**{HEADER_FEATURES: "teleport, recurring,,"}))
    assert newer.required_features == {"teleport", "recurring"}
    assert newer.to_headers()[HEADER_FEATURES] == "recurring,teleport"
    with pytest.raises(EnvelopeError, match="'x-hopsched-features' must be str, got bytes"):
        Envelope.from_headers(valid_headers(**{HEADER_FEATURES: b"recurring"}))


def test_from_headers_ignores_unrelated_headers() -> None:
    envelope = Envelope.from_headers(valid_headers(**{"x-app": "billing", "x-death": []}))

    assert envelope == Envelope("id-1", DUE_US, "orders", "order.created", hops=3)


# --- from_headers errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "missing",
    [HEADER_VERSION, HEADER_ID, HEADER_DUE, HEADER_EXCHANGE, HEADER_ROUTING_KEY, HEADER_HOPS],
)
def test_missing_header_is_an_envelope_error_naming_it(missing: str) -> None:
    headers = valid_headers()
    del headers[missing]

    with pytest.raises(EnvelopeError, match="missing") as caught:
        Envelope.from_headers(headers)

    assert missing in caught.value.reason
    assert caught.value.headers == headers


@pytest.mark.parametrize("headers", [None, {}])
def test_no_headers_at_all_is_an_envelope_error(headers: dict[str, Any] | None) -> None:
    with pytest.raises(EnvelopeError, match="missing"):
        Envelope.from_headers(headers)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param(HEADER_DUE, float(DUE_US), id="float-due"),
        pytest.param(HEADER_DUE, str(DUE_US), id="str-due"),
        pytest.param(HEADER_DUE, True, id="bool-due"),
        pytest.param(HEADER_DUE, Decimal(DUE_US), id="decimal-due"),
        pytest.param(HEADER_DUE, datetime(2030, 1, 1, tzinfo=UTC), id="timestamp-due"),
        pytest.param(HEADER_VERSION, "1", id="str-version"),
        pytest.param(HEADER_VERSION, True, id="bool-version"),
        pytest.param(HEADER_ID, 42, id="int-id"),
        pytest.param(HEADER_ID, b"id-1", id="bytes-id"),
        pytest.param(HEADER_EXCHANGE, bytearray(b"orders"), id="bytearray-exchange"),
        pytest.param(HEADER_ROUTING_KEY, 7, id="int-routing-key"),
        pytest.param(HEADER_HOPS, 3.0, id="float-hops"),
        pytest.param(HEADER_HOPS, False, id="bool-hops"),
        pytest.param(HEADER_EXPIRATION, 60000, id="int-expiration"),
        pytest.param(HEADER_DELIVERY_MODE, "1", id="str-delivery-mode"),
        pytest.param(HEADER_DELIVERY_MODE, True, id="bool-delivery-mode"),
    ],
)
def test_wrong_type_is_an_envelope_error_naming_the_header(name: str, value: Any) -> None:
    headers = valid_headers(**{name: value})

    with pytest.raises(EnvelopeError) as caught:
        Envelope.from_headers(headers)

    assert name in caught.value.reason
    assert "must be" in caught.value.reason
    assert caught.value.headers == headers
    assert isinstance(caught.value, HopschedError)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("version", [0, 2, -1, 2**40])
def test_unknown_version_is_an_envelope_error_saying_what_to_run(version: int) -> None:
    with pytest.raises(EnvelopeError) as caught:
        Envelope.from_headers(valid_headers(**{HEADER_VERSION: version}))

    assert f"is {version}" in caught.value.reason
    assert f"version {ENVELOPE_VERSION}" in caught.value.reason


@pytest.mark.parametrize(
    ("name", "value"), [(HEADER_DUE, -1), (HEADER_DUE, -(2**62)), (HEADER_HOPS, -1)]
)
def test_negative_due_or_hops_is_an_envelope_error(name: str, value: int) -> None:
    with pytest.raises(EnvelopeError, match=">= 0"):
        Envelope.from_headers(valid_headers(**{name: value}))


@pytest.mark.parametrize("value", [MAX_DUE_US + 1, 2**62])
def test_a_due_time_after_year_9999_is_an_envelope_error(value: int) -> None:
    """Found by a new-user trial: an injected due of 2**62 µs hopped on the top step
    for ever; it is malformed (schedule() never writes one) and gets parked."""
    with pytest.raises(EnvelopeError, match="after year 9999"):
        Envelope.from_headers(valid_headers(**{HEADER_DUE: value}))
    assert Envelope.from_headers(valid_headers(**{HEADER_DUE: MAX_DUE_US})).due_us == MAX_DUE_US


def test_due_zero_is_accepted() -> None:
    assert Envelope.from_headers(valid_headers(**{HEADER_DUE: 0})).due_us == 0


@pytest.mark.parametrize("name", [HEADER_EXCHANGE, HEADER_ROUTING_KEY])
def test_target_names_over_255_bytes_are_an_envelope_error(name: str) -> None:
    fits = valid_headers(**{name: "é" * 127 + "x"})  # 255 bytes
    too_long = valid_headers(**{name: "é" * 128})  # 256 bytes

    assert Envelope.from_headers(fits)
    with pytest.raises(EnvelopeError, match="255 bytes"):
        Envelope.from_headers(too_long)


# --- header rewrites ----------------------------------------------------------------------

DEAD_LETTERED = {
    **valid_headers(),
    HEADER_HOP_EXPIRES: DUE_US - 20_000,
    HEADER_EXPIRATION: "5000",
    HEADER_DELIVERY_MODE: 1,
    HEADER_FEATURES: "recurring",
    HEADER_OWNER: "alice",  # whose schedule: never delivered
    "x-death": [{"count": 1, "queue": "hopsched.step.16", "reason": "expired"}],
    "x-first-death-exchange": "",
    "x-first-death-queue": "hopsched.step.16",
    "x-first-death-reason": "expired",
    "x-last-death-exchange": "",
    "x-last-death-queue": "hopsched.step.16",
    "x-last-death-reason": "expired",
    "x-app-trace": "abc",
    "x-app-count": 128,
}
CALLERS = {"x-app-trace": "abc", "x-app-count": 128}


def test_dead_letter_header_set_is_what_rabbitmq_adds() -> None:
    assert {
        name
        for name in DEAD_LETTERED
        if name.startswith(("x-death", "x-first-death-", "x-last-death-"))
    } == BROKER_DEAD_LETTER_HEADERS


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"x-death": [{"reason": "delivery_limit"}, {"reason": "expired"}]}, "delivery_limit"),
        ({"x-death": [{"reason": "expired", "queue": "p.step.16"}]}, "expired"),
        ({"x-death": []}, None),
        ({"x-death": "expired"}, None),
        ({"x-death": [{"reason": 7}]}, None),
        ({}, None),
    ],
)
def test_the_dead_letter_reason_is_the_latest_x_death_entrys(
    headers: dict[str, Any], reason: str | None
) -> None:
    """Only an ``expired`` hop times a step (the relay's hop overshoot, a producer's clock
    offset): the latest entry comes first (https://www.rabbitmq.com/docs/dlx#effects)."""
    assert latest_death(headers).reason == reason


def test_hop_headers_strip_dead_letter_history_and_count_the_hop() -> None:
    headers = hop_headers(DEAD_LETTERED, 4)

    assert not BROKER_DEAD_LETTER_HEADERS & headers.keys()
    assert headers[HEADER_HOPS] == 4
    dropped = BROKER_DEAD_LETTER_HEADERS | {HEADER_HOP_EXPIRES}  # the last hop's expiry
    assert headers == {
        **{k: v for k, v in DEAD_LETTERED.items() if k not in dropped},
        HEADER_HOPS: 4,
    }
    assert Envelope.from_headers(headers).hops == 4


def test_hop_headers_do_not_change_their_input() -> None:
    before = dict(DEAD_LETTERED)

    hop_headers(DEAD_LETTERED, 9)

    assert before == DEAD_LETTERED


def test_hop_headers_of_none_only_count_the_hop() -> None:
    assert hop_headers(None, 1) == {HEADER_HOPS: 1}


def test_delivery_headers_keep_callers_headers_and_id_due_hops_only() -> None:
    headers = delivery_headers(DEAD_LETTERED)

    assert headers == {
        **CALLERS,
        HEADER_ID: "id-1",
        HEADER_DUE: DUE_US,
        HEADER_HOPS: 3,
    }


def test_hop_headers_set_when_the_next_hop_expires_by_the_relays_clock() -> None:
    headers = hop_headers(DEAD_LETTERED, 4, expires_us=DUE_US - 500_000)

    assert headers[HEADER_HOP_EXPIRES] == DUE_US - 500_000
    assert headers[HEADER_HOP_CLOCK] == RELAY_CLOCK
    assert hop_headers({}, 1) == {HEADER_HOPS: 1}


def test_delivery_headers_of_none_are_empty() -> None:
    assert delivery_headers(None) == {}


def test_parked_headers_keep_the_target_and_add_reason_and_time() -> None:
    headers = parked_headers(
        DEAD_LETTERED, "undeliverable: NO_ROUTE", "unroutable", 1_800_000_000_000_000
    )

    assert headers[HEADER_PARKED_REASON] == "undeliverable: NO_ROUTE"
    assert headers[HEADER_PARKED_KIND] == "unroutable"
    assert headers[HEADER_PARKED_AT] == 1_800_000_000_000_000
    assert not BROKER_DEAD_LETTER_HEADERS & headers.keys()
    kept = {k: v for k, v in DEAD_LETTERED.items() if k not in BROKER_DEAD_LETTER_HEADERS}
    assert {k: headers[k] for k in kept} == kept
    assert Envelope.from_headers(headers).routing_key == "order.created"


def test_the_relay_queues_delivery_count_goes_no_further() -> None:
    redelivered = {**DEAD_LETTERED, BROKER_DELIVERY_COUNT_HEADER: 1}

    assert hop_headers(redelivered, 4) == hop_headers(DEAD_LETTERED, 4)
    assert delivery_headers(redelivered) == delivery_headers(DEAD_LETTERED)
    assert parked_headers(redelivered, "r", "k", 5) == parked_headers(DEAD_LETTERED, "r", "k", 5)


def test_parked_headers_of_none_hold_only_reason_kind_and_time() -> None:
    assert parked_headers(None, "malformed envelope", "malformed", 5) == {
        HEADER_PARKED_REASON: "malformed envelope",
        HEADER_PARKED_KIND: "malformed",
        HEADER_PARKED_AT: 5,
    }


def test_rewritten_headers_survive_the_wire() -> None:
    for headers in (
        hop_headers(DEAD_LETTERED, 4),
        delivery_headers(DEAD_LETTERED),
        parked_headers(DEAD_LETTERED, "why", "refused", DUE_US),
    ):
        assert wire(headers) == headers


# --- caller's header values on the wire ---------------------------------------------------
# The relay decodes a delivery and re-encodes it on every hop: whatever one trip does to
# a value, a second trip must leave it as it is (decode(encode(.)) is idempotent).

INTEGER_EDGES = [
    0, 1, -1, 127, 128, -128, -129, 255, 256, 32767, 32768, -32768, -32769, 65535, 65536,
    2**31 - 1, 2**31, -(2**31), 2**32 - 1, 2**32, 2**62, 2**63 - 1, -(2**63),
]  # fmt: skip

decimals = st.builds(
    lambda mantissa, scale: Decimal(mantissa).scaleb(-scale),
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 255),
)
timestamps = st.datetimes(
    min_value=datetime(1970, 1, 2),
    max_value=datetime(2106, 2, 6),
    timezones=st.just(UTC),
)
scalars = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.sampled_from(INTEGER_EDGES)
    | st.text()
    | st.floats(width=32, allow_nan=False)
    | decimals
    | timestamps
    | st.binary().map(bytearray)
    | st.none()
)
header_keys = st.text(max_size=20)
header_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(header_keys, children, max_size=4)
    ),
    max_leaves=12,
)


@given(value=header_values)
def test_any_header_value_is_stable_after_one_trip(value: Any) -> None:
    once = wire({"x-value": value})
    twice = wire(once)

    assert twice == once
    assert encode.field_table(twice) == encode.field_table(once)


@given(envelope=envelopes, callers=st.dictionaries(header_keys, header_values, max_size=6))
def test_due_time_survives_the_wire_among_any_callers_headers(
    envelope: Envelope, callers: dict[str, Any]
) -> None:
    headers = {**callers, **envelope.to_headers()}

    once = wire(headers)
    after_hop = wire(hop_headers(once, envelope.hops + 1))

    assert Envelope.from_headers(after_hop).due_us == envelope.due_us
    assert Envelope.from_headers(after_hop).hops == envelope.hops + 1


@pytest.mark.parametrize("value", INTEGER_EDGES)
def test_integers_survive_the_wire_exactly(value: int) -> None:
    decoded = wire({"x-int": value})["x-int"]

    assert decoded == value
    assert type(decoded) is int


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        "",
        "plain",
        "ünïcødé ✓ 日本語 🐇",
        Decimal("1.50"),
        Decimal("-12.345"),
        datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
        bytearray(b"\x00\xff raw"),
        None,
        {"nested": {"deeper": [1, "two", None]}},
        [1, "two", [3.5], {"four": False}],
        [],
        {},
    ],
    ids=repr,
)
def test_exact_values_survive_the_wire(value: Any) -> None:
    decoded = wire({"x-value": value})["x-value"]

    assert decoded == value
    assert type(decoded) is type(value)


def test_datetime_keeps_whole_seconds_in_utc() -> None:
    decoded = wire({"x-at": datetime(2030, 1, 2, 3, 4, 5, 678_901, tzinfo=UTC)})["x-at"]

    assert decoded == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert decoded.utcoffset() is not None
    assert decoded.utcoffset().total_seconds() == 0


def test_a_float_due_time_would_not_survive_the_wire() -> None:
    # Why the due time is an int: pamqp sends a Python float as a 32-bit float.
    # Near 2**30.7 s a 32-bit float's steps are 128 s apart.
    as_seconds = 1_700_000_060.0

    decoded = wire({"due": as_seconds})["due"]

    assert abs(decoded - as_seconds) == 60.0


def test_unparked_headers_drop_the_parking_and_the_last_hops_expiry() -> None:
    parked = parked_headers(
        DEAD_LETTERED, "undeliverable: NO_ROUTE", "unroutable", 1_800_000_000_000_000
    )
    parked = parked.update({HEADER_PARKED_USER_ID: "alice"})

    replayed = unparked_headers(parked)

    parking = {HEADER_PARKED_REASON, HEADER_PARKED_KIND, HEADER_PARKED_AT, HEADER_PARKED_USER_ID}
    assert not parking & replayed.keys()
    assert HEADER_HOP_EXPIRES not in replayed
    assert Envelope.from_headers(replayed) == Envelope.from_headers(DEAD_LETTERED)


_DEATH_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "time": st.datetimes(
            min_value=datetime(2001, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
        ).map(lambda d: d.replace(microsecond=0)),
        "reason": st.sampled_from(["expired", "maxlen", "rejected", "delivery_limit"]),
        "queue": st.text(max_size=20),
        "count": st.integers(min_value=0, max_value=2**31),
    },
)


@given(
    st.one_of(
        st.none(),
        st.lists(
            st.one_of(_DEATH_ENTRY, st.text(max_size=5), st.integers(-(2**31), 2**31 - 1)),
            max_size=3,
        ),
        st.text(max_size=5),
    )
)
def test_the_latest_death_read_from_the_wire_is_the_one_decoded_whole(deaths: Any) -> None:
    """``latest_death`` of a received ``Table`` decodes only the first ``x-death`` entry
    (a relay reads it for every hop); it says what the fully decoded headers say."""
    headers = {} if deaths is None else {"x-death": deaths, "x-other": 1}
    received = Table.decode(Table.from_dict(headers).encode())[0]
    decoded = decode.field_table(Table.from_dict(headers).encode())[1]
    assert latest_death(received) == latest_death(decoded)
    first = deaths[0] if isinstance(deaths, list) and deaths else None
    if isinstance(first, dict) and first:
        time = first.get("time")
        assert latest_death(received).time_us == (
            None if time is None else int(time.timestamp()) * 1_000_000
        )
        assert latest_death(received).reason == first.get("reason")
    else:
        assert latest_death(received) == NO_DEATH
