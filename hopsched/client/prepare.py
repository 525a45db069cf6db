"""A ``schedule()`` call checked and encoded, before anything is sent. Pure: no I/O; the
clock's reading, the ladder, the names and the connection's frame_max are passed in.

``check_request`` turns a call into a ``Checked`` one or raises ``InvalidScheduleError``
naming what is wrong and how to fix it; ``encode_properties`` encodes it for the first
hop. Between them they refuse every value the broker, pamqp or hopsched's encoder would
fail on later, so ``schedule()`` raises nothing but hopsched errors (the fixed-width
properties: ``priority`` and ``delivery_mode`` are octets, ``timestamp`` 64-bit; every
short string at most 255 bytes of UTF-8; headers as ``validate.check_headers``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

import aio_pika
from pamqp.commands import Basic

from hopsched import amqp
from hopsched.amqp.wire import FRAME_OVERHEAD
from hopsched.core.clock import MAX_DUE_US, datetime_to_us, timedelta_to_us, us_to_datetime
from hopsched.core.envelope import PERSISTENT, Envelope, callers_headers, first_hop_properties
from hopsched.core.ladder import US_PER_MS, Hold, Hop, Ladder
from hopsched.core.plausible import EARLIEST_DUE_US
from hopsched.core.recurring import Rule
from hopsched.core.targets import TargetPolicy
from hopsched.core.validate import check_expiration, check_headers, shorten
from hopsched.errors import EnvelopeError, InvalidScheduleError
from hopsched.topology import DEAD_LETTER_ROUTING_KEY, Topology

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_SCHEDULE_ID_BYTES",
    "SHORT_STRINGS",
    "Checked",
    "ScheduleRequest",
    "check_due",
    "check_known_id",
    "check_properties",
    "check_request",
    "check_schedule_id",
    "copy_envelope",
    "due_time_us",
    "encode_properties",
    "reissue",
    "reroute",
]

#: The longest schedule id, bytes of UTF-8 (it is also the default ``message_id``, an
#: AMQP short string).
MAX_SCHEDULE_ID_BYTES = 255
#: The largest body any RabbitMQ takes: ``max_message_size`` cannot be set above 512 MiB
#: (https://www.rabbitmq.com/docs/configure#config-items; 128 MiB by default on 3.x,
#: 16 MiB on 4.x, where a larger one is refused at publish time).
MAX_BODY_BYTES = 512 * 1024 * 1024

#: Basic properties that are AMQP short strings (at most 255 bytes), pamqp's names.
SHORT_STRINGS = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "message_id",
    "message_type",
    "user_id",
    "app_id",
    "cluster_id",
)
#: pamqp and aio-pika read a ``timestamp`` past 2**32 - 1 s as milliseconds
#: (``pamqp.decode.timestamp``): later instants arrive wrong.
_TIMESTAMP_END = 2**32
#: Room a content header needs beside the caller's headers: the envelope's entries and
#: every other property at its longest, bytes.
_PROPERTIES_ALLOWANCE = 6 * 1024


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """One message for ``schedule_many()``: the arguments of ``schedule()``."""

    message: aio_pika.abc.AbstractMessage | bytes
    routing_key: str
    at: datetime | None = None
    delay: timedelta | float | None = None
    exchange: str = ""
    schedule_id: str | None = None
    #: A recurring schedule's rule (``hopsched.core.recurring.Rule``), instead of at/delay.
    rule: Rule | None = None


@dataclass(slots=True)
class Checked:
    """A ``schedule()`` call found valid, not yet encoded.

    Attributes:
        body: the message body.
        properties: the caller's properties, headers apart.
        headers: the caller's headers, checked and encoded.
        envelope: hopsched's headers for the first hop.
        hop_expires_us: when the first hop's step expires (µs since the epoch), None if
            the message goes straight to the relay.
        exchange, routing_key: where the first publish goes.
        queue: the queue that publish lands in (a step, or the relay queue).
        step_ms: that step's TTL, ms; None for the relay queue.
    """

    body: bytes
    properties: Basic.Properties
    headers: amqp.Table
    envelope: Envelope
    hop_expires_us: int | None
    exchange: str
    routing_key: str
    queue: str
    step_ms: int | None = None


def due_time_us(at: datetime | None, delay: timedelta | float | None, now: int) -> int:
    """The due time in µs since the epoch from exactly one of ``at`` and ``delay``.

    Fractions of a microsecond round up, so a due time is never earlier than asked.

    Raises:
        InvalidScheduleError: both or neither given, a naive datetime, a non-finite delay,
            a due time after year 9999.
    """
    due_us = _due_time_us(at, delay, now)
    if due_us > MAX_DUE_US:
        raise InvalidScheduleError(
            f"the due time is after year 9999 ({delay if at is None else at}): use a shorter delay"
        )
    # Before 1970 is long past due: due at the epoch (the envelope carries no negative due
    # time); ``check_due`` refuses it for a schedule.
    return max(due_us, 0)


def check_due(due_us: int, what: str) -> int:
    """``due_us`` (µs since the epoch) if a relay will take it as meant: on or after
    2001-01-01 (``hopsched.core.plausible``). ``what`` names the argument it came from
    (``"at=2000-01-01T00:00:00+00:00"``).

    Raises:
        InvalidScheduleError: it is earlier: a relay would park it (``implausible_due``).
    """
    if due_us < EARLIEST_DUE_US:
        raise InvalidScheduleError(
            f"{what} is before 2001-01-01: a relay parks so early a due time as a unit "
            "mistake (implausible_due); for at once, pass delay=0 (CLI: --in 0)"
        )
    return due_us


def _due_time_us(at: datetime | None, delay: timedelta | float | None, now: int) -> int:
    if (at is None) == (delay is None):
        raise InvalidScheduleError("give exactly one of at= (a datetime) and delay=")
    if at is not None:
        if not isinstance(at, datetime):
            raise InvalidScheduleError(f"at={shorten(at)}: must be a datetime")
        if at.tzinfo is None or at.utcoffset() is None:
            raise InvalidScheduleError(
                f"at={at.isoformat()} is a naive datetime, which could mean any time zone. "
                "Pass an aware one, e.g. datetime.now(timezone.utc) + timedelta(minutes=30) "
                "or datetime(2030, 1, 1, 9, tzinfo=ZoneInfo('Europe/London'))"
            )
        return datetime_to_us(at)
    # A delay of zero or less means now (an ``at`` in the past keeps its instant).
    if isinstance(delay, timedelta):
        return now + max(0, timedelta_to_us(delay))
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay):
        raise InvalidScheduleError(f"delay={shorten(delay)}: must be a timedelta or finite seconds")
    if delay <= 0:
        return now
    if delay > MAX_DUE_US / 1_000_000:  # no 300-digit Decimal below
        return MAX_DUE_US + 1
    if type(delay) is int:
        return now + delay * 1_000_000
    # A float with whole µs: below 2**30 s a float's steps are under 0.25 µs, so the µs
    # count that gives back exactly this float is the one its shortest repr spells.
    micros = round(delay * 1_000_000)
    if delay < 2**30 and micros / 1_000_000 == delay:
        return now + micros
    # Otherwise the Decimal of its shortest repr: exact, where delay * 1e6 rounds.
    return now + math.ceil(Decimal(repr(delay)) * 1_000_000)


def check_request(
    request: ScheduleRequest,
    *,
    now_us: int,
    ladder: Ladder,
    topology: Topology,
    targets: TargetPolicy,
    login: str,
    frame_max: int,
    max_body_bytes: int = MAX_BODY_BYTES,
    avoid: Collection[int] = (),
    owner: str | None = None,
) -> Checked:
    """Check one ``schedule()`` call and plan its first hop.

    Args:
        request: the call.
        now_us: the clock's reading, µs since the epoch.
        ladder: plans the first hop.
        topology: the names of the queues it may go to.
        targets: the allowed targets (``Settings.allowed_targets``).
        login: the user the connection logs in as (``user_id`` must be it).
        frame_max: the connection's, bytes (131,072 if not connected yet).
        max_body_bytes: the largest body to send (``Settings.max_message_size``: the
            broker's ``max_message_size``, 16 MiB by default on RabbitMQ 4.x).
        avoid: steps (ms) to route around (``Ladder.plan``): their queues nacked lately.
        owner: the user the schedule is owned by (``Settings.owner``; None: unknown).

    Raises:
        InvalidScheduleError: anything AMQP, RabbitMQ or hopsched cannot carry, naming it.
    """
    if not isinstance(request, ScheduleRequest):
        raise InvalidScheduleError(
            f"{shorten(request)}: must be a ScheduleRequest(message, routing_key, ...)"
        )
    rule = request.rule
    if rule is None:
        due_us = due_time_us(request.at, request.delay, now_us)
        at = request.at
        check_due(due_us, "the due time" if at is None else f"at={at.isoformat()}")
    elif request.at is not None or request.delay is not None:
        raise InvalidScheduleError(
            "a recurring schedule (every= or cron=) takes start= for its first occurrence, "
            "not at= or delay="
        )
    else:
        first = rule.first_us()
        assert first is not None  # Rule.make refuses a rule without one
        due_us = check_due(first, f"the first occurrence ({us_to_datetime(first).isoformat()})")
    exchange, routing_key = request.exchange, request.routing_key
    _check_target(exchange, routing_key, targets)
    schedule_id = check_schedule_id(request.schedule_id)
    body, callers = _body_and_properties(request.message)
    if len(body) > max_body_bytes:
        raise InvalidScheduleError(
            f"the body is {len(body)} bytes, over max_message_size ({max_body_bytes} bytes; "
            "RabbitMQ refuses a larger one by closing the channel): schedule a reference to "
            "the data instead, or raise Settings.max_message_size (HOPSCHED_MAX_MESSAGE_SIZE) "
            "to the broker's own limit"
        )
    check_properties(callers)
    if callers.user_id is not None and callers.user_id != login:
        raise InvalidScheduleError(
            f"user_id={callers.user_id!r}: RabbitMQ accepts only the login user "
            f"({login!r}) here, and the relay must log in as it too "
            "(https://www.rabbitmq.com/docs/validated-user-id)"
        )
    checked = check_headers(callers.headers)  # names what it refuses
    try:
        headers = callers_headers(checked)
    except (TypeError, ValueError) as error:
        raise InvalidScheduleError(f"headers: {error}") from None
    callers.headers = None  # encoded apart, above
    _check_header_size(headers, frame_max)
    plan = ladder.plan(now_us=now_us, due_us=due_us, avoid=avoid)
    envelope = Envelope(
        created_us=now_us,
        schedule_id=schedule_id,
        due_us=due_us,
        exchange=exchange,
        routing_key=routing_key,
        hops=1 if isinstance(plan, Hop) else 0,
        expiration=check_expiration(callers.expiration),
        delivery_mode=None if callers.delivery_mode == PERSISTENT else callers.delivery_mode or 0,
        rule=None if rule is None else rule.encode(),
        occurrence=0 if rule is None else 1,
        user=owner,
    )
    return Checked(body, callers, headers, envelope, *_first_publish(plan, now_us, topology))


def copy_envelope(properties: bytes) -> Envelope:
    """The envelope of a journal's copy of a message (its encoded properties).

    Raises:
        InvalidScheduleError: they do not decode, or hold no valid envelope.
    """
    try:
        return Envelope.from_headers(amqp.Properties.decode(properties).headers)
    except (EnvelopeError, ValueError, TypeError, IndexError, struct.error) as error:
        raise InvalidScheduleError(f"the journal's copy cannot be issued again: {error}") from None


def reissue(
    properties: bytes,
    body: bytes,
    *,
    due_us: int,
    now_us: int,
    created_us: int,
    ladder: Ladder,
    topology: Topology,
    avoid: Collection[int] = (),
) -> Checked:
    """A new copy of a scheduled message, from the journal's copy of it (its first hop's
    encoded ``properties`` and its ``body``): the same id, target, caller's properties
    and headers, due at ``due_us``, created at ``created_us`` (µs since the epoch), its
    first hop planned at ``now_us``. Unsigned: the caller signs it anew.

    Raises:
        InvalidScheduleError: the copy is not a hopsched message (its properties do not
            decode, or its envelope is malformed).
    """
    try:
        decoded = amqp.Properties.decode(properties)
        old = Envelope.from_headers(decoded.headers)
        headers = callers_headers(decoded.headers)
    except (EnvelopeError, ValueError, TypeError, IndexError, struct.error) as error:
        raise InvalidScheduleError(f"the journal's copy cannot be issued again: {error}") from None
    plan = ladder.plan(now_us=now_us, due_us=due_us, avoid=avoid)
    envelope = dataclasses.replace(
        old,
        due_us=due_us,
        created_us=created_us,
        hops=1 if isinstance(plan, Hop) else 0,
        retries=0,
        retry_since_us=None,
        signature=None,
    )
    callers = decoded.replace(headers=None).to_pamqp()
    return Checked(body, callers, headers, envelope, *_first_publish(plan, now_us, topology))


def reroute(
    checked: Checked, *, now_us: int, ladder: Ladder, topology: Topology, avoid: Collection[int]
) -> Checked:
    """``checked`` planned anew at ``now_us`` with the steps in ``avoid`` routed around
    (its step queue nacked it: a quorum leader election). The due time stays; the first
    hop is the largest step that fits now and is not avoided (``Ladder.plan``), so it is
    never early; its hop stamp is now's. Unchanged if the plan is the same queue."""
    plan = ladder.plan(now_us=now_us, due_us=checked.envelope.due_us, avoid=avoid)
    hop_expires_us, exchange, routing_key, queue, step_ms = _first_publish(plan, now_us, topology)
    if queue == checked.queue:
        return checked
    return dataclasses.replace(
        checked,
        envelope=dataclasses.replace(checked.envelope, hops=1 if isinstance(plan, Hop) else 0),
        hop_expires_us=hop_expires_us,
        exchange=exchange,
        routing_key=routing_key,
        queue=queue,
        step_ms=step_ms,
    )


def _first_publish(
    plan: Hop | Hold, now_us: int, topology: Topology
) -> tuple[int | None, str, str, str, int | None]:
    """(hop expiry µs or None, exchange, routing key, queue, step ms or None) of a plan's
    first publish."""
    if isinstance(plan, Hop):  # the stamp lets the relay measure how late the hop comes back
        step_ms = plan.step_ms
        queue = topology.step_queue(step_ms)
        return now_us + step_ms * US_PER_MS, "", queue, queue, step_ms
    return None, topology.expired_exchange, DEAD_LETTER_ROUTING_KEY, topology.relay_queue, None


def encode_properties(checked: Checked, producer: str) -> bytes:
    """The first hop's encoded properties (the content header's property part).

    Raises:
        InvalidScheduleError: a property cannot be encoded (``check_request`` refuses
            what it knows of; this names anything else).
    """
    try:
        return first_hop_properties(
            amqp.Properties.from_pamqp(checked.properties),
            checked.envelope,
            headers=checked.headers,
            hop_expires_us=checked.hop_expires_us,
            producer=producer,
        ).encode()
    except (TypeError, ValueError, ArithmeticError, struct.error) as error:
        raise InvalidScheduleError(f"a property AMQP cannot carry: {error}") from None


def check_properties(properties: Basic.Properties) -> None:
    """Check the basic properties a caller set, headers and ``expiration`` apart
    (``check_headers``, ``check_expiration``).

    * short strings (``content_type``, ``correlation_id``, ``message_id``, ...): a
      ``str`` of at most 255 bytes of UTF-8, without lone surrogates;
    * ``priority``: an int from 0 to 255 (an AMQP octet; a priority queue uses
      0 to its ``x-max-priority``, https://www.rabbitmq.com/docs/priority);
    * ``delivery_mode``: 1 (transient) or 2 (persistent), AMQP's two values;
    * ``timestamp``: an aware datetime or an int of seconds, from 1970-01-01T00:00:00Z
      to 2106-02-07T06:28:15Z (pamqp reads a later one as milliseconds).

    Raises:
        InvalidScheduleError: the property, its value, the rule and the fix.
    """
    for name in SHORT_STRINGS:
        value = getattr(properties, name, None)
        if value is None:
            continue
        label = "type" if name == "message_type" else name
        if not isinstance(value, str):
            raise InvalidScheduleError(
                f"{label}={shorten(value)}: must be a str (an AMQP short string), not "
                f"{type(value).__name__}"
            )
        try:
            size = len(value.encode())
        except UnicodeEncodeError as error:
            raise InvalidScheduleError(
                f"{label} {shorten(value)} holds a lone surrogate at index {error.start}, "
                "which UTF-8 (the encoding of AMQP strings) cannot carry; fix the text"
            ) from None
        if size > 255:
            raise InvalidScheduleError(
                f"{label} {shorten(value)}: AMQP carries at most 255 bytes (UTF-8) there"
            )
    _check_octet("priority", properties.priority, range(256), "0 to 255 (an AMQP octet)")
    _check_octet(
        "delivery_mode", properties.delivery_mode, (1, 2), "1 (transient) or 2 (persistent)"
    )
    _check_timestamp(properties.timestamp)


def _check_octet(name: str, value: object, valid: range | tuple[int, ...], rule: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value not in valid:
        raise InvalidScheduleError(f"{name}={shorten(value)}: must be {rule}")


def _check_timestamp(value: object) -> None:
    if value is None:
        return
    rule = (
        "must be an aware datetime or an int of seconds from 1970-01-01T00:00:00Z to "
        "2106-02-07T06:28:15Z (pamqp reads a later one as milliseconds)"
    )
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidScheduleError(
                f"timestamp={value.isoformat()} is a naive datetime, which would be sent "
                "as UTC whatever zone was meant; make it aware, e.g. "
                "value.replace(tzinfo=timezone.utc)"
            )
        seconds: float = value.timestamp()
    elif isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    else:
        raise InvalidScheduleError(f"timestamp={shorten(value)}: {rule}")
    if not 0 <= seconds < _TIMESTAMP_END:
        raise InvalidScheduleError(f"timestamp={shorten(value)}: {rule}")


def _check_header_size(headers: amqp.Table, frame_max: int) -> None:
    """Refuse, before anything is sent, headers that cannot fit in one frame with the
    envelope (the publish checks the exact size again)."""
    budget = frame_max - FRAME_OVERHEAD - _PROPERTIES_ALLOWANCE
    if headers.encoded_size() > budget:
        raise InvalidScheduleError(
            f"the headers take {headers.encoded_size()} bytes encoded; with the "
            f"envelope they would not fit in one frame ({frame_max} bytes, the "
            "negotiated frame_max): move large values into the body"
        )


def _body_and_properties(
    message: aio_pika.abc.AbstractMessage | bytes,
) -> tuple[bytes, Basic.Properties]:
    """A message's body and pamqp properties (bytes: persistent, nothing else set).

    Raises:
        InvalidScheduleError: neither an aio-pika message nor bytes, a property aio-pika
            cannot encode, a body larger than any broker takes.
    """
    if isinstance(message, (bytes, bytearray)):
        body, properties = message, Basic.Properties(delivery_mode=PERSISTENT)
    else:
        # (an ABC's isinstance is slow: the concrete class first)
        if type(message) is not aio_pika.Message and not isinstance(
            message, aio_pika.abc.AbstractMessage
        ):
            raise InvalidScheduleError(
                f"message {shorten(message)}: must be an aio_pika.Message or bytes"
            )
        expiration = getattr(message, "expiration", None)
        if (
            expiration is not None and not isinstance(expiration, (int, float, timedelta, datetime))
        ) or (isinstance(expiration, float) and not math.isfinite(expiration)):
            raise InvalidScheduleError(
                f"expiration={shorten(expiration)}: aio-pika takes seconds (int or finite "
                "float), a timedelta or a datetime; the final publish carries it as "
                "RabbitMQ's ms string"
            )
        try:
            body, properties = message.body, message.properties
        except (TypeError, ValueError, OverflowError) as error:
            raise InvalidScheduleError(f"a property of the message: {error}") from None
        if not isinstance(body, (bytes, bytearray)):
            raise InvalidScheduleError(f"body {shorten(body)}: must be bytes")
        if not isinstance(properties, Basic.Properties):
            raise InvalidScheduleError(
                f"properties {shorten(properties)}: must be pamqp's Basic.Properties"
            )
    if len(body) > MAX_BODY_BYTES:
        raise InvalidScheduleError(
            f"the body is {len(body)} bytes: no RabbitMQ takes more than {MAX_BODY_BYTES} "
            "(512 MiB, the highest max_message_size); store it elsewhere and schedule a "
            "reference to it"
        )
    return bytes(body), properties


def _check_target(exchange: str, routing_key: str, targets: TargetPolicy) -> None:
    """Refuse a target that is no AMQP name or that ``targets`` does not allow (a check
    of the target's name belongs here)."""
    _check_name("exchange", exchange)
    _check_name("routing_key", routing_key)
    if exchange == "" == routing_key:
        raise InvalidScheduleError(
            "routing_key '': the default exchange routes by queue name and no queue is "
            "named '', so nothing would receive it; give the target queue's name, or an "
            "exchange"
        )
    if refusal := targets.refusal(exchange, routing_key):
        raise InvalidScheduleError(refusal)


def _check_name(name: str, value: object) -> None:
    if type(value) is str and len(value) <= 255 and value.isascii():
        return
    try:
        fits = type(value) is str and len(value.encode()) <= 255
    except UnicodeEncodeError:  # a lone surrogate
        fits = False
    if not fits:
        raise InvalidScheduleError(
            f"{name} {shorten(value)}: must be a str of at most 255 bytes of UTF-8"
        )


def check_known_id(schedule_id: str) -> str:
    """``schedule_id`` of a schedule made before (``get``, ``cancel``, ``reschedule``):
    as ``check_schedule_id``, but None is refused, not made a new random id (a cancel of
    None had cancelled a fresh id and reported it done).

    Raises:
        InvalidScheduleError: as ``check_schedule_id``, and for None.
    """
    if schedule_id is None:
        raise InvalidScheduleError(
            "schedule_id=None: give the id of the schedule (the str schedule() returned "
            "in Scheduled.schedule_id)"
        )
    return check_schedule_id(schedule_id)


def check_schedule_id(schedule_id: str | None) -> str:
    """The schedule id to carry: ``schedule_id``, or a new random one if None.

    Raises:
        InvalidScheduleError: not a non-empty str of printable characters, longer than
            ``MAX_SCHEDULE_ID_BYTES``, or with whitespace at either end.
    """
    if schedule_id is None:
        return os.urandom(16).hex()  # as unique as a uuid4's hex, a fifth of the cost
    if not isinstance(schedule_id, str) or not schedule_id:
        raise InvalidScheduleError(
            f"schedule_id={shorten(schedule_id)}: a schedule id must be a non-empty str"
        )
    # (printable first: a lone surrogate is not, and cannot be encoded)
    if not schedule_id.isprintable() or len(schedule_id.encode()) > MAX_SCHEDULE_ID_BYTES:
        raise InvalidScheduleError(
            f"schedule_id={shorten(schedule_id)}: use at most {MAX_SCHEDULE_ID_BYTES} bytes "
            "of printable characters, e.g. 'order-42-timeout'"
        )
    if schedule_id != schedule_id.strip():
        raise InvalidScheduleError(
            f"schedule_id={shorten(schedule_id)}: has whitespace at either end; strip it"
        )
    return schedule_id
