"""The client: ``await scheduler.schedule(message, at=...)``."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from types import TracebackType
from typing import Any

import aio_pika
from pamqp.commands import Basic

from hopsched import amqp
from hopsched.amqp.wire import FRAME_OVERHEAD
from hopsched.cancel import CANCEL, RESCHEDULE, Record, encode_records
from hopsched.clock import MAX_DUE_US, datetime_to_us, now_us, timedelta_to_us, us_to_datetime
from hopsched.connect import Connector
from hopsched.envelope import PERSISTENT, Envelope, callers_headers, first_hop_properties
from hopsched.errors import (
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
    HopschedError,
    InvalidScheduleError,
    PublishRejectedError,
    PublishTimeoutError,
    TargetRefused,
    Unroutable,
)
from hopsched.ladder import US_PER_MS, Hop
from hopsched.publisher import LADDER_LANE, Publisher
from hopsched.settings import Settings
from hopsched.topology import DEAD_LETTER_ROUTING_KEY, Topology, declare_topology
from hopsched.validate import check_expiration, check_headers, shorten

__all__ = [
    "CANCEL_LEAD_S",
    "MAX_SCHEDULE_ID_BYTES",
    "Cancelled",
    "ScheduleRequest",
    "Scheduled",
    "Scheduler",
]

#: A cancel confirmed this long before a message's due time (s) is never delivered:
#: the time for every healthy relay to read it from ``{prefix}.cancelled`` before it
#: publishes the message (measured: ``tests/test_cancel.py``, ``benchmarks``).
CANCEL_LEAD_S = 0.05
#: Records per stream message of ``cancel_many``.
_RECORDS_PER_MESSAGE = 1000

#: The longest schedule id, bytes of UTF-8 (it is also the default ``message_id``, an
#: AMQP short string).
MAX_SCHEDULE_ID_BYTES = 255


@dataclass(frozen=True, slots=True)
class Scheduled:
    """What ``schedule()`` returns.

    Attributes:
        schedule_id: the id carried in header ``x-hopsched-id`` on every hop and on
            delivery; consumers de-duplicate on it.
        due: the due time, an aware UTC datetime.
        due_us: the due time, integer microseconds since the Unix epoch.
        first_queue: the queue the message was published to (a step or the relay).
    """

    schedule_id: str
    due_us: int
    first_queue: str

    @property
    def due(self) -> datetime:
        return us_to_datetime(self.due_us)


@dataclass(frozen=True, slots=True)
class Cancelled:
    """What ``cancel()`` says of one schedule id.

    Attributes:
        schedule_id: the id cancelled.
        in_time: True if the cancel was confirmed at least ``CANCEL_LEAD_S`` before the
            due time given with it: nothing will be delivered. False if later: the
            message may have been delivered (or be on its way). None if no due time was
            given: it cannot be told. Cancelling an id nothing is scheduled for, or a
            message already delivered, is not an error.
    """

    schedule_id: str
    in_time: bool | None


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """One message for ``schedule_many()``: the arguments of ``schedule()``."""

    message: aio_pika.abc.AbstractMessage | bytes
    routing_key: str
    at: datetime | None = None
    delay: timedelta | float | None = None
    exchange: str = ""
    schedule_id: str | None = None


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
    # Before 1970 is long past due, like a negative delay: due at the epoch, delivered at
    # once (the envelope carries no negative due time).
    return max(due_us, 0)


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


@dataclass(slots=True)
class _Checked:
    """A ``schedule()`` call found valid, not yet encoded."""

    body: bytes
    properties: Basic.Properties  # the caller's, headers apart
    headers: amqp.Table  # the caller's, checked and encoded
    envelope: Envelope
    hop_expires_us: int | None
    exchange: str
    routing_key: str
    queue: str


@dataclass(slots=True)
class _Prepared:
    """A checked ``schedule()`` call, ready to publish."""

    body: bytes
    properties: bytes
    exchange: str
    routing_key: str
    queue: str
    scheduled: Scheduled
    redeclared: bool = field(default=False)
    nacks: int = field(default=0)  # times the broker nacked it so far


#: Basic properties that are AMQP short strings (at most 255 bytes).
_SHORT_STRINGS = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "message_id",
    "message_type",
    "user_id",
    "app_id",
)
#: Room a content header needs beside the caller's headers: the envelope's entries and
#: every other property at its longest, bytes.
_PROPERTIES_ALLOWANCE = 6 * 1024
#: The broker's reply to a body over its ``max_message_size`` (RabbitMQ 3.10 to 4.x).
_TOO_LARGE = re.compile(r"message size (\d+) is larger than configured max size (\d+)")

#: ``schedule_many`` encodes and publishes this many, then lets the event loop send
#: them and read confirms while it goes on (the broker works meanwhile).
_SLICE = 500
log = logging.getLogger("hopsched.scheduler")
#: Waits before publishing again what the broker nacked, s: doubling from the first to
#: the most, until ``Settings.publish_timeout_s``.
_NACK_FIRST_WAIT_S, _NACK_MAX_WAIT_S = 0.1, 2.0


class Scheduler:
    """Schedules AMQP messages for delivery at a future instant.

    Use as ``async with Scheduler(settings) as scheduler:``: entering connects and
    declares the topology (idempotent). It reconnects by itself: a call made while
    the broker is down raises ``BrokerUnavailableError`` at once, and the next one after
    the broker is back works. ``close()`` releases the connection; a Scheduler used
    again after it connects anew.

    With several node URLs it connects to one (``first_url``: the index of the first to
    try, default random) and, after losing it, to the next that answers: a call made
    as the node goes may raise ``BrokerUnavailableError``; the next one fails over. A
    publish the broker nacks (a quorum leader election) is sent again until
    ``Settings.publish_timeout_s``.

    Raises (on enter):
        BrokerUnavailableError: cannot connect or log in (URL shown masked).
        TopologyMismatchError: the prefix's queues exist with other arguments.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        clock: Callable[[], int] = now_us,
        first_url: int | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.topology = Topology.from_settings(self.settings)
        self.producer = f"{socket.gethostname()}/{os.getpid()}"
        self._ladder = self.settings.ladder
        self._clock = clock
        self._targets = self.settings.target_policy
        self._connector = Connector(self.settings, name="hopsched-scheduler", start=first_url)
        self._publisher: Publisher | None = None
        self._connecting: asyncio.Future[Publisher] | None = None
        self._declared = False
        self._stream_declared = False

    @property
    def node(self) -> str | None:
        """``host:port`` of the node the Scheduler is connected to, None if none."""
        publisher = self._publisher
        if publisher is None or not publisher.connection.is_open:
            return None
        return self._connector.node

    async def __aenter__(self) -> Scheduler:
        await self._connected()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (publishes already confirmed are safe on the broker)."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await publisher.close()
            await publisher.connection.close()

    async def _connected(self) -> Publisher:
        """The open connection's publisher; connects first if there is none.

        Raises:
            BrokerUnavailableError, TopologyMismatchError, AccessRefusedError.
        """
        publisher = self._publisher
        if publisher is not None and publisher.connection.is_open:
            return publisher
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected_or_not)
        return await asyncio.shield(self._connecting)

    def _connected_or_not(self, attempt: asyncio.Future[Publisher]) -> None:
        self._connecting = None
        if not attempt.cancelled() and attempt.exception() is None:
            self._publisher = attempt.result()

    async def _connect(self) -> Publisher:
        connection = await self._connector.connect()
        if not self._declared:
            # not the cancellation stream: scheduling must not wait on it (cancel declares it)
            try:
                await self._declare(self.topology.queues_but_stream())
            except BaseException:
                await connection.close()
                raise
            self._declared = True
        return Publisher(connection)

    async def _declare(self, names: Iterable[str]) -> None:
        """Declare ``names`` on the node this scheduler is on, if it answers."""
        await declare_topology(self.settings, names, first=self._connector.url)

    async def schedule(
        self,
        message: aio_pika.abc.AbstractMessage | bytes,
        *,
        at: datetime | None = None,
        delay: timedelta | float | None = None,
        exchange: str = "",
        routing_key: str,
        schedule_id: str | None = None,
    ) -> Scheduled:
        """Deliver ``message`` to ``exchange`` with ``routing_key`` at ``at`` or after ``delay``.

        Args:
            message: an ``aio_pika.Message`` (body, every property and header are
                delivered as given; an unset ``message_id`` becomes the schedule id) or
                body bytes (sent persistent). Header values: any AMQP field type;
                ``bytes`` travel as AMQP byte arrays (a pamqp or aio-pika consumer reads
                a ``bytearray`` of the same bytes).
            at: due time, a timezone-aware datetime (any zone).
            delay: or a delay: a timedelta or seconds (int or float); fractions of a
                microsecond round up. Zero or negative means "now".
            exchange: target exchange at due time; "" is the default exchange.
            routing_key: target routing key (for "": the queue name).
            schedule_id: the id to carry; a new UUID by default.

        Returns:
            ``Scheduled`` with the schedule id and the due time, once the broker has
            confirmed the message (it is then safe from a crash of this process).

        Raises:
            InvalidScheduleError: (a ValueError; nothing was sent) naive datetime,
                both/neither of at/delay, a routing key or exchange longer than 255
                bytes, a target ``Settings.allowed_targets`` does not allow, a header or
                ``expiration`` AMQP or RabbitMQ cannot carry, headers too large for one
                frame, a ``user_id`` other than the login.
            BrokerUnavailableError: no broker answers; ``BrokerConnectionLost`` (a
                subclass) if the connection went during the call.
            PublishTimeoutError: no confirm within ``Settings.publish_timeout_s``.
            PublishRejectedError: the broker refused the message (``TargetRefused``,
                ``Unroutable`` are subclasses).

        A call that raised ``PublishTimeoutError`` or ``BrokerConnectionLost``, or that
        was cancelled, may still be delivered: the broker may have taken the message.
        Schedule it again with the same ``schedule_id`` and de-duplicate on
        ``x-hopsched-id``.
        """
        checked = self._check(
            ScheduleRequest(message, routing_key, at, delay, exchange, schedule_id)
        )
        result = (await self._send([checked]))[0]
        if isinstance(result, BaseException):
            raise result
        return result

    async def schedule_many(
        self, requests: Iterable[ScheduleRequest], *, return_exceptions: bool = False
    ) -> list[Scheduled | HopschedError]:
        """Schedule many messages with their confirms in flight together.

        Every request is checked before anything is sent (``InvalidScheduleError``
        names the first bad one by its index). Then all are published at once and
        their confirms awaited within ``Settings.publish_timeout_s``.

        Returns:
            ``Scheduled`` for each request, in order; with ``return_exceptions`` a
            failed one gives its error in its place instead of raising it.

        Raises:
            As ``schedule()``: without ``return_exceptions``, the first failure once all
            are settled (the others may have been scheduled: see their ids in
            ``error.__notes__``).
        """
        checked = []
        for index, request in enumerate(requests):
            try:
                checked.append(self._check(request))
            except InvalidScheduleError as error:
                raise InvalidScheduleError(f"request {index}: {error}") from None
        results = await self._send(checked)
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    done = [r.schedule_id for r in results if isinstance(r, Scheduled)]
                    result.add_note(f"scheduled nonetheless: {len(done)} of {len(results)}")
                    raise result
        return results

    async def cancel(self, schedule: str | Scheduled, *, due: datetime | None = None) -> Cancelled:
        """Cancel a schedule: its messages scheduled before now are not delivered.

        Args:
            schedule: the schedule id, or what ``schedule()`` returned (which gives the
                due time too).
            due: the due time, if known: ``Cancelled.in_time`` then says whether the
                cancel came in time.

        Returns:
            ``Cancelled``, once the broker has confirmed the cancel (it then survives
            relay and broker restarts). A cancel confirmed at least ``CANCEL_LEAD_S``
            (50 ms) before the due time is never delivered; a later one races with the
            delivery.

        Raises:
            As ``schedule()``: InvalidScheduleError, BrokerUnavailableError,
            PublishTimeoutError, PublishRejectedError.
        """
        return (await self.cancel_many([schedule], due=due))[0]

    async def cancel_many(
        self, schedules: Iterable[str | Scheduled], *, due: datetime | None = None
    ) -> list[Cancelled]:
        """``cancel()`` for many schedules, in one confirmed write per thousand."""
        now = self._clock()
        records, results = [], []
        for schedule in schedules:
            schedule_id, due_us = self._identify(schedule, due)
            records.append(Record(CANCEL, schedule_id, now, due_us))
        await self._write_records(records)
        confirmed = self._clock()
        for record in records:
            in_time = (
                None
                if record.due_us is None
                else record.due_us - confirmed >= CANCEL_LEAD_S * 1_000_000
            )
            results.append(Cancelled(record.schedule_id, in_time))
        return results

    async def reschedule(
        self,
        schedule: str | Scheduled,
        *,
        at: datetime | None = None,
        delay: timedelta | float | None = None,
    ) -> Scheduled:
        """Move a schedule's messages (those scheduled before now) to a new due time,
        without sending them again.

        A later time holds in every case. An earlier one takes effect at the message's
        next visit to a relay: at once if a relay holds it (the last
        ``Settings.hold_window_ms``), else when its current hop returns (a hop of step
        *s* returns within *s*; the largest is about 49.7 days): it is delivered at the
        new time or at that visit, whichever is later.

        Returns:
            ``Scheduled`` with the new due time, once the broker has confirmed it.

        Raises:
            As ``schedule()``.
        """
        now = self._clock()
        schedule_id, _ = self._identify(schedule, None)
        due_us = due_time_us(at, delay, now)
        await self._write_records([Record(RESCHEDULE, schedule_id, now, due_us)])
        return Scheduled(schedule_id, due_us, self.topology.cancel_stream)

    def _identify(self, schedule: str | Scheduled, due: datetime | None) -> tuple[str, int | None]:
        if isinstance(schedule, Scheduled):
            return schedule.schedule_id, schedule.due_us
        schedule_id = _check_schedule_id(schedule)
        if due is None:
            return schedule_id, None
        return schedule_id, due_time_us(due, None, 0)

    async def _write_records(self, records: list[Record]) -> None:
        """Append records to ``{prefix}.cancelled``, confirmed.

        Raises:
            As ``schedule()``.
        """
        stream = self.topology.cancel_stream
        if not self._stream_declared:
            await self._declare([stream])
            self._stream_declared = True
        properties = amqp.Properties(content_type="application/x-ndjson", delivery_mode=2)
        writes = [
            _Prepared(
                encode_records(records[start : start + _RECORDS_PER_MESSAGE]),
                properties.encode(),
                "",
                stream,
                stream,
                Scheduled("", 0, stream),
            )
            for start in range(0, len(records), _RECORDS_PER_MESSAGE)
        ]
        for result in await self._send(writes):
            if isinstance(result, BaseException):
                raise result

    def _check(self, request: ScheduleRequest) -> _Checked:
        """Check a call, or raise InvalidScheduleError."""
        now = self._clock()
        due_us = due_time_us(request.at, request.delay, now)
        exchange, routing_key = request.exchange, request.routing_key
        _check_name("exchange", exchange)
        _check_name("routing_key", routing_key)
        if refusal := self._targets.refusal(exchange, routing_key):
            raise InvalidScheduleError(refusal)
        schedule_id = _check_schedule_id(request.schedule_id)
        body, callers = _body_and_properties(request.message)
        if len(body) > self.settings.max_message_size:
            raise InvalidScheduleError(
                f"the body is {len(body)} bytes, over max_message_size "
                f"({self.settings.max_message_size} bytes; RabbitMQ 4.x refuses a larger "
                "one by closing the channel): schedule a reference to the data instead, or "
                "raise Settings.max_message_size to the broker's own limit"
            )
        if callers.user_id is not None and callers.user_id != self.settings.login:
            raise InvalidScheduleError(
                f"user_id={callers.user_id!r}: RabbitMQ accepts only the login user "
                f"({self.settings.login!r}) here, and the relay must log in as it too "
                "(https://www.rabbitmq.com/docs/validated-user-id)"
            )
        checked = check_headers(callers.headers)  # names what it refuses
        try:
            headers = callers_headers(checked)
        except (TypeError, ValueError) as error:
            raise InvalidScheduleError(f"headers: {error}") from None
        callers.headers = None  # encoded apart, above
        self._check_sizes(callers, headers)
        plan = self._ladder.plan(now_us=now, due_us=due_us)
        envelope = Envelope(
            created_us=now,
            schedule_id=schedule_id,
            due_us=due_us,
            exchange=exchange,
            routing_key=routing_key,
            hops=1 if isinstance(plan, Hop) else 0,
            expiration=check_expiration(callers.expiration),
            delivery_mode=None
            if callers.delivery_mode == PERSISTENT
            else callers.delivery_mode or 0,
        )
        if isinstance(plan, Hop):  # lets the relay measure how late the hop comes back
            hop_expires: int | None = now + plan.step_ms * US_PER_MS
            queue = self.topology.step_queue(plan.step_ms)
            target = ("", queue)
        else:
            hop_expires = None
            queue = self.topology.relay_queue
            target = (self.topology.expired_exchange, DEAD_LETTER_ROUTING_KEY)
        return _Checked(body, callers, headers, envelope, hop_expires, *target, queue)

    def _check_sizes(self, properties: Basic.Properties, headers: amqp.Table) -> None:
        """Refuse, before anything is sent, a property longer than an AMQP short string
        or headers that cannot fit in one frame with the envelope (the publish checks
        the exact size again)."""
        for name in _SHORT_STRINGS:
            value = getattr(properties, name, None)
            if isinstance(value, str) and len(value.encode()) > 255:
                raise InvalidScheduleError(
                    f"{name} {shorten(value)}: AMQP carries at most 255 bytes (UTF-8) there"
                )
        publisher = self._publisher
        frame_max = publisher.connection.frame_max if publisher is not None else 131_072
        budget = frame_max - FRAME_OVERHEAD - _PROPERTIES_ALLOWANCE
        if headers.encoded_size() > budget:
            raise InvalidScheduleError(
                f"the headers take {headers.encoded_size()} bytes encoded; with the "
                f"envelope they would not fit in one frame ({frame_max} bytes, the "
                "negotiated frame_max): move large values into the body"
            )

    def _build(self, checked: _Checked) -> _Prepared:
        """Encode a checked call's publish, or raise InvalidScheduleError."""
        envelope = checked.envelope
        try:
            properties = first_hop_properties(
                amqp.Properties.from_pamqp(checked.properties),
                envelope,
                headers=checked.headers,
                hop_expires_us=checked.hop_expires_us,
                producer=self.producer,
            ).encode()
        except (TypeError, ValueError) as error:
            raise InvalidScheduleError(f"a property AMQP cannot carry: {error}") from None
        return _Prepared(
            checked.body,
            properties,
            checked.exchange,
            checked.routing_key,
            checked.queue,
            Scheduled(envelope.schedule_id, envelope.due_us, checked.queue),
        )

    async def _send(
        self, checked: Sequence[_Checked | _Prepared]
    ) -> list[Scheduled | HopschedError]:
        """Publish every checked call (encoding it in slices), confirms in flight
        together; the results (or errors) in order."""
        prepared: list[_Checked | _Prepared] = list(checked)
        timeout_s = self.settings.publish_timeout_s
        results: list[Scheduled | HopschedError | None] = [None] * len(prepared)
        try:
            async with asyncio.timeout(timeout_s):
                todo = list(range(len(prepared)))
                while todo:  # a second round for first queues declared again
                    todo = await self._round(prepared, todo, results)
        except TimeoutError:
            unsettled = [i for i, result in enumerate(results) if result is None]
            nacked = [i for i in unsettled if _nacked(prepared[i])]
            if not unsettled or len(nacked) < len(unsettled):
                raise self._timed_out(timeout_s) from None
            for index in nacked:  # nacked until the deadline: refused, not unanswered
                results[index] = self._failure(prepared[index].queue, amqp.Outcome.NACK, None)
        return [result for result in results if result is not None]

    async def _round(
        self,
        prepared: list[_Checked | _Prepared],
        todo: list[int],
        results: list[Scheduled | HopschedError | None],
    ) -> list[int]:
        """Publish ``prepared[i]`` for each ``i`` in ``todo`` and wait for every outcome;
        fills ``results``; returns the ones to publish again (their first queue was
        missing and is declared again)."""
        loop = asyncio.get_running_loop()
        outcomes: dict[int, tuple[amqp.Outcome, Any]] = {}
        settled = loop.create_future()

        def settle(index: int, outcome: amqp.Outcome, detail: Any) -> None:
            outcomes[index] = (outcome, detail)
            if len(outcomes) == len(todo) and not settled.done():
                settled.set_result(None)

        publisher = self._publisher
        if publisher is None or not publisher.connection.is_open:
            publisher = await self._connected()
        for count, index in enumerate(todo, 1):
            if count % _SLICE == 0:  # let this slice leave while the next is encoded
                await asyncio.sleep(0)
            item = prepared[index]
            if isinstance(item, _Checked):
                try:
                    item = prepared[index] = self._build(item)
                except InvalidScheduleError as error:
                    settle(index, amqp.Outcome.CLOSED, error)
                    continue
            try:
                publisher.publish(
                    LADDER_LANE,
                    item.exchange,
                    item.routing_key,
                    item.body,
                    item.properties,
                    functools.partial(settle, index),
                )
            except ValueError as error:  # headers too large for one frame; nothing sent
                settle(index, amqp.Outcome.CLOSED, InvalidScheduleError(str(error)))
            except BrokerConnectionLost:  # nothing sent: on a new connection
                self._publisher = None
                publisher = await self._connected()
                publisher.publish(
                    LADDER_LANE,
                    item.exchange,
                    item.routing_key,
                    item.body,
                    item.properties,
                    functools.partial(settle, index),
                )
        await settled
        again: list[int] = []
        redeclare: set[str] = set()
        nacks = 0
        for index, (outcome, detail) in outcomes.items():
            item = prepared[index]
            assert isinstance(item, _Prepared) or outcome is amqp.Outcome.CLOSED
            if not isinstance(item, _Prepared):
                results[index] = self._failure(item.queue, outcome, detail)
            elif outcome is amqp.Outcome.ACK:
                results[index] = item.scheduled
            elif outcome is amqp.Outcome.RETURNED and not item.redeclared:
                item.redeclared = True  # the first queue is gone: declare it again
                redeclare.add(item.queue)
                again.append(index)
            elif outcome is amqp.Outcome.NACK:
                # Our own step queue refused it: on a cluster, a quorum leader election
                # (a node went down), over in seconds. Try again until publish_timeout_s.
                item.nacks += 1
                nacks = max(nacks, item.nacks)
                again.append(index)
            else:
                results[index] = self._failure(item.queue, outcome, detail)
        for queue in redeclare:
            await self._declare([queue])
        if nacks:
            if nacks == 1:
                log.warning("the broker nacked a publish; trying again until publish_timeout_s")
            await asyncio.sleep(min(_NACK_FIRST_WAIT_S * 2 ** (nacks - 1), _NACK_MAX_WAIT_S))
        return again

    def _timed_out(self, timeout_s: float) -> PublishTimeoutError:
        publisher = self._publisher
        why = "the broker did not answer"
        if publisher is not None and publisher.connection.blocked:
            why = f"the broker blocks publishing ({publisher.connection.blocked})"
        return PublishTimeoutError(
            f"{self.settings.masked_url}: no publisher confirm within {timeout_s:g} s: {why}. "
            "The message may still be delivered (de-duplicate on x-hopsched-id); "
            "Settings.publish_timeout_s sets the deadline"
        )

    def _failure(self, queue: str, outcome: amqp.Outcome, detail: Any) -> HopschedError:
        if isinstance(detail, InvalidScheduleError):
            return detail
        if outcome is amqp.Outcome.RETURNED:
            return Unroutable(f"{queue} does not take the message ({detail}) even once declared")
        if outcome is amqp.Outcome.NACK:
            return PublishRejectedError(
                f"the broker nacked the publish to {queue} (a full queue with "
                "x-overflow=reject-publish, or an unavailable one)"
            )
        if isinstance(detail, ChannelClosedError):
            if too_large := _TOO_LARGE.search(str(detail)):
                return InvalidScheduleError(
                    f"the broker refused the message: its body ({too_large[1]} bytes) is "
                    f"larger than the broker's max_message_size ({too_large[2]} bytes); "
                    "nothing was scheduled. Schedule a reference to the data instead; "
                    f"Settings.max_message_size={too_large[2]} refuses such a body before "
                    f"sending ({detail})"
                )
            return TargetRefused(f"the broker refused the message: {detail}")
        if isinstance(detail, BrokerUnavailableError):
            self._publisher = None
            return BrokerConnectionLost(
                f"{detail}; the message may or may not have been scheduled: schedule it "
                "again with the same schedule_id"
            )
        return PublishRejectedError(f"{outcome.value}: {detail}")


def _nacked(item: _Checked | _Prepared) -> bool:
    return isinstance(item, _Prepared) and item.nacks > 0


def _body_and_properties(
    message: aio_pika.abc.AbstractMessage | bytes,
) -> tuple[bytes, Basic.Properties]:
    """A message's body and pamqp properties (bytes: persistent, nothing else set).

    Raises:
        InvalidScheduleError: neither an aio-pika message nor bytes, or a property
            aio-pika cannot encode.
    """
    if isinstance(message, (bytes, bytearray)):
        return bytes(message), Basic.Properties(delivery_mode=PERSISTENT)
    # (an ABC's isinstance is slow: the concrete class first)
    if type(message) is not aio_pika.Message and not isinstance(
        message, aio_pika.abc.AbstractMessage
    ):
        raise InvalidScheduleError(
            f"message {shorten(message)}: must be an aio_pika.Message or bytes"
        )
    expiration = getattr(message, "expiration", None)
    if expiration is not None and not isinstance(expiration, (int, float, timedelta, datetime)):
        raise InvalidScheduleError(
            f"expiration={shorten(expiration)}: aio-pika takes seconds (int or float), a "
            "timedelta or a datetime; the final publish carries it as RabbitMQ's ms string"
        )
    try:
        return message.body, message.properties
    except (TypeError, ValueError) as error:
        raise InvalidScheduleError(f"a property of the message: {error}") from None


def _check_name(name: str, value: object) -> None:
    if type(value) is not str or (len(value) > 63 and len(value.encode()) > 255):
        raise InvalidScheduleError(
            f"{name} {shorten(value)}: must be a str of at most 255 bytes (UTF-8)"
        )


def _check_schedule_id(schedule_id: str | None) -> str:
    if schedule_id is None:
        return os.urandom(16).hex()  # as unique as a uuid4's hex, a fifth of the cost
    if not isinstance(schedule_id, str) or not schedule_id:
        raise InvalidScheduleError(f"schedule_id={shorten(schedule_id)}: must be a non-empty str")
    if len(schedule_id.encode()) > MAX_SCHEDULE_ID_BYTES or not schedule_id.isprintable():
        raise InvalidScheduleError(
            f"schedule_id={shorten(schedule_id)}: use at most {MAX_SCHEDULE_ID_BYTES} bytes "
            "of printable characters, e.g. 'order-42-timeout'"
        )
    if schedule_id != schedule_id.strip():
        raise InvalidScheduleError(
            f"schedule_id={shorten(schedule_id)}: has whitespace at either end; strip it"
        )
    return schedule_id
