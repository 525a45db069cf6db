"""Checks of a caller's message before anything is sent to the broker. Pure: no I/O, no clock.

Each check turns a value that would fail far from its cause into an
``InvalidScheduleError`` that names the field, what is wrong and the fix. The faults
(RabbitMQ 3.10.8, pamqp 4.0; ``tests/unit/test_validate.py`` shows each on a real broker):

- ``check_headers``: a NaN or infinite float header makes RabbitMQ close the whole
  connection (541 INTERNAL_ERROR), failing every publish on it; other values make
  pamqp raise a bare TypeError, OverflowError or UnicodeEncodeError at publish time, or
  arrive altered (a key over 128 bytes cut short, a naive datetime taken as UTC).
- ``check_expiration``: RabbitMQ closes the channel (406 PRECONDITION_FAILED) on an
  ``expiration`` that is negative, over 10 years or not an integer.
- ``check_frame_size``: a content header frame larger than the connection's frame_max
  makes RabbitMQ close the connection (501 FRAME_ERROR).

Cost (best of 9 timeit runs, Python 3.11 on this project's 2-core machine; the higher
figure while other work shared it): ``check_headers`` of five short str headers
1.9-4.3 µs; ``check_expiration("60000")`` 1.2-1.6 µs; ``check_frame_size`` of those
headers and a message id 13-18 µs, most of it pamqp marshalling the frame.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

from pamqp import encode, frame
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from hopsched.errors import InvalidScheduleError

__all__ = [
    "MAX_DEPTH",
    "MAX_EXPIRATION_MS",
    "MAX_KEY_BYTES",
    "check_expiration",
    "check_frame_size",
    "check_headers",
    "content_header_size",
]

#: Longest header key, bytes of UTF-8: pamqp cuts longer keys to 128 bytes
#: (``encode.field_table``), so two keys sharing their first 128 bytes would merge.
#: RabbitMQ itself takes up to 255 (an AMQP short string).
MAX_KEY_BYTES = 128

#: Deepest nesting of tables and arrays in the headers. pamqp encodes and decodes
#: nesting recursively (two Python frames a level) and raises RecursionError near
#: 450 levels, on the publisher's side or in a consumer's connection reader.
MAX_DEPTH = 100

#: Largest per-message ``expiration``, ms: 10 years. RabbitMQ's
#: ``rabbit_misc:check_expiry/1`` refuses more (``value_too_large``).
MAX_EXPIRATION_MS = 315_360_000_000

_INT64 = (-(2**63), 2**63 - 1)  # 'l', the widest AMQP integer
_DECIMAL_DIGITS = (-(2**31), 2**31 - 1)  # 'D': a signed 32-bit integer of digits...
_DECIMAL_MAX_DIGITS = 10  # ... so at most 10 of them (no bigger int built to find out)
_DECIMAL_PLACES = 255  # ... and an octet of decimal places
_LONG_MAX = 2**32 - 1  # bytes in a long string or byte array: a 32-bit length
# pamqp sends a datetime as whole seconds, unsigned 64-bit; its decoder reads one past
# 2**32 - 1 as milliseconds (decode.timestamp), so later ones arrive wrong.
_TIMESTAMP_END = 2**32
_FLOAT32 = struct.Struct(">f")  # pamqp sends every Python float as 'f'

_SHORT = 40


class _Refused(Exception):
    """A value deep in the table was refused; its path is filled in as it unwinds."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []


def check_headers(headers: Mapping[str, Any] | None, *, where: str = "headers") -> dict[str, Any]:
    """Check a headers table and return it ready for pamqp.

    What each value becomes (pamqp's ``encode.encode_table_value``; RabbitMQ carries
    every one unchanged, dead-lettering included):

    - ``str``, ``bool``, ``None``, ``int`` (signed 64-bit), ``Decimal`` (up to 255
      places of a signed 32-bit integer of digits), ``dict`` (any ``Mapping``, as a
      dict) and ``list``, at any depth up to ``MAX_DEPTH``: arrive equal.
    - ``bytes``: converted to ``bytearray``; they travel as an AMQP byte array and
      consumers using pamqp or aio-pika receive a ``bytearray`` of the same bytes.
    - ``float``: travels as a 32-bit float (pamqp's choice), so it arrives rounded to
      about 7 significant digits (0.1 arrives as 0.10000000149011612; magnitudes below
      1.4e-45 as 0.0). Send a str or a Decimal for an exact value.
    - aware ``datetime`` from 1970-01-01T00:00:00Z to 2106-02-07T06:28:15Z: arrives as
      the same instant in UTC, in whole seconds (the fraction is dropped).

    Refused: keys that are not str or are longer than ``MAX_KEY_BYTES``; NaN and
    infinite floats; numbers beyond the ranges above; naive datetimes and
    ``time.struct_time`` (pamqp would take them as UTC); datetimes outside the range
    above; text with a lone surrogate (not UTF-8); tuples, sets and every other type.

    Args:
        headers: the caller's headers; None is an empty table.
        where: the name the error messages give the table, e.g. ``"message.headers"``.

    Returns:
        A new dict (nested tables and arrays copied too).

    Raises:
        InvalidScheduleError: a key or value AMQP cannot carry; the message gives its
            path (e.g. ``headers['a'][2]['k']``), what is wrong and how to fix it.
    """
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidScheduleError(
            f"{where} {shorten(headers)}: must be a dict of str keys, got {type(headers).__name__}"
        )
    try:
        return _table(headers, 0)
    except _Refused as refused:
        raise InvalidScheduleError(f"{where}{_path(refused.path)}: {refused.problem}") from None


def _table(table: Mapping[Any, Any], depth: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in table.items():
        if not isinstance(key, str):
            raise _Refused(
                f"key {shorten(key)} has type {type(key).__name__}: AMQP table keys are "
                "strings; use str(key)"
            )
        if _utf8_size(key, "key ") > MAX_KEY_BYTES:
            raise _Refused(
                f"key {shorten(key)} is {len(key.encode())} bytes of UTF-8: pamqp cuts keys "
                f"to {MAX_KEY_BYTES} bytes, so keys sharing their first {MAX_KEY_BYTES} "
                "would merge and a value be lost; use a shorter key"
            )
        try:
            result[key] = _value(value, depth)
        except _Refused as refused:
            refused.path.append(f"[{shorten(key)}]")
            raise
    return result


def _array(items: list[Any], depth: int) -> list[Any]:
    result: list[Any] = []
    for index, item in enumerate(items):
        try:
            result.append(_value(item, depth))
        except _Refused as refused:
            refused.path.append(f"[{index}]")
            raise
    return result


def _value(value: Any, depth: int) -> Any:
    # pamqp tests bool before int (a bool is an int) and sends each by its type.
    if isinstance(value, str):
        if _utf8_size(value, "") > _LONG_MAX:
            raise _Refused(
                f"{shorten(value)} is longer than an AMQP long string ({_LONG_MAX} bytes)"
            )
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise _Refused(
                f"{shorten(value)} is beyond a signed 64-bit integer, the widest AMQP "
                "integer: send it as a string"
            )
        return value
    if isinstance(value, float):
        _check_float(value)
        return value
    if isinstance(value, Decimal):
        _check_decimal(value)
        return value
    if isinstance(value, datetime):
        _check_datetime(value)
        return value
    if isinstance(value, bytes | bytearray):
        if len(value) > _LONG_MAX:
            raise _Refused(
                f"{shorten(value)} is longer than an AMQP byte array ({_LONG_MAX} bytes)"
            )
        # pamqp cannot encode bytes (TypeError) but sends a bytearray as a byte array.
        return value if isinstance(value, bytearray) else bytearray(value)
    if isinstance(value, Mapping | list):
        if depth >= MAX_DEPTH:
            raise _Refused(
                f"tables and arrays nest more than {MAX_DEPTH} deep (does one contain "
                "itself?): pamqp encodes and decodes them recursively and fails near 450 "
                "levels; flatten the structure or send it as a JSON string"
            )
        if isinstance(value, list):
            return _array(value, depth + 1)
        return _table(value, depth + 1)
    raise _Refused(_unknown_type(value))


def _utf8_size(text: str, label: str) -> int:
    if text.isascii():
        return len(text)
    try:
        return len(text.encode())
    except UnicodeEncodeError as error:
        raise _Refused(
            f"{label}{shorten(text)} holds a lone surrogate {text[error.start]!r} at index "
            f"{error.start}, which UTF-8 (the encoding of AMQP strings) cannot carry; "
            "fix the text, or send raw data as bytes"
        ) from None


def _check_float(value: float) -> None:
    if not math.isfinite(value):
        raise _Refused(
            f"{value!r} cannot travel in AMQP: RabbitMQ closes the whole connection "
            "(541 INTERNAL_ERROR) on a NaN or infinite float, failing every publish on "
            "it; send it as a string"
        )
    try:
        _FLOAT32.pack(value)
    except OverflowError:
        raise _Refused(
            f"{value!r} is beyond a 32-bit float (largest 3.4028234663852886e+38), the "
            "width pamqp sends a Python float in; send it as a string"
        ) from None


def _check_decimal(value: Decimal) -> None:
    sign, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        raise _Refused(f"{value!r}: an AMQP decimal is finite; send it as a string")
    # pamqp (encode.decimal) sends digits * 10**exponent as mantissa * 10**-places.
    if -exponent <= _DECIMAL_PLACES:
        if not any(digits):
            return
        if len(digits) + max(exponent, 0) <= _DECIMAL_MAX_DIGITS:
            mantissa = int("".join(map(str, digits))) * 10 ** max(exponent, 0)
            if _DECIMAL_DIGITS[0] <= (-mantissa if sign else mantissa) <= _DECIMAL_DIGITS[1]:
                return
    raise _Refused(
        f"{shorten(value)} does not fit an AMQP decimal (a signed 32-bit integer of "
        f"digits, {_DECIMAL_DIGITS[0]} to {_DECIMAL_DIGITS[1]}, and 0 to "
        f"{_DECIMAL_PLACES} decimal places); round it, or send it as a string"
    )


def _check_datetime(value: datetime) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise _Refused(
            f"{value.isoformat()} is a naive datetime, which pamqp would send as UTC "
            "whatever zone was meant; make it aware, e.g. value.replace(tzinfo=timezone.utc)"
        )
    if not 0 <= value.timestamp() < _TIMESTAMP_END:
        raise _Refused(
            f"{value.isoformat()} is outside the AMQP timestamps pamqp carries, "
            "1970-01-01T00:00:00Z to 2106-02-07T06:28:15Z (it cannot send an earlier one "
            "and decodes a later one as milliseconds); send it as an ISO 8601 string"
        )


def _unknown_type(value: object) -> str:
    kind = type(value).__name__
    if isinstance(value, time.struct_time):
        return (
            "a time.struct_time has no time zone and pamqp would send it as UTC; pass an "
            "aware datetime, e.g. datetime(*t[:6], tzinfo=timezone.utc) if it is UTC"
        )
    if isinstance(value, tuple | set | frozenset):
        return f"{shorten(value)} has type {kind}; use a list (AMQP arrays arrive as lists)"
    return (
        f"{shorten(value)} has type {kind}, which AMQP cannot carry; use str, int, float, "
        "bool, Decimal, an aware datetime, bytes, None, dict or list"
    )


def shorten(value: object) -> str:
    """``value`` as an error message shows it: its repr, cut short, with its length."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr() refuses huge ints
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, str | bytes | bytearray) and len(value) > _SHORT:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:_SHORT]!r}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= 2 * _SHORT else f"{text[:_SHORT]}... ({len(text)} characters)"


def _path(reversed_parts: list[str]) -> str:
    parts = reversed_parts[::-1]
    if len(parts) > 12:  # a runaway nesting: its two ends say where it is
        parts = [*parts[:6], f"...{len(parts) - 10} more...", *parts[-4:]]
    return "".join(parts)


def check_expiration(value: Any) -> str | None:
    """Check a per-message ``expiration`` property and return it as pamqp sends it.

    RabbitMQ (``rabbit_basic:parse_expiration/1``, ``rabbit_misc:check_expiry/1``)
    reads it with Erlang's ``string:to_integer`` and refuses a negative value, one over
    ``MAX_EXPIRATION_MS`` (10 years) and anything that is not an integer, closing the
    channel (406 PRECONDITION_FAILED). "0" is valid: the message expires unless a
    consumer can take it at once. The broker also takes a sign ("+5", "-0"); this
    check asks for plain digits so that the value reads the same to every client.

    Args:
        value: None (no expiration); an int of milliseconds; or a str of ASCII digits,
            as in the AMQP property (``aio_pika.Message(expiration=...)`` takes
            seconds, a timedelta or a datetime, and writes such a str of ms).

    Returns:
        None, or the milliseconds as a str of digits without leading zeros.

    Raises:
        InvalidScheduleError: any other value, naming ``expiration``, the rule and the
            bound.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _expiration_error(value, f"has type {type(value).__name__}")
    if isinstance(value, str):
        if not value:
            raise _expiration_error(
                value, "is empty, which pamqp sends as no expiration at all (never expires)"
            )
        sign, digits = (value[0], value[1:]) if value[0] in "+-" else ("", value)
        if not (digits.isascii() and digits.isdigit()):
            raise _expiration_error(value, "is not plain digits")
        if sign == "-" and digits.strip("0"):
            raise _expiration_error(value, "is negative")
        if sign:
            raise _expiration_error(value, "has a sign; write plain digits")
        digits = digits.lstrip("0") or "0"
        # More digits than the bound is over it (and int() refuses over 4300 digits).
        if len(digits) > len(str(MAX_EXPIRATION_MS)):
            raise _expiration_error(value, "is over 10 years")
        value = int(digits)
    if value < 0:
        raise _expiration_error(value, "is negative")
    if value > MAX_EXPIRATION_MS:
        raise _expiration_error(value, "is over 10 years")
    return str(value)


def _expiration_error(value: object, problem: str) -> InvalidScheduleError:
    return InvalidScheduleError(
        f"expiration {shorten(value)} {problem}: it must be whole milliseconds from 0 to "
        f"{MAX_EXPIRATION_MS} (10 years), as an int or a string of digits such as '60000' "
        "(RabbitMQ closes the channel, 406 PRECONDITION_FAILED, on a negative, larger or "
        "non-integer one)"
    )


def content_header_size(properties: Basic.Properties, body_size: int) -> int:
    """The size in bytes of the content header frame that carries ``properties``.

    Marshalled by pamqp as aiormq sends it: frame overhead, class id, weight, body
    size, property flags and the properties, the headers table among them. Measure the
    properties as they will be sent: aiormq gives a publish without a ``message_id`` a
    32-character one (33 bytes more). The body size is a fixed 8-byte field, so its
    value does not change the result.

    Raises:
        TypeError, ValueError: pamqp cannot encode ``properties`` (check the headers
            with ``check_headers`` first).
    """
    return len(frame.marshal(ContentHeader(body_size=body_size, properties=properties), 1))


def check_frame_size(properties: Basic.Properties, body_size: int, frame_max: int) -> None:
    """Check that the content header frame fits the connection's ``frame_max``.

    A content header is always one frame: the body is split across frames, its
    properties never are. AMQP 0-9-1 (section 4.2.3) limits a whole frame to
    ``frame_max`` bytes. RabbitMQ 3.10.8 tolerates 8 bytes more (``FRAME_SIZE_FUDGE``
    in ``rabbit_reader.erl``; measured with frame_max 131072: a 131080-byte header
    frame passes, 131081 bytes close the connection with 501 FRAME_ERROR); this check
    keeps to the protocol's limit.

    Args:
        properties: the properties as they will be sent (see ``content_header_size``).
        body_size: the body's size in bytes.
        frame_max: the value negotiated on the connection (``connection_tune.frame_max``
            in aiormq; RabbitMQ's default, 131072, unless the broker configures
            another); 0, AMQP's "no limit", skips the check.

    Raises:
        InvalidScheduleError: the frame is larger than ``frame_max``.
    """
    size = content_header_size(properties, body_size)
    if frame_max and size > frame_max:
        table = len(encode.field_table(properties.headers)) if properties.headers else 0
        raise InvalidScheduleError(
            f"the message's properties make a content header frame of {size} bytes, more "
            f"than the connection's frame_max of {frame_max}; the headers table is {table} "
            "bytes of it. RabbitMQ would close the whole connection (501 FRAME_ERROR), "
            "failing every publish on it: move large data out of the headers into the "
            "message body"
        )
