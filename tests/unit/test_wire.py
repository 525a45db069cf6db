"""The hot path's AMQP codec (``hopsched.amqp.wire``) against pamqp's: what one encodes
the other decodes to the same values, frame by frame. Pure, no broker."""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import body, commands, decode, encode, frame, header

from hopsched.amqp import wire
from hopsched.amqp.wire import FrameError, FrameReader, Properties, Table

INTEGER_EDGES = [0, 1, -1, 127, 128, -129, 32767, 32768, 65536, 2**31, 2**32, 2**63 - 1, -(2**63)]

scalars = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.sampled_from(INTEGER_EDGES)
    | st.text()
    | st.floats(width=32, allow_nan=False, allow_infinity=False)
    | st.builds(
        lambda mantissa, scale: Decimal(mantissa).scaleb(-scale),
        st.integers(-(2**31), 2**31 - 1),
        st.integers(0, 255),
    )
    | st.datetimes(
        min_value=datetime(1970, 1, 2), max_value=datetime(2106, 2, 6), timezones=st.just(UTC)
    ).map(lambda moment: moment.replace(microsecond=0))
    | st.binary().map(bytearray)
    | st.none()
)
keys = st.text(max_size=20).filter(lambda key: len(key.encode()) <= 128)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=12,
)
tables = st.dictionaries(keys, values, max_size=8)


def pamqp_decoded(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` after pamqp's own encode and decode (what a pamqp consumer reads)."""
    return decode.field_table(encode.field_table(table))[1]


# --- field tables -------------------------------------------------------------------------


@given(table=tables)
def test_a_table_from_a_dict_reads_as_pamqp_reads_it(table: dict[str, Any]) -> None:
    encoded = Table.from_dict(table).encode()

    assert decode.field_table(encoded)[1] == pamqp_decoded(table)
    assert dict(Table.from_dict(table)) == pamqp_decoded(table)


@given(table=tables)
def test_a_pamqp_table_decodes_entry_by_entry_and_encodes_back_the_same(
    table: dict[str, Any],
) -> None:
    encoded = encode.field_table(table)

    decoded, end = Table.decode(encoded)

    assert end == len(encoded)
    assert dict(decoded) == pamqp_decoded(table)
    assert decoded.encode() == encoded
    assert decoded.encoded_size() == len(encoded)


@given(table=tables, extra=tables)
def test_update_and_without_change_only_their_keys(
    table: dict[str, Any], extra: dict[str, Any]
) -> None:
    base = Table.decode(encode.field_table(table))[0]

    updated = base.update(extra).without(list(table)[:1])

    expected = {**pamqp_decoded(table), **pamqp_decoded(extra)}
    for key in list(table)[:1]:
        expected.pop(key, None)
    assert dict(updated) == expected
    assert dict(base) == pamqp_decoded(table)  # the original is untouched


@pytest.mark.parametrize("value", INTEGER_EDGES)
def test_every_integer_width_reads_back_exactly(value: int) -> None:
    table = Table.decode(encode.field_table({"n": value}))[0]

    assert table["n"] == value
    assert type(table["n"]) is int


@pytest.mark.parametrize(
    ("kind", "payload", "expected"),
    [
        (b"U", struct.pack(">h", -2), -2),  # signed short, as some clients write it
        (b"u", struct.pack(">H", 65535), 65535),
        (b"L", struct.pack(">Q", 2**63), 2**63),
        (b"B", b"\xff", 255),
    ],
)
def test_integer_types_pamqp_never_writes_are_read(
    kind: bytes, payload: bytes, expected: int
) -> None:
    entry = b"\x01n" + kind + payload
    encoded = struct.pack(">I", len(entry)) + entry

    assert Table.decode(encoded)[0]["n"] == expected


def test_a_string_that_is_not_utf8_reads_as_bytes_like_pamqp() -> None:
    entry = b"\x01s" + b"S" + struct.pack(">I", 2) + b"\xff\xfe"
    encoded = struct.pack(">I", len(entry)) + entry

    assert Table.decode(encoded)[0]["s"] == b"\xff\xfe"


@pytest.mark.parametrize(
    "encoded",
    [
        struct.pack(">I", 3) + b"\x01kZ",  # unknown type
        struct.pack(">I", 20) + b"\x01kS",  # longer than the data
        struct.pack(">I", 8) + b"\x01kS" + struct.pack(">I", 100),  # entry past its table
    ],
)
def test_malformed_tables_are_value_errors(encoded: bytes) -> None:
    with pytest.raises((ValueError, IndexError, struct.error)):
        Table.decode(encoded)


# --- properties ---------------------------------------------------------------------------

shortstrs = st.none() | st.text(max_size=30).filter(lambda text: len(text.encode()) <= 255)
pamqp_properties = st.builds(
    commands.Basic.Properties,
    content_type=shortstrs,
    content_encoding=shortstrs,
    headers=st.none() | tables,
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    priority=st.none() | st.integers(0, 255),
    correlation_id=shortstrs,
    reply_to=shortstrs,
    expiration=shortstrs,
    message_id=shortstrs,
    timestamp=st.none()
    | st.datetimes(
        min_value=datetime(1970, 1, 2), max_value=datetime(2106, 2, 6), timezones=st.just(UTC)
    ).map(lambda moment: moment.replace(microsecond=0)),
    message_type=shortstrs,
    user_id=shortstrs,
    app_id=shortstrs,
)


def pamqp_content_header(properties: commands.Basic.Properties, size: int) -> bytes:
    return frame.marshal(header.ContentHeader(0, size, properties), 1)


@given(properties=pamqp_properties, size=st.integers(0, 2**40))
def test_properties_decode_as_pamqp_encoded_them(
    properties: commands.Basic.Properties, size: int
) -> None:
    ((kind, channel, payload),) = FrameReader().feed(pamqp_content_header(properties, size))

    body_size, decoded = wire.decode_content_header(payload)

    assert (kind, channel, body_size) == (wire.FRAME_HEADER, 1, size)
    assert decoded.to_pamqp() == pamqp_roundtrip(properties)


@given(properties=pamqp_properties)
def test_properties_encode_as_pamqp_reads_them(properties: commands.Basic.Properties) -> None:
    ours = Properties.from_pamqp(properties)

    data = wire.content_frames(1, ours.encode(), b"", 131_072)

    received = header.ContentHeader()
    received.unmarshal(FrameReader().feed(data)[0][2])
    assert received.properties == pamqp_roundtrip(properties)


def pamqp_roundtrip(properties: commands.Basic.Properties) -> commands.Basic.Properties:
    decoded = header.ContentHeader()
    decoded.unmarshal(FrameReader().feed(pamqp_content_header(properties, 0))[0][2])
    return decoded.properties


def test_replace_keeps_the_rest_and_leaves_the_original() -> None:
    original = Properties(content_type="text/plain", priority=7, user_id="alice")

    changed = original.replace(user_id=None, delivery_mode=2)

    assert changed == Properties(content_type="text/plain", priority=7, delivery_mode=2)
    assert original.user_id == "alice"


def test_a_property_in_another_encoding_travels_byte_for_byte() -> None:
    flags = struct.pack(">H", 0x8000)  # content_type only
    encoded = flags + b"\x02\xff\xfe"

    decoded = Properties.decode(encoded)

    assert decoded.encode() == encoded


def test_unknown_property_names_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown properties"):
        Properties(colour="blue")


# --- frames -------------------------------------------------------------------------------


def delivery_frames(tag: int, body_bytes: bytes, frame_max: int = 131_072) -> bytes:
    method = commands.Basic.Deliver(
        consumer_tag="ctag", delivery_tag=tag, redelivered=True, exchange="ex", routing_key="rk"
    )
    properties = commands.Basic.Properties(headers={"x-hopsched-due": 123}, delivery_mode=2)
    frames = [frame.marshal(method, 3), pamqp_content_header(properties, len(body_bytes))]
    frames[1] = frames[1][:1] + b"\x00\x03" + frames[1][3:]  # channel 3
    chunk = frame_max - wire.FRAME_OVERHEAD
    for start in range(0, len(body_bytes), chunk):
        frames.append(frame.marshal(body.ContentBody(body_bytes[start : start + chunk]), 3))
    return b"".join(frames)


@given(cuts=st.lists(st.integers(1, 50), max_size=30), size=st.integers(0, 300))
def test_the_reader_finds_the_same_frames_however_the_stream_is_cut(
    cuts: list[int], size: int
) -> None:
    stream = delivery_frames(42, bytes(range(256)) * 2, frame_max=4096)[: 400 + size]
    whole = FrameReader().feed(stream)
    reader, pieces, start = FrameReader(), [], 0
    for cut in [*cuts, len(stream)]:
        pieces += reader.feed(stream[start : start + cut])
        start += cut
    pieces += reader.feed(stream[start:])

    assert pieces == whole


def test_deliver_header_and_body_decode() -> None:
    frames = FrameReader().feed(delivery_frames(2**40, b"payload"))

    assert [(kind, channel) for kind, channel, _ in frames] == [(1, 3), (2, 3), (3, 3)]
    assert wire.method_id(frames[0][2]) == (60, 60)
    assert wire.decode_deliver(frames[0][2]) == ("ctag", 2**40, True, "ex", "rk")
    size, properties = wire.decode_content_header(frames[1][2])
    assert size == 7
    assert properties.headers is not None
    assert properties.headers["x-hopsched-due"] == 123
    assert frames[2][2] == b"payload"


def test_a_frame_without_its_end_octet_is_refused() -> None:
    data = frame.marshal(commands.Basic.Ack(delivery_tag=1), 1)

    with pytest.raises(FrameError, match="end octet"):
        FrameReader().feed(data[:-1] + b"\x00")


def test_a_frame_over_frame_max_is_refused() -> None:
    data = frame.marshal(body.ContentBody(b"x" * 5000), 1)

    with pytest.raises(FrameError, match="frame_max"):
        FrameReader(frame_max=4096).feed(data[:100])


@pytest.mark.parametrize("mandatory", [True, False])
def test_publish_method_is_pamqps(mandatory: bool) -> None:
    ours = wire.publish_method(5, "exchange", "routing.key", mandatory)

    theirs = frame.marshal(
        commands.Basic.Publish(exchange="exchange", routing_key="routing.key", mandatory=mandatory),
        5,
    )
    assert ours == theirs


@pytest.mark.parametrize("multiple", [True, False])
def test_ack_and_nack_frames_are_pamqps(multiple: bool) -> None:
    assert wire.ack_frame(2, 99, multiple) == frame.marshal(
        commands.Basic.Ack(delivery_tag=99, multiple=multiple), 2
    )
    assert wire.nack_frame(2, 99, multiple, False) == frame.marshal(
        commands.Basic.Nack(delivery_tag=99, multiple=multiple, requeue=False), 2
    )


def test_a_confirm_decodes() -> None:
    payload = FrameReader().feed(
        frame.marshal(commands.Basic.Ack(delivery_tag=7, multiple=True), 1)
    )
    assert wire.decode_confirm(payload[0][2]) == (7, True)


def test_the_body_is_split_at_frame_max() -> None:
    data = wire.content_frames(1, Properties().encode(), b"y" * 10_000, 4096)

    frames = FrameReader(frame_max=4096).feed(data)

    assert [len(payload) for _, _, payload in frames[1:]] == [4088, 4088, 1824]
    assert b"".join(payload for _, _, payload in frames[1:]) == b"y" * 10_000


def test_properties_too_large_for_one_frame_are_refused_before_sending() -> None:
    large = Properties(headers=Table.from_dict({"big": "z" * 5000})).encode()

    with pytest.raises(ValueError, match="move large values into the body"):
        wire.content_frames(1, large, b"", 4096)


@given(value=st.integers(-(2**63), 2**63 - 1) | st.sampled_from(INTEGER_EDGES))
def test_an_int_is_written_in_the_width_pamqp_picks(value: int) -> None:
    assert Table.from_dict({"n": value}).encode() == encode.field_table({"n": value})


@given(
    queue=st.from_regex(r"[a-zA-Z0-9_.:-]{1,255}", fullmatch=True),  # names pamqp allows
    tag=st.text(alphabet="abcdef0123456789-", min_size=1, max_size=40),
    channel=st.integers(1, 65535),
    credit=st.integers(0, 2**31 - 1),
)
def test_a_consume_with_credit_reads_as_a_basic_consume_with_a_64_bit_credit(
    queue: str, tag: str, channel: int, credit: int
) -> None:
    """RabbitMQ 3.x reads ``x-credit``'s credit only as a 64-bit ``l`` field."""
    encoded = wire.credit_consume_frame(channel, queue, tag, credit)
    consumed, number, method = frame.unmarshal(encoded)
    assert (consumed, number) == (len(encoded), channel)
    assert isinstance(method, commands.Basic.Consume)
    assert (method.queue, method.consumer_tag, method.no_ack) == (queue, tag, False)
    assert method.arguments == {"x-credit": {"credit": credit, "drain": False}}
    assert b"creditl" + struct.pack(">q", credit) in encoded
