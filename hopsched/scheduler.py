"""The client: ``await scheduler.schedule(message, at=...)``."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import TracebackType

import aio_pika
from pamqp.commands import Basic

from hopsched.clock import datetime_to_us, now_us, timedelta_to_us, us_to_datetime
from hopsched.connect import connect
from hopsched.envelope import HEADER_HOP_EXPIRES, PERSISTENT, Envelope
from hopsched.errors import InvalidScheduleError
from hopsched.ladder import US_PER_MS, Hop
from hopsched.publisher import ConfirmedPublisher, with_properties
from hopsched.settings import Settings
from hopsched.topology import DEAD_LETTER_ROUTING_KEY, Topology

__all__ = ["Scheduled", "Scheduler"]


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


#: The latest due time: the end of year 9999 UTC, the last instant a datetime holds.
MAX_DUE_US = datetime_to_us(datetime.max.replace(tzinfo=UTC))


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
            f"due time {due_us} µs since the epoch is after year 9999: use a shorter delay"
        )
    # Before 1970 is long past due, like a negative delay: due at the epoch, delivered at
    # once (the envelope carries no negative due time).
    return max(due_us, 0)


def _due_time_us(at: datetime | None, delay: timedelta | float | None, now: int) -> int:
    if (at is None) == (delay is None):
        raise InvalidScheduleError("give exactly one of at= (a datetime) and delay=")
    if at is not None:
        if not isinstance(at, datetime):
            raise InvalidScheduleError(f"at={at!r}: must be a datetime")
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
        raise InvalidScheduleError(f"delay={delay!r}: must be a timedelta or finite seconds")
    # Decimal of the float's shortest repr: exact, where delay * 1e6 could round down.
    return now + max(0, math.ceil(Decimal(repr(delay)) * 1_000_000))


def _shorten(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


class Scheduler:
    """Schedules AMQP messages for delivery at a future instant.

    Use as ``async with Scheduler(settings) as scheduler:``; entering connects and
    declares the topology (idempotent).

    Raises (on enter):
        BrokerUnavailableError: cannot connect or log in (URL shown masked).
        TopologyMismatchError: the prefix's queues exist with other arguments.
    """

    def __init__(
        self, settings: Settings | None = None, *, clock: Callable[[], int] = now_us
    ) -> None:
        self.settings = settings or Settings()
        self.topology = Topology.from_settings(self.settings)
        self._clock = clock
        self._targets = self.settings.target_policy
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._publisher: ConfirmedPublisher | None = None

    async def __aenter__(self) -> Scheduler:
        self._connection = await connect(self.settings)
        try:
            await self.topology.declare(self._connection)
        except BaseException:
            await self._connection.close()
            raise
        self._publisher = ConfirmedPublisher(self._connection)
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
        if self._publisher is not None:
            await self._publisher.close()
            self._publisher = None
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

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
                body bytes (sent persistent).
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
            InvalidScheduleError: (a ValueError) naive datetime, both/neither of
                at/delay, a routing key or exchange longer than 255 bytes, a target
                that ``Settings.allowed_targets`` does not allow.
            PublishRejectedError: the broker refused or nacked the publish.
            RuntimeError: used outside ``async with``.
        """
        if self._publisher is None:
            raise RuntimeError("use the Scheduler inside 'async with Scheduler(...)'")
        now = self._clock()
        due_us = due_time_us(at, delay, now)
        for name, value in (("exchange", exchange), ("routing_key", routing_key)):
            if not isinstance(value, str) or len(value.encode()) > 255:
                raise InvalidScheduleError(
                    f"{name} {_shorten(value)}: must be a str of at most 255 bytes (UTF-8)"
                )
        if refusal := self._targets.refusal(exchange, routing_key):
            raise InvalidScheduleError(refusal)
        if isinstance(message, bytes | bytearray):
            message = aio_pika.Message(bytes(message), delivery_mode=PERSISTENT)
        properties: Basic.Properties = message.properties
        if properties.user_id is not None and properties.user_id != self.settings.login:
            raise InvalidScheduleError(
                f"user_id={properties.user_id!r}: RabbitMQ accepts only the login user "
                f"({self.settings.login!r}) here, and the relay must log in as it too "
                "(https://www.rabbitmq.com/docs/validated-user-id)"
            )
        action = self.settings.ladder.plan(now_us=now, due_us=due_us)
        envelope = Envelope(
            schedule_id=schedule_id or uuid.uuid4().hex,
            due_us=due_us,
            exchange=exchange,
            routing_key=routing_key,
            hops=1 if isinstance(action, Hop) else 0,
            expiration=properties.expiration,
            delivery_mode=None
            if properties.delivery_mode == PERSISTENT
            else properties.delivery_mode or 0,
        )
        headers = {**(properties.headers or {}), **envelope.to_headers()}
        headers.pop(HEADER_HOP_EXPIRES, None)  # the caller's own would skew the relay's margin
        if isinstance(action, Hop):  # lets the relay measure how late the hop comes back
            headers[HEADER_HOP_EXPIRES] = now + action.step_ms * US_PER_MS
        properties = with_properties(
            properties,
            # Left unset, AMQP clients fill message_id with a random id; the schedule id
            # is as unique and lets consumers de-duplicate on either.
            message_id=properties.message_id or envelope.schedule_id,
            headers=headers,
            expiration=None,
            delivery_mode=PERSISTENT,
        )
        if isinstance(action, Hop):
            queue = self.topology.step_queue(action.step_ms)
            await self._publisher.publish(message.body, properties, exchange="", routing_key=queue)
        else:
            queue = self.topology.relay_queue
            await self._publisher.publish(
                message.body,
                properties,
                exchange=self.topology.expired_exchange,
                routing_key=DEAD_LETTER_ROUTING_KEY,
            )
        return Scheduled(envelope.schedule_id, due_us, queue)
