"""The checks of a caller's message before it is sent (hopsched.core.validate).

Pure tests (tables and hypothesis properties, with pamqp as the wire) come first; the
integration tests at the end show the broker's own verdict on each edge (F14 header
values, F17 frame size, F18 expiration), so every limit here is one RabbitMQ or pamqp
really has.
"""

from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from types import MappingProxyType
from typing import Any

import aio_pika
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import decode, encode, frame
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from hopsched.core.validate import (
    MAX_DEPTH,
    MAX_EXPIRATION_MS,
    MAX_KEY_BYTES,
    check_expiration,
    check_frame_size,
    check_headers,
    content_header_size,
)
from hopsched.errors import InvalidScheduleError

FLOAT32 = struct.Struct(">f")
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest float pamqp cannot pack as 32 bits: halfway from FLOAT32_MAX to 2**128
#: rounds to even, which is 2**128, which overflows.
FLOAT32_OVERFLOW = float(2**128 - 2**103)
TIMESTAMP_LAST = datetime(2106, 2, 7, 6, 28, 15, tzinfo=UTC)  # 2**32 - 1 s since the epoch


def wire(headers: dict[str, Any]) -> dict[str, Any]:
    """``headers`` after one trip over AMQP: encoded and decoded by pamqp."""
    data = encode.field_table(headers)
    consumed, table = decode.field_table(data)
    assert consumed == len(data)
    return table


def after_wire(value: Any) -> Any:
    """``value`` as a consumer receives it, by the rules ``check_headers`` documents."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, float):
        return FLOAT32.unpack(FLOAT32.pack(value))[0]
    if isinstance(value, datetime):
        return datetime.fromtimestamp(int(value.timestamp()), UTC)
    if isinstance(value, Mapping):
        return {key: after_wire(item) for key, item in value.items()}
    if isinstance(value, list):
        return [after_wire(item) for item in value]
    return value


def same(got: Any, expected: Any) -> bool:
    """Equal, of the same type at every depth, and -0.0 kept apart from 0.0."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in expected)
    if isinstance(expected, list):
        return len(got) == len(expected) and all(map(same, got, expected))
    if isinstance(expected, float):
        return got == expected and math.copysign(1, got) == math.copysign(1, expected)
    return bool(got == expected)


def nest(levels: int, inner: Any = 1) -> Any:
    """``inner`` inside ``levels`` arrays."""
    for _ in range(levels):
        inner = [inner]
    return inner


def refusal(headers: Any, **kwargs: Any) -> str:
    with pytest.raises(InvalidScheduleError) as caught:
        check_headers(headers, **kwargs)
    return str(caught.value)


# --- F14: refused header values and keys --------------------------------------------------

NAN, INF = float("nan"), float("inf")
UTC_MINUS_5 = timezone(timedelta(hours=-5))

REFUSED = [
    # (headers, the path the message starts with, words it must hold)
    ({"f": NAN}, "headers['f']", "541 INTERNAL_ERROR"),
    ({"f": INF}, "headers['f']", "541 INTERNAL_ERROR"),
    ({"f": -INF}, "headers['f']", "541 INTERNAL_ERROR"),
    ({"f": 1e300}, "headers['f']", "32-bit float"),
    ({"f": -FLOAT32_OVERFLOW}, "headers['f']", "32-bit float"),
    ({"k" * 129: 1}, "headers", "129 bytes"),
    ({"é" * 65: 1}, "headers", "130 bytes"),
    ({1: "one"}, "headers", "use str(key)"),
    ({("a",): "tuple key"}, "headers", "keys are strings"),
    ({"\ud800": 1}, "headers", "key '\\ud800' holds a lone surrogate"),
    ({"s": "ok\udfff"}, "headers['s']", "lone surrogate '\\udfff' at index 2"),
    ({"i": 2**63}, "headers['i']", "64-bit"),
    ({"i": -(2**63) - 1}, "headers['i']", "64-bit"),
    ({"d": Decimal("NaN")}, "headers['d']", "finite"),
    ({"d": Decimal("-Infinity")}, "headers['d']", "finite"),
    ({"d": Decimal("sNaN")}, "headers['d']", "finite"),
    ({"d": Decimal(2**31)}, "headers['d']", "2147483647"),
    ({"d": Decimal(-(2**31) - 1)}, "headers['d']", "2147483647"),
    ({"d": Decimal("1E+10")}, "headers['d']", "AMQP decimal"),
    ({"d": Decimal("1E+999999")}, "headers['d']", "AMQP decimal"),
    ({"d": Decimal("1E-256")}, "headers['d']", "255 decimal places"),
    ({"d": Decimal("0E-256")}, "headers['d']", "255 decimal places"),
    ({"d": Decimal("0.12345678901")}, "headers['d']", "AMQP decimal"),
    ({"t": datetime(2030, 1, 1)}, "headers['t']", "naive datetime"),
    ({"t": datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)}, "headers['t']", "1970-01-01"),
    ({"t": datetime(1969, 12, 31, 23, 59, 59, 500_000, tzinfo=UTC)}, "headers['t']", "1970"),
    ({"t": TIMESTAMP_LAST + timedelta(seconds=1)}, "headers['t']", "milliseconds"),
    ({"t": datetime(2106, 2, 7, 1, 28, 16, tzinfo=UTC_MINUS_5)}, "headers['t']", "2106"),
    ({"t": datetime(1, 1, 1, tzinfo=UTC)}, "headers['t']", "ISO 8601"),
    ({"t": time.gmtime(0)}, "headers['t']", "struct_time"),
    ({"t": date(2030, 1, 1)}, "headers['t']", "has type date"),
    ({"l": (1, 2)}, "headers['l']", "use a list"),
    ({"l": {1, 2}}, "headers['l']", "use a list"),
    ({"l": frozenset()}, "headers['l']", "use a list"),
    ({"x": object()}, "headers['x']", "AMQP cannot carry"),
    ({"x": memoryview(b"x")}, "headers['x']", "has type memoryview"),
    ({"x": 1j}, "headers['x']", "has type complex"),
    # nested at any depth
    ({"a": [0, 1, {"k": NAN}]}, "headers['a'][2]['k']", "NaN"),
    ({"a": {"b": [b"ok", 2**64]}}, "headers['a']['b'][1]", "64-bit"),
    ({"a": [{1: "x"}]}, "headers['a'][0]", "key 1 has type int"),
    ({"a": [[{"k" * 200: 1}]]}, "headers['a'][0][0]", "200 bytes"),
    ({"a": {"b": {"c": datetime(2030, 1, 1)}}}, "headers['a']['b']['c']", "naive"),
    ({"a": [1e300]}, "headers['a'][0]", "32-bit float"),
    (
        {"a": nest(MAX_DEPTH + 1)},
        "headers['a'][0][0][0][0][0]...91 more...[0][0][0][0]",
        f"more than {MAX_DEPTH}",
    ),
]


def _id(value: object) -> str:
    """A test id without object addresses (pytest-xdist's workers must collect the same)."""
    return re.sub(" at 0x[0-9a-f]+", "", repr(value))[:40]


@pytest.mark.parametrize(("headers", "path", "words"), REFUSED, ids=_id)
def test_F14_refused_value_names_its_path_and_why(headers: Any, path: str, words: str) -> None:
    message = refusal(headers)

    assert message.startswith(f"{path}: "), message
    assert words in message, message


def test_F14_a_refusal_names_the_table_the_caller_named() -> None:
    message = refusal({"a": [NAN]}, where="message.headers")

    assert message.startswith("message.headers['a'][0]: ")


def test_F14_a_table_that_contains_itself_is_refused() -> None:
    looped: dict[str, Any] = {}
    looped["self"] = looped

    message = refusal({"a": looped})

    assert message.startswith("headers['a']['self']['self']")
    assert "contain itself" in message
    assert len(message) < 400


def test_F14_headers_that_are_not_a_table_are_refused() -> None:
    assert "must be a dict" in refusal([("a", 1)])


@pytest.mark.parametrize(
    "headers",
    [{"s": "x" * 10_000 + "\ud800"}, {"k" * 10_000: 1}, {"i": 10**5000}, {"x": (0,) * 10_000}],
    ids=["long-str", "long-key", "huge-int", "long-tuple"],
)
def test_F14_huge_values_are_shortened_in_the_message(headers: dict[str, Any]) -> None:
    assert len(refusal(headers)) < 600


def test_F14_strings_and_byte_arrays_are_held_to_a_32_bit_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 4 GiB values are too big to build in a test: lower the limit instead.
    monkeypatch.setattr("hopsched.core.validate._LONG_MAX", 3)

    assert check_headers({"s": "abc", "é": "é", "b": b"abc"})
    assert "long string" in refusal({"s": "abcd"})
    assert "long string" in refusal({"s": "éé"})
    assert "byte array" in refusal({"b": bytearray(b"abcd")})


# Why each refusal: what pamqp or the wire would do with the value.
@pytest.mark.parametrize(
    ("value", "pamqp_raises"),
    [
        (1e300, OverflowError),
        ("\ud800", UnicodeEncodeError),
        (2**64, TypeError),
        (Decimal("1E-256"), TypeError),
        (datetime(1969, 12, 31, tzinfo=UTC), struct.error),
        ((1, 2), TypeError),
        (time.gmtime(0), None),  # encoded, but as UTC whatever zone it meant
    ],
    ids=repr,
)
def test_F14_pamqp_fails_or_guesses_where_check_headers_names_the_header(
    value: Any, pamqp_raises: type[Exception] | None
) -> None:
    if pamqp_raises is not None:
        with pytest.raises(pamqp_raises):
            encode.field_table({"v": value})
    assert refusal({"v": value}).startswith("headers['v']: ")


def test_F14_pamqp_merges_keys_sharing_their_first_128_bytes() -> None:
    prefix = "k" * MAX_KEY_BYTES
    headers = {prefix + "-a": "a", prefix + "-b": "b"}

    assert wire(headers) == {prefix: "b"}  # a value lost, silently
    assert "128 bytes" in refusal(headers)


def test_F14_a_naive_datetime_would_arrive_as_utc() -> None:
    local = datetime(2030, 1, 1, 9)

    assert wire({"t": local})["t"] == local.replace(tzinfo=UTC)  # 9:00 UTC, whatever was meant
    assert "naive" in refusal({"t": local})


# --- F14: accepted values -------------------------------------------------------------------

EDGE_HEADERS: dict[str, Any] = {
    "int-min": -(2**63),
    "int-max": 2**63 - 1,
    "uint16": 65_535,
    "uint32": 2**32 - 1,
    "float32-max": FLOAT32_MAX,
    "float32-max-rounded": math.nextafter(FLOAT32_OVERFLOW, 0),
    "float-rounded": 0.1,
    "float-subnormal": 1e-45,
    "float-underflow": 1e-50,
    "float-minus-zero": -0.0,
    "decimal-min": Decimal(-(2**31)),
    "decimal-places": Decimal(2**31 - 1).scaleb(-255),
    "decimal-exponent": Decimal("1E+9"),
    "decimal-zero-exponent": Decimal("0E+100"),
    "epoch": datetime(1970, 1, 1, tzinfo=UTC),
    "last-second": TIMESTAMP_LAST.replace(microsecond=999_999),
    "zoned": datetime(2030, 1, 1, 9, 30, tzinfo=UTC_MINUS_5),
    "bytes": b"\x00\xff",
    "bytearray": bytearray(b"\x01\x02"),
    "none": None,
    "true": True,
    "false": False,
    "text": "ünïcødé ✓ 日本語 🐇",
    "empty-text": "",
    "": "an empty key",
    "k" * MAX_KEY_BYTES: "a key of 128 bytes",
    "é" * (MAX_KEY_BYTES // 2): "128 bytes of UTF-8",
    "nul\x00key": "a NUL in a key",
    "nested": {"a": [1, {"b": [b"x", None, 0.5]}], "empty-list": [], "empty-table": {}},
    "deep": nest(MAX_DEPTH, b"bottom"),
}


def test_F14_edge_values_are_accepted_and_arrive_as_documented() -> None:
    checked = check_headers(EDGE_HEADERS)

    assert same(wire(checked), after_wire(EDGE_HEADERS))
    assert wire(checked)["float-rounded"] == 0.10000000149011612
    assert wire(checked)["float-underflow"] == 0.0
    assert wire(checked)["last-second"] == TIMESTAMP_LAST


def test_F14_bytes_become_bytearray_at_any_depth() -> None:
    checked = check_headers({"b": b"\x00\xff", "n": [{"x": b"y"}], "keep": bytearray(b"z")})

    assert checked == {"b": b"\x00\xff", "n": [{"x": b"y"}], "keep": b"z"}
    assert type(checked["b"]) is bytearray
    assert type(checked["n"][0]["x"]) is bytearray
    with pytest.raises(TypeError):  # what pamqp does with bytes
        encode.field_table({"b": b"\x00\xff"})
    assert wire(checked)["b"] == bytearray(b"\x00\xff")


def test_check_headers_returns_a_new_table_and_leaves_its_input_alone() -> None:
    headers = {"a": {"b": [1, b"x"]}}

    checked = check_headers(headers)
    checked["a"]["b"].append(2)

    assert headers == {"a": {"b": [1, b"x"]}}
    assert type(headers["a"]["b"][1]) is bytes


def test_check_headers_of_none_is_an_empty_table_and_any_mapping_becomes_a_dict() -> None:
    assert check_headers(None) == {}
    checked = check_headers(MappingProxyType({"a": MappingProxyType({"b": 1})}))

    assert checked == {"a": {"b": 1}}
    assert type(checked["a"]) is dict


def test_F14_nesting_up_to_max_depth_is_accepted() -> None:
    tables: Any = {"bottom": True}
    for _ in range(MAX_DEPTH - 1):
        tables = {"t": tables}

    assert check_headers({"deep": tables}) == {"deep": tables}
    assert check_headers({"deep": nest(MAX_DEPTH)}) == {"deep": nest(MAX_DEPTH)}
    assert "more than" in refusal({"deep": {"t": tables}})


def utf8_at_most(limit: int) -> st.SearchStrategy[str]:
    return st.text(max_size=limit).filter(lambda text: len(text.encode()) <= limit)


# Values that ``check_headers`` documents as carried (bytes, floats and datetimes altered).
fixed_offsets = st.builds(
    lambda minutes: timezone(timedelta(minutes=minutes)), st.integers(-23 * 60, 23 * 60)
)
valid_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(min_value=-FLOAT32_MAX, max_value=FLOAT32_MAX)
    | st.text()
    | st.binary(max_size=16)
    | st.binary(max_size=16).map(bytearray)
    | st.builds(
        lambda digits, places: Decimal(digits).scaleb(-places),
        st.integers(-(2**31), 2**31 - 1),
        st.integers(0, 255),
    )
    | st.datetimes(
        min_value=datetime(1970, 1, 2),
        max_value=datetime(2106, 2, 6),
        timezones=st.just(UTC) | fixed_offsets,
    )
)
valid_values = st.recursive(
    valid_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(utf8_at_most(MAX_KEY_BYTES), children, max_size=4)
    ),
    max_leaves=12,
)
valid_tables = st.dictionaries(utf8_at_most(MAX_KEY_BYTES), valid_values, max_size=6)

# Anything a caller might pass, most of it refused.
any_text = st.text(max_size=6) | st.text(st.characters(categories=["Cs", "Ll"]), max_size=3)
long_keys = st.builds(
    lambda unit, count: unit * count, st.sampled_from(["k", "é", "🐇"]), st.integers(30, 140)
)
any_scalars = (
    valid_scalars
    | st.integers()
    | st.sampled_from([2**63, -(2**63) - 1, 2**64, FLOAT32_OVERFLOW, 1e300, NAN, INF, -INF])
    | st.floats()
    | any_text
    | st.decimals(allow_nan=True, allow_infinity=True)
    | st.datetimes(timezones=st.none() | st.just(UTC) | fixed_offsets)
    | st.datetimes(
        min_value=datetime(1969, 12, 31, 23),
        max_value=datetime(2106, 2, 7, 7),
        timezones=st.just(UTC),
    )
    | st.tuples(st.integers())
    | st.just(time.gmtime(0))
    | st.dates()
)
any_keys = any_text | long_keys | st.integers(-2, 2)
any_tables = st.dictionaries(
    any_keys,
    st.recursive(
        any_scalars,
        lambda children: (
            st.lists(children, max_size=3) | st.dictionaries(any_keys, children, max_size=3)
        ),
        max_leaves=8,
    ),
    max_size=4,
)


@given(table=valid_tables)
def test_F14_every_carried_value_is_accepted_and_arrives_as_documented(
    table: dict[str, Any],
) -> None:
    checked = check_headers(table)

    assert same(wire(checked), after_wire(table))


@given(table=any_tables)
def test_F14_anything_accepted_pamqp_encodes_and_decodes_as_documented(
    table: dict[Any, Any],
) -> None:
    # Whatever the input, the outcome is one of two: a refusal naming the headers, or a
    # table pamqp encodes (no bare TypeError, OverflowError, ...) that arrives as
    # documented (no silent truncation, no value lost).
    try:
        checked = check_headers(table)
    except InvalidScheduleError:
        return
    assert same(wire(checked), after_wire(table))
    assert check_headers(checked) == checked


# --- F18: expiration ----------------------------------------------------------------------


def rabbitmq_accepts(text: str) -> bool:
    """RabbitMQ's verdict on an ``expiration`` string (``rabbit_basic:parse_expiration``):
    Erlang's ``string:to_integer`` (an optional sign and ASCII digits), nothing left
    over, 0 to 10 years. ``test_F18_expiration_edges_on_the_broker`` checks this model."""
    return re.fullmatch("[+-]?[0-9]+", text) is not None and 0 <= int(text) <= MAX_EXPIRATION_MS


@pytest.mark.parametrize(
    ("value", "normalized"),
    [
        (None, None),
        (0, "0"),
        ("0", "0"),
        ("000", "0"),
        ("007", "7"),
        (60_000, "60000"),
        ("60000", "60000"),
        (MAX_EXPIRATION_MS, "315360000000"),
        ("0315360000000", "315360000000"),
    ],
)
def test_F18_valid_expiration_is_returned_as_digits(value: Any, normalized: str | None) -> None:
    assert check_expiration(value) == normalized


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (-5, "is negative"),
        ("-5000", "is negative"),
        (MAX_EXPIRATION_MS + 1, "over 10 years"),
        ("315360000001", "over 10 years"),
        (20 * 365 * 86_400_000, "over 10 years"),
        ("9" * 5000, "over 10 years"),
        ("", "never expires"),
        ("+5", "has a sign"),
        ("-0", "has a sign"),
        ("--5", "not plain digits"),
        ("+", "not plain digits"),
        (" 5", "not plain digits"),
        ("5 ", "not plain digits"),
        ("\t5", "not plain digits"),
        ("1.5", "not plain digits"),
        ("1e3", "not plain digits"),
        ("abc", "not plain digits"),
        ("\u0663", "not plain digits"),  # ARABIC-INDIC DIGIT THREE: str.isdigit() says yes
        ("²", "not plain digits"),
        (1.5, "has type float"),
        (60_000.0, "has type float"),
        (True, "has type bool"),
        (Decimal(5), "has type Decimal"),
        (timedelta(seconds=5), "has type timedelta"),
        (b"5", "has type bytes"),
    ],
    ids=repr,
)
def test_F18_invalid_expiration_is_refused_with_the_rule(value: Any, words: str) -> None:
    with pytest.raises(InvalidScheduleError) as caught:
        check_expiration(value)

    message = str(caught.value)
    assert message.startswith("expiration ")
    assert words in message
    assert "315360000000 (10 years)" in message
    assert len(message) < 400


@pytest.mark.parametrize(
    ("expiration", "words"),
    [
        (-5, "is negative"),  # seconds: aio-pika writes "-5000"
        (datetime.now(UTC) - timedelta(minutes=1), "is negative"),
        (timedelta(days=20 * 365), "over 10 years"),
    ],
    ids=["minus-5-s", "past-datetime", "20-years"],
)
def test_F18_what_aio_pika_writes_for_the_field_cases_is_refused(
    expiration: Any, words: str
) -> None:
    written = aio_pika.Message(b"", expiration=expiration).properties.expiration

    with pytest.raises(InvalidScheduleError, match=words):
        check_expiration(written)


def test_F18_zero_is_valid_and_empty_would_be_dropped_by_pamqp() -> None:
    assert check_expiration(aio_pika.Message(b"", expiration=0).properties.expiration) == "0"
    # pamqp leaves an empty string out of the frame: no expiration at all.
    assert Basic.Properties(expiration="").marshal() == Basic.Properties().marshal()


@given(
    text=st.text(max_size=14)
    | st.from_regex(r"[+-]?0*[0-9]{1,13}", fullmatch=True)
    | st.integers(0, MAX_EXPIRATION_MS + 10).map(str)
)
def test_F18_what_check_expiration_accepts_rabbitmq_reads_as_the_same_number(
    text: str,
) -> None:
    try:
        normalized = check_expiration(text)
    except InvalidScheduleError:
        # Refused only where RabbitMQ refuses too, or for a sign, or an empty string.
        assert not (text.isascii() and text.isdigit() and rabbitmq_accepts(text))
        return
    assert rabbitmq_accepts(text)
    assert normalized == str(int(text))


@given(ms=st.integers())
def test_F18_an_int_is_accepted_exactly_from_0_to_10_years(ms: int) -> None:
    if 0 <= ms <= MAX_EXPIRATION_MS:
        assert check_expiration(ms) == str(ms)
    else:
        with pytest.raises(InvalidScheduleError, match="expiration"):
            check_expiration(ms)


# --- F17: frame size ----------------------------------------------------------------------

#: A frame's type, channel, payload size and frame-end octet (AMQP 0-9-1 section 4.2.3).
FRAME_OVERHEAD = 1 + 2 + 4 + 1
#: Class id, weight, body size and property flags of a basic content header (section
#: 4.2.6.1).
CONTENT_HEADER_FIXED = 2 + 2 + 8 + 2


def properties_of_frame_size(size: int, **others: Any) -> Basic.Properties:
    """Properties whose content header frame is ``size`` bytes, padded by one header."""
    unpadded = content_header_size(Basic.Properties(headers={"pad": ""}, **others), 0)
    properties = Basic.Properties(headers={"pad": "p" * (size - unpadded)}, **others)
    assert content_header_size(properties, 0) == size
    return properties


def test_F17_content_header_size_is_the_marshalled_frame() -> None:
    properties = Basic.Properties(headers={"a": "b"}, message_id="m", delivery_mode=2)

    assert content_header_size(properties, 7) == len(
        frame.marshal(ContentHeader(body_size=7, properties=properties), 1)
    )
    assert content_header_size(Basic.Properties(), 0) == FRAME_OVERHEAD + CONTENT_HEADER_FIXED
    assert content_header_size(properties, 0) == content_header_size(properties, 2**63)


def test_F17_an_unset_message_id_costs_33_bytes_once_aiormq_fills_it() -> None:
    filled = Basic.Properties(message_id="0123456789abcdef0123456789abcdef")

    assert content_header_size(filled, 0) - content_header_size(Basic.Properties(), 0) == 33


def test_F17_a_frame_of_exactly_frame_max_is_accepted_one_byte_more_refused() -> None:
    check_frame_size(properties_of_frame_size(131_072), 10, 131_072)
    over = properties_of_frame_size(131_073)

    with pytest.raises(InvalidScheduleError) as caught:
        check_frame_size(over, 10, 131_072)

    message = str(caught.value)
    assert "content header frame of 131073 bytes" in message
    assert "frame_max of 131072" in message
    assert f"headers table is {len(encode.field_table(over.headers))} bytes" in message
    assert "501 FRAME_ERROR" in message
    assert "message body" in message


def test_F17_frame_max_zero_means_no_limit() -> None:
    check_frame_size(properties_of_frame_size(1_000_000), 0, 0)


def test_F17_properties_without_headers_name_an_empty_table() -> None:
    properties = Basic.Properties(message_id="m" * 255, correlation_id="c" * 255)

    with pytest.raises(InvalidScheduleError, match="headers table is 0 bytes"):
        check_frame_size(properties, 0, 512)


# --- against the broker -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule_id", "named"),
    [
        ("", "non-empty"),
        (" order-42", "whitespace at either end"),
        ("order-42\t", "printable"),
        ("x" * 256, "at most 255 bytes"),
        ("é" * 128, "at most 255 bytes"),
    ],
)
def test_a_schedule_id_that_cannot_be_a_business_key_is_refused(
    schedule_id: str, named: str
) -> None:
    """The ids the docs rule out are refused by name, before anything is sent."""
    from hopsched.client.prepare import check_schedule_id

    with pytest.raises(InvalidScheduleError, match=named):
        check_schedule_id(schedule_id)
    assert check_schedule_id("order-42-timeout é") == "order-42-timeout é"
