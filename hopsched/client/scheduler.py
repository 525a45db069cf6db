"""The client: ``await scheduler.schedule(message, at=...)``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType

import aio_pika
from pamqp import commands

from hopsched import amqp
from hopsched.amqp.publisher import Publisher
from hopsched.broker.objects import declare_topology
from hopsched.broker.policies import PolicyReport
from hopsched.broker.policy_watch import warn_on_risk
from hopsched.client.prepare import (
    Checked,
    ScheduleRequest,
    check_due,
    check_known_id,
    check_request,
    copy_envelope,
    due_time_us,
    reissue,
)
from hopsched.client.routes import check_route
from hopsched.client.sending import Prepared, Scheduled, Sender
from hopsched.connect import Connector
from hopsched.core.cancel import CANCEL, RESCHEDULE, Record, encode_records
from hopsched.core.clock import now_us
from hopsched.core.ladder import US_PER_MS, AvoidedSteps
from hopsched.core.recurring import Recurrence, Rule
from hopsched.core.signing import Refusal
from hopsched.core.validate import shorten
from hopsched.errors import (
    AccessRefusedError,
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
    HopschedError,
    InvalidScheduleError,
)
from hopsched.journal.lookups import MAX_IDS, LookupAsker
from hopsched.journal.records import (
    CANCELLED,
    HELD,
    PENDING,
    SCHEDULED,
    Copy,
    JournalRecord,
    ScheduleInfo,
    cancel_copy_record,
    cancel_owner,
)
from hopsched.journal.retry import JournalRetry
from hopsched.journal.stream import JournalWriter, read_journal
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = [
    "CANCEL_LEAD_S",
    "Cancelled",
    "Scheduled",
    "Scheduler",
]

#: A cancel confirmed this long before a message's due time (s) is never delivered:
#: the time for every healthy relay to read it from ``{prefix}.cancelled`` before it
#: publishes the message (measured: ``tests/broker/test_cancel.py``, ``benchmarks``).
CANCEL_LEAD_S = 0.05
#: Records per stream message of ``cancel_many``.
_RECORDS_PER_MESSAGE = 1000
#: ``close()``'s last try at writing the journal records kept after a failed write, s
#: (at most ``Settings.publish_timeout_s``).
CLOSE_JOURNAL_S = 5.0


log = logging.getLogger("hopsched.scheduler")


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


def _require_flags(**flags: object) -> None:
    """Raise InvalidScheduleError for a flag that is not a bool: ``check_target="no"``
    is truthy, and would do the opposite of what it says."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidScheduleError(f"{name}={shorten(value)}: must be True or False")


class Scheduler:
    """Schedules AMQP messages for delivery at a future instant.

    Use as ``async with Scheduler(settings) as scheduler:``: entering connects and
    checks that the prefix exists (its relay queue: a relay or ``hopsched declare`` ran
    with it), declaring again any of its queues that went missing. A prefix that does
    not exist (a mistyped one) is refused with ``PrefixNotDeclaredError``, as a message
    scheduled there would wait for ever; ``declare=True`` declares it instead. It
    reconnects by itself: a call made while the broker is down raises
    ``BrokerUnavailableError`` at once, and the next one after the broker is back
    works. ``close()`` releases the connection; a Scheduler used again after it
    connects anew.

    With several node URLs it connects to one (``first_url``: the index of the first to
    try, default random) and, after losing it, to the next that answers: a call made
    as the node goes may raise ``BrokerUnavailableError``; the next one fails over. A
    publish a step queue nacks (a quorum leader election, after a node went down) is
    sent again at once by a smaller step (never early: it ends sooner, and the relay
    hops it on), and that step is avoided for ``AVOID_FOR_US`` (5 s) after its last
    nack; a nack with no smaller step to go by (or from the relay queue) is sent again
    with back-off until ``Settings.publish_timeout_s``.

    Args:
        settings: the broker, prefix and ladder.
        clock: µs since the Unix epoch (tests pass a fake one).
        first_url: see above.
        declare: declare the prefix's topology if it does not exist (as a relay and
            ``hopsched declare`` do), rather than refuse it.
        management_url: the management API's base URL(s), comma-separated, for
            ``check_target`` (default ``http://HOST:15672/`` for each URL's host).

    Raises (on enter):
        BrokerUnavailableError: cannot connect or log in (URL shown masked).
        PrefixNotDeclaredError: without ``declare``, the prefix has no relay queue.
        TopologyMismatchError: the prefix's queues exist with other arguments.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        clock: Callable[[], int] = now_us,
        first_url: int | None = None,
        declare: bool = False,
        management_url: str | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.declare = declare
        self._management_url = management_url
        self.topology = Topology.from_settings(self.settings)
        self.producer = f"{socket.gethostname()}/{os.getpid()}"
        self._ladder = self.settings.ladder
        self._clock = clock
        self._targets = self.settings.target_policy
        self._signatures = self.settings.signatures
        #: Steps whose queues nacked lately (a leader election): routed around a while.
        self._avoided = AvoidedSteps()
        self._connector = Connector(self.settings, name="hopsched-scheduler", start=first_url)
        self._publisher: Publisher | None = None
        self._login = self.settings.login  # parsed from the URL once, not per call
        self._owner = self.settings.owner
        self._journal_writer: JournalWriter | None = None
        self._asker: LookupAsker | None = None  # on the journal's connection, once asked
        self._journal_connecting = asyncio.Lock()
        self._connecting: asyncio.Future[Publisher] | None = None
        self._declared = False
        self._streams_declared: set[str] = set()
        #: Journal writes (``{prefix}.journal``, a stream message of up to 1,000
        #: records each) that failed, first tries and later ones alike. The messages
        #: they told of are scheduled all the same; their records are kept and written
        #: again (``journal_backlog``), and ``get()`` knows them once one is taken.
        self.journal_failures = 0
        self._journal_retry = JournalRetry(
            self._journal_write, self.topology.journal_stream, self.settings.publish_timeout_s
        )
        self._policy_check: asyncio.Task[None] | None = None
        #: What the policies in force do to the prefix's queues, as last read from the
        #: management API (every 5 min; None before, or without the API); a finding that
        #: can lose or stall messages is also logged as a WARNING.
        self.policy_report: PolicyReport | None = None
        self._sender = Sender(
            self.settings,
            self.topology,
            producer=self.producer,
            clock=clock,
            avoided=self._avoided,
            publisher=self._connected,
            lost=self._forget_publisher,
            redeclare=self._declare,
        )

    @property
    def node(self) -> str | None:
        """``host:port`` of the node the Scheduler is connected to, None if none."""
        publisher = self._publisher
        if publisher is None or not publisher.connection.is_open:
            return None
        return self._connector.node

    @property
    def journal_backlog(self) -> int:
        """Journal records whose write failed, waiting to be written again (``get()`` and
        ``pending()`` do not know their schedules until then)."""
        return self._journal_retry.backlog

    @property
    def journal_dropped(self) -> int:
        """Journal records given up: the oldest dropped from a full backlog
        (``MAX_BACKLOG_RECORDS``, ``MAX_BACKLOG_BYTES`` of message copies), and those
        ``close()`` could not write. Their messages are delivered all the same;
        ``get()`` and ``pending()`` do not know them."""
        return self._journal_retry.dropped

    @property
    def journal_rewritten(self) -> int:
        """Records written on a later try, after a write of them had failed or was cut
        short (a cancelled ``schedule()``)."""
        return self._journal_retry.rewritten

    async def __aenter__(self) -> Scheduler:
        try:
            await self._connected()
        except BaseException:  # Ctrl-C mid-connect: end the connect here, not at shutdown
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (publishes already confirmed are safe on the broker).

        Journal records still waiting to be written again (``journal_backlog``) get one
        last try, within ``CLOSE_JOURNAL_S`` (5 s); those it cannot write are given up
        (``journal_dropped``, logged)."""
        await self._journal_retry.stop()  # its records in flight go back to the backlog
        check, self._policy_check = self._policy_check, None
        if check is not None:
            check.cancel()
        connecting, self._connecting = self._connecting, None
        if connecting is not None:  # a connect still under way (Ctrl-C mid-connect): end it
            connecting.cancel()  # here, its outcome retrieved: never left failing unawaited
            await asyncio.wait({connecting})
            if not connecting.cancelled() and connecting.exception() is None:
                self._publisher = connecting.result()  # it connected just as it was cancelled
        await self._journal_retry.close(min(CLOSE_JOURNAL_S, self.settings.publish_timeout_s))
        journal = self._journal_writer.publisher if self._journal_writer is not None else None
        for publisher in (self._publisher, journal):
            if publisher is not None:
                await publisher.close()
                await publisher.connection.close()
        self._publisher, self._journal_writer = None, None

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

    def _forget_publisher(self) -> None:
        """The publisher's connection went: the next ``_connected()`` connects anew."""
        self._publisher = None

    def _connected_or_not(self, attempt: asyncio.Future[Publisher]) -> None:
        self._connecting = None
        if not attempt.cancelled() and attempt.exception() is None:
            self._publisher = attempt.result()
            if self._policy_check is None:
                self._policy_check = asyncio.ensure_future(
                    warn_on_risk(self.settings, functools.partial(setattr, self, "policy_report"))
                )

    async def _connect(self) -> Publisher:
        connection = await self._connector.connect()
        if not self._declared:
            try:
                await self._declare_topology(create=self.declare)
            except BaseException:
                await connection.close()
                raise
        return Publisher(connection)

    async def _declare_topology(self, *, create: bool) -> None:
        """Declare every queue but the cancellation stream (scheduling must not wait on
        it: cancel declares it); without ``create`` only if the relay queue exists.

        A user that may not declare (the producer's grant, docs/security.md) schedules
        on a prefix that exists: its relays declare what is missing.

        Raises:
            PrefixNotDeclaredError: without ``create``, no relay queue.
        """
        try:
            await declare_topology(
                self.settings,
                self.topology.queues_but_stream(),
                first=self._connector.url,
                existing=not create,
            )
        except AccessRefusedError:
            if create:
                raise
            # (without create, declare_topology found the relay queue first: it exists)
        self._declared = True

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
        declare: bool = False,
        check_target: bool = False,
        replace: bool = False,
        every: timedelta | float | None = None,
        cron: str | None = None,
        tz: str | None = None,
        start: datetime | None = None,
        until: datetime | None = None,
        count: int | None = None,
        catch_up: str | None = None,
        recurrence: Recurrence | None = None,
    ) -> Scheduled:
        """Deliver ``message`` to ``exchange`` with ``routing_key`` at ``at`` or after
        ``delay``, or again and again: ``every`` interval or on ``cron`` in ``tz``, or
        as ``recurrence`` says.

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
            declare: declare the prefix's topology first if it does not exist (as
                ``Scheduler(declare=True)`` does).
            check_target: first check, publishing nothing, that the target exchange
                exists and routes the routing key to a queue (``routes.check_route``:
                a passive declare; for an exchange other than the default one, its
                bindings from the management API). A target broken at due time is
                parked; this finds it now. It checks the bindings of this instant.
            replace: this message replaces every message of ``schedule_id`` scheduled
                before it (by the producers' clocks): once this call returns, exactly one
                is pending, this one. The new message is published first, then a cancel
                record for the older ones (``{prefix}.cancelled``): a crash in between
                leaves a duplicate, never nothing. An older copy due within
                ``CANCEL_LEAD_S`` of the call may be delivered still.
            every: a recurring schedule: every this long (a timedelta or seconds, at least
                1 s), from ``start`` (default: one interval from now).
            cron: or on a cron expression (``"0 9 * * 1-5"``; six fields: seconds first),
                read in time zone ``tz`` (an IANA name, default UTC; the DST gap and fold
                as ``hopsched.core.recurring`` says), from ``start`` (default now).
            start, until: aware datetimes: no occurrence before ``start``, none after
                ``until`` (default: no end).
            count: at most this many occurrences are delivered.
            catch_up: what occurrences missed while no relay ran become: ``"latest"``
                (default: the latest is delivered once), ``"all"``, ``"none"``
                (``hopsched.core.recurring.CatchUp``).
            recurrence: or all of those as one value, ``hopsched.Recurrence`` (then give
                none of them as keywords).

        A recurring schedule is one message in the broker at a time: when an occurrence
        is due the relay delivers it and schedules the next (docs/recurring.md). Each
        occurrence is delivered with ``x-hopsched-id`` (``schedule_id``, the same for all),
        ``x-hopsched-due`` (its own due time), ``x-hopsched-occurrence`` (1, 2, ...) and
        ``x-hopsched-key`` (``ID@DUE``, to de-duplicate per occurrence). ``cancel(id)``
        ends it; ``reschedule`` does not apply to it (cancel it and schedule it anew, or
        schedule it anew with ``replace=True``).

        Returns:
            ``Scheduled`` with the schedule id and the due time (a recurring schedule's
            first occurrence), once the broker has confirmed the message (it is then
            safe from a crash of this process) and its record in the journal
            ``{prefix}.journal`` was written or failed (never raised: the message is
            scheduled all the same; the record is kept and written again in the
            background, ``journal_backlog``, and ``get()`` knows the schedule once it
            is; docs/operations.md, "When the journal takes no writes").

        Raises:
            InvalidScheduleError: (a ValueError; nothing was sent) naive datetime,
                both/neither of at/delay, a routing key or exchange longer than 255
                bytes, an empty routing key on the default exchange, a target
                ``Settings.allowed_targets`` does not allow or one of hopsched's own
                objects (exchange or queue ``{prefix}.…``), a header or
                ``expiration`` AMQP or RabbitMQ cannot carry, headers too large for one
                frame, a ``user_id`` other than the login.
            BrokerUnavailableError: no broker answers; ``BrokerConnectionLost`` (a
                subclass) if the connection went during the call.
            PrefixNotDeclaredError: the prefix has no relay queue (a mistyped prefix?)
                and neither this call nor the Scheduler asked to declare it.
            UnroutableTargetError: with ``check_target``, the target would not take it
                (an ``InvalidScheduleError`` and an ``Unroutable``).
            TargetCheckError: with ``check_target``, it could not be told.
            PublishTimeoutError: no confirm within ``Settings.publish_timeout_s``.
            PublishRejectedError: the broker refused the message (``TargetRefused``,
                ``Unroutable`` are subclasses).

        A call that raised ``PublishTimeoutError`` or ``BrokerConnectionLost``, or that
        was cancelled, may still be delivered: the broker may have taken the message.
        Schedule it again with the same ``schedule_id`` and ``replace=True``: then one
        is delivered, not two. A call cancelled after the broker confirmed its message
        still has its journal record written (in the background), so ``get()`` knows it.
        """
        _require_flags(declare=declare, check_target=check_target, replace=replace)
        if replace and schedule_id is None:
            raise InvalidScheduleError("replace=True needs the schedule_id of what it replaces")
        rule = None
        keywords = (every, cron, tz, start, until, count, catch_up)
        if recurrence is not None:
            if not isinstance(recurrence, Recurrence):
                raise InvalidScheduleError(
                    f"recurrence={shorten(recurrence)}: must be a hopsched.Recurrence, e.g. "
                    "Recurrence(every=timedelta(hours=1))"
                )
            if keywords != (None,) * len(keywords):
                raise InvalidScheduleError(
                    "give recurrence= or its keywords (every=, cron=, tz=, start=, until=, "
                    "count=, catch_up=), not both"
                )
            rule = recurrence.rule(self._clock())
        elif every is not None or cron is not None:
            rule = Rule.make(
                now_us=self._clock(),
                every=every,
                cron=cron,
                tz=tz,
                start=start,
                until=until,
                count=count,
                catch_up=catch_up or "latest",
            )
        elif (tz, start, until, count, catch_up) != (None,) * 5:
            raise InvalidScheduleError(
                "tz=, start=, until=, count= and catch_up= are for a recurring schedule: "
                "give every= or cron= too"
            )
        checked = self._check(
            ScheduleRequest(message, routing_key, at, delay, exchange, schedule_id, rule)
        )
        if declare and not self._declared:
            await self._declare_topology(create=True)
        if check_target:
            await self._check_target(checked)
        prepared = self._sender.build(checked)
        result = (await self._sender.send([prepared]))[0]
        if isinstance(result, BaseException):
            raise result
        await self._scheduled([(prepared, result)], "replace" if replace else "schedule", replace)
        return result

    async def _scheduled(
        self, done: Sequence[tuple[Prepared, Scheduled]], origin: str, replace: bool
    ) -> None:
        """Journal what was scheduled (confirmed); with ``replace``, then cancel the
        copies of each id created before its new one.

        Raises:
            As ``schedule()``, for the cancel record only.
        """
        now = self._clock()
        records = []
        for prepared, _ in done:
            assert prepared.checked is not None
            envelope = prepared.checked.envelope
            records.append(
                JournalRecord(
                    SCHEDULED,
                    envelope.schedule_id,
                    now,
                    envelope.created_us,
                    envelope.due_us,
                    envelope.exchange,
                    envelope.routing_key,
                    len(prepared.body),
                    envelope.owner,
                    origin=origin,
                    copy=Copy(prepared.properties, prepared.body),
                    occurrence=envelope.occurrence,
                    user=envelope.user,
                )
            )
        if not replace:  # no task of its own: one schedule() is one confirm after another
            await self._write_journal(records)
            return
        journaled = asyncio.ensure_future(self._write_journal(records))  # beside the cancel
        try:
            older = [Record(CANCEL, r.schedule_id, r.created_us - 1) for r in records]
            try:
                await self._write_records(older)
            except HopschedError as error:
                error.add_note(
                    "the new message is scheduled; the older ones of its id may still be "
                    "delivered: cancel them with cancel(id) (it takes the new one too) or "
                    "schedule again with replace=True"
                )
                raise
        finally:
            await journaled

    async def _write_journal(self, records: list[JournalRecord]) -> None:
        """Append records to ``{prefix}.journal``, confirmed, a thousand per stream
        message. Never raises: the records of a write that fails are kept and written
        again in the background (``JournalRetry``), which this call does not await."""
        if not records:
            return
        try:
            failed, why = await self._journal_write(records, self.settings.publish_timeout_s)
        except asyncio.CancelledError:  # the messages are scheduled: their records stay
            self._journal_retry.resend(records)
            raise
        if failed:
            self._journal_retry.keep(failed, why)
        else:
            self._journal_retry.written()  # the stream takes writes again: no back-off

    async def _journal_write(
        self, records: Sequence[JournalRecord], timeout_s: float
    ) -> tuple[list[JournalRecord], str]:
        """``JournalWriter.write`` on the journal's connection (opened if need be): the
        records not written and why. Never raises."""
        try:
            await self._stream_ready(self.topology.journal_stream)
            writer = await self._journal_connected()
        except HopschedError as error:
            self.journal_failures += 1
            return list(records), str(error)
        return await writer.write(records, timeout_s)

    async def _journal_connected(self) -> JournalWriter:
        """The journal's writer, on a connection of its own (opened on the first write): a
        stream publish the broker refuses with a connection error (RabbitMQ 4.0 on
        Khepri: "506 RESOURCE_ERROR - Stream not found" just after the stream was
        declared, seen in CI) closes it, not the ladder's, where other schedules'
        publishes are in flight.

        Raises:
            BrokerUnavailableError, AccessRefusedError: as ``Connector.connect``.
        """
        async with self._journal_connecting:  # one connection for concurrent writes
            writer = self._journal_writer
            if writer is not None and writer.publisher.connection.is_open:
                return writer
            self._journal_writer = None
            if writer is not None:
                await writer.publisher.close()
                await writer.publisher.connection.close()
            urls, here = self.settings.urls, self._connector.url  # the scheduler's node first
            start = urls.index(here) if here in urls else None
            connector = Connector(self.settings, name="hopsched-journal", start=start)
            connection = await connector.connect()
            self._journal_writer = JournalWriter(
                Publisher(connection),
                self.topology.journal_stream,
                self._journal_written,
                user_id=self._owner,  # whose cancels they are, for look-ups
            )
            return self._journal_writer

    def _journal_written(self, count: int, ok: bool) -> None:
        if not ok:
            self.journal_failures += 1

    async def schedule_many(
        self,
        requests: Iterable[ScheduleRequest],
        *,
        return_exceptions: bool = False,
        declare: bool = False,
        check_target: bool = False,
    ) -> list[Scheduled | HopschedError]:
        """Schedule many messages with their confirms in flight together.

        Every request is checked before anything is sent (``InvalidScheduleError``
        names the first bad one by its index). Then all are published at once and
        their confirms awaited within ``Settings.publish_timeout_s``.

        Returns:
            ``Scheduled`` for each request, in order; with ``return_exceptions`` a
            failed one gives its error in its place instead of raising it.

        ``declare`` and ``check_target`` are ``schedule()``'s (each distinct target is
        checked once, before anything is sent).

        Raises:
            As ``schedule()``: without ``return_exceptions``, the first failure once all
            are settled (the others may have been scheduled: see their ids in
            ``error.__notes__``).
        """
        _require_flags(
            return_exceptions=return_exceptions, declare=declare, check_target=check_target
        )
        if not isinstance(requests, Iterable):
            raise InvalidScheduleError(
                f"requests {shorten(requests)}: must be an iterable of ScheduleRequest"
            )
        checked = []
        for index, request in enumerate(requests):
            try:
                checked.append(self._check(request))
            except InvalidScheduleError as error:
                raise InvalidScheduleError(f"request {index}: {error}") from None
        if declare and not self._declared:
            await self._declare_topology(create=True)
        if check_target:
            targets = {
                (c.envelope.exchange, c.envelope.routing_key, repr(c.headers)): c for c in checked
            }
            for one in targets.values():
                await self._check_target(one)
        prepared: list[Checked | Prepared] = []
        for one in checked:
            try:
                prepared.append(self._sender.build(one))
            except InvalidScheduleError:
                prepared.append(one)  # _send gives its error in its place
        results = await self._sender.send(prepared)
        await self._scheduled(
            [
                (item, result)
                for item, result in zip(prepared, results, strict=True)
                if isinstance(item, Prepared) and isinstance(result, Scheduled)
            ],
            "schedule",
            replace=False,
        )
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    done = [r.schedule_id for r in results if isinstance(r, Scheduled)]
                    result.add_note(f"scheduled nonetheless: {len(done)} of {len(results)}")
                    raise result
        return results

    async def cancel(self, schedule: str | Scheduled, *, due: datetime | None = None) -> Cancelled:
        """Cancel a schedule: its messages scheduled before now are not delivered.

        With ``Settings.signing_keys`` the cancel is signed with each key and reaches the
        messages signed with one of them; without, the unsigned ones only (where the
        relays hold keys; docs/security.md).

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
        """``cancel()`` for many schedules, in one confirmed write per thousand.

        Raises:
            As ``cancel()``; InvalidScheduleError for a ``str`` (one id, not its
            characters: ``cancel()`` or ``[id]``) or anything not iterable.
        """
        if isinstance(schedules, str | bytes) or not isinstance(schedules, Iterable):
            raise InvalidScheduleError(
                f"schedules {shorten(schedules)}: give a list of schedule ids (or "
                "cancel(id) for one), not a str or other non-iterable"
            )
        now = self._clock()
        records, results = [], []
        for schedule in schedules:
            schedule_id, due_us = self._identify(schedule, due)
            records.append(Record(CANCEL, schedule_id, now, due_us))
        owner = cancel_owner([key.key_id for key in self._signatures.keys])  # whose it takes
        confirmed = await self._write_records(
            records,
            journal=[
                JournalRecord(CANCELLED, r.schedule_id, now, now, owner=owner) for r in records
            ],
        )
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
    ) -> Scheduled | None:
        """Move a pending schedule to a new due time, earlier or later: it is delivered at
        the new time (never early, as punctually as any message), whatever step its
        message sits in, and the old message is not delivered.

        From the journal's copy of the message (``{prefix}.journal``, written by
        ``schedule()``), it publishes a new message with the new due time, then a cancel
        record for the messages of the id created before it (signed as ``cancel()`` is).
        A crash between the two leaves both, never neither; an old copy due within
        ``CANCEL_LEAD_S`` of the call may be delivered still (de-duplicate on
        ``x-hopsched-id``). Reading the journal takes about as long as reading the whole
        stream (``get()``).

        Returns:
            the new ``Scheduled`` (new due time, first queue), once the broker has
            confirmed the new message and the cancel; None if the journal knows no
            pending schedule of that id (never scheduled, or already delivered,
            cancelled or parked: ``get()`` says which), and nothing was changed.

        Raises:
            InvalidScheduleError: the id is a recurring schedule's (cancel it, or
                schedule it anew with ``replace=True``).
            As ``schedule()``; and as ``get()`` for reading the journal.
        """
        now = self._clock()
        schedule_id, _ = self._identify(schedule, None)
        due_us = check_due(due_time_us(at, delay, now), "the new due time")
        info = await self._info(schedule_id, copies=True)
        if info is None or info.state not in (PENDING, HELD):
            return None
        if info.occurrence:
            raise InvalidScheduleError(
                f"{schedule_id!r} is a recurring schedule: its occurrences follow its rule, "
                "and reschedule() would move one of them only. Cancel it and schedule it "
                "anew, or schedule it anew with replace=True (CLI: hopsched schedule --replace)"
            )
        if info.pending_copies and info.pending_copies > 1:
            raise InvalidScheduleError(
                f"{schedule_id!r} has {info.pending_copies} messages pending (it was "
                "scheduled more than once without replace=True): reschedule() moves one "
                "message and would cancel the others. Cancel it and schedule anew, or "
                "schedule the one to keep with replace=True (CLI: --replace)"
            )
        if info.copy is None:  # only a relay's record of it (a hopsched before the journal)
            await self._write_records([Record(RESCHEDULE, schedule_id, now, due_us)])
            return Scheduled(schedule_id, due_us, self.topology.cancel_stream)
        if (refusal := self._not_ours(info.copy)) is not None:
            log.warning("not rescheduling %s: %s", schedule_id, refusal)
            return None
        now = self._clock()
        checked = reissue(
            info.copy.properties,
            info.copy.body,
            due_us=due_us,
            now_us=now,
            created_us=max(now, info.created_us + 2),  # after the cancel's instant below
            ladder=self._ladder,
            topology=self.topology,
            avoid=self._avoided.avoided(now),
        )
        checked.envelope = self._signatures.sign_envelope(checked.envelope, checked.body)
        prepared = self._sender.build(checked)
        result = (await self._sender.send([prepared]))[0]
        if isinstance(result, BaseException):
            raise result
        await self._scheduled([(prepared, result)], "reschedule", replace=True)
        return result

    def _not_ours(self, copy: Copy) -> str | None:
        """Why this Scheduler may not issue the journal's ``copy`` again, or None.

        The journal's records are not signed: with signing keys, the copy's own
        envelope signature must verify with one of them (a forged record gets nothing
        re-signed), and an unsigned copy is not this Scheduler's (its signed cancel would
        not reach the old message: a duplicate). Without keys, a copy another user
        scheduled is not this Scheduler's either, unless its user is trusted: its cancel
        would not reach the old message (docs/security.md, "Owner-only without keys").
        """
        envelope = copy_envelope(copy.properties)
        if not self._signatures.enabled:
            user, mine = envelope.user, self._owner
            if user is None or user == mine or mine in self.settings.trusted_users:
                return None
            if mine is None:  # auth=external: its records carry no user_id
                return (
                    f"the journal's copy was scheduled by RabbitMQ user {user!r}, and a "
                    "cancel without a user_id (auth=external) reaches only schedules of no "
                    f"known user: reschedule it logged in as {user!r} with a password"
                )
            return (
                f"the journal's copy was scheduled by RabbitMQ user {user!r}, and a cancel "
                f"by {mine!r} reaches only its own schedules: reschedule it as {user!r}, or "
                f"list {mine!r} in trusted_users (HOPSCHED_TRUSTED_USERS) on the relays "
                "and here"
            )
        checked = self._signatures.check_envelope(envelope, copy.body)
        if isinstance(checked, Refusal):
            return f"the journal's copy does not verify ({checked.reason})"
        if checked.owner is None:
            return "the journal's copy is unsigned, and this Scheduler signs with its keys"
        return None

    async def get(self, schedule_id: str, *, count_copies: bool = False) -> ScheduleInfo | None:
        """What the journal says of ``schedule_id``: its state (pending, held, delivered,
        cancelled, parked), due time, target, size, and when it was delivered, cancelled
        or parked (with the reason); None if no record of it is kept (never scheduled, or
        its last record is older than the journal keeps, ``JOURNAL_RETENTION_US``).

        A relay that answers look-ups (``Settings.lookups``) answers in milliseconds from
        the journal it keeps (``pending_copies`` None then); its answer knows every
        record confirmed before the call, as a reading does (``hopsched.journal.lookups``).
        Without one (or none answering within ``Settings.lookup_timeout_s``) it reads the
        journal from its start, on a new connection: its cost grows with the stream
        (docs/design.md, "The journal"). Either way it writes one marker record, to know
        where the stream ends. ``count_copies``: read the journal, relay or not, to count
        ``pending_copies`` (an id scheduled twice without ``replace``).

        Raises:
            InvalidScheduleError: not a valid schedule id.
            BrokerUnavailableError, AccessRefusedError (needs read on the journal and
                write on amq.default: the operator's grant), ChannelClosedError (404: no
                journal, a prefix no relay of this version served yet).
        """
        schedule_id = check_known_id(schedule_id)
        answered = None if count_copies else await self._ask_relays([schedule_id])
        if answered is not None:
            return answered[schedule_id]
        return await self._info(schedule_id, copies=False)

    async def _ask_relays(self, ids: Sequence[str]) -> dict[str, ScheduleInfo | None] | None:
        """The relays' answer for ``ids`` (``LookupAsker.ask``, ``MAX_IDS`` a request),
        None if any request of it had none, or no connection can be made: then the
        journal is read."""
        try:  # on the journal's connection: the ladder's declares its queues first
            connection = (await self._journal_connected()).publisher.connection
        except HopschedError:
            return None  # the journal's reading says what is wrong (e.g. 404: no prefix)
        asker = self._asker
        try:
            if asker is None or not asker.usable_on(connection):
                asker = self._asker = await LookupAsker.open(connection, self.topology.lookups)
            answers: dict[str, ScheduleInfo | None] = {}
            for start in range(0, len(ids), MAX_IDS):
                some = await asker.ask(ids[start : start + MAX_IDS], self.settings.lookup_timeout_s)
                if some is None:
                    return None
                answers.update(some)
        except (BrokerConnectionLost, ChannelClosedError):
            return None  # the journal's reading connects anew
        return answers

    async def get_many(self, schedule_ids: Iterable[str]) -> dict[str, ScheduleInfo | None]:
        """``get()`` of many ids for the cost of one: one request to a relay answering
        look-ups per ``MAX_IDS`` ids, or the journal read once. Checking a batch's 1,000
        ids with ``get()`` each without such a relay reads the journal 1,000 times.

        Returns:
            Each id given -> its ``ScheduleInfo`` (``pending_copies`` None, as in a
            listing), or None if no record of it is kept.

        Raises:
            InvalidScheduleError: an id that is not a valid schedule id (nothing read).
            As ``get()``.
        """
        ids = [check_known_id(schedule_id) for schedule_id in schedule_ids]
        answered = await self._ask_relays(list(dict.fromkeys(ids)))
        if answered is not None:
            return {schedule_id: answered[schedule_id] for schedule_id in ids}
        fold = await read_journal(self.settings, copies=False)
        now, hold_us = self._clock(), self._ladder.hold_window_ms * US_PER_MS
        return {schedule_id: fold.info(schedule_id, now, hold_us) for schedule_id in ids}

    async def _info(self, schedule_id: str, *, copies: bool) -> ScheduleInfo | None:
        fold = await read_journal(self.settings, only=schedule_id, copies=copies)
        info = fold.info(schedule_id, self._clock(), self._ladder.hold_window_ms * US_PER_MS)
        if info is None:
            return None
        return dataclasses.replace(info, pending_copies=fold.pending_copies())

    async def pending(
        self,
        due_before: datetime | None = None,
        target: str | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[ScheduleInfo]:
        """The pending (and held) schedules, in due order (then by id).

        Args:
            due_before: only those due before this instant (an aware datetime).
            target: only those with this routing key.
            limit: at most this many.

        It reads the whole journal first (as ``get()``), holding one small row per
        schedule id read, no message bodies (``JournalFold``), and makes each
        ``ScheduleInfo`` as it is yielded.

        Raises:
            InvalidScheduleError: a naive ``due_before``, a negative ``limit``.
            As ``get()``.
        """
        before = None if due_before is None else due_time_us(due_before, None, 0)
        if limit is not None and limit < 0:
            raise InvalidScheduleError(f"limit={limit}: give a count >= 0, or None for all")
        fold = await read_journal(self.settings, copies=False)
        now, hold_us = self._clock(), self._ladder.hold_window_ms * US_PER_MS
        for info in fold.pending_infos(now, hold_us, before, target, limit):
            yield info

    def _identify(self, schedule: str | Scheduled, due: datetime | None) -> tuple[str, int | None]:
        if isinstance(schedule, Scheduled):
            return schedule.schedule_id, schedule.due_us
        schedule_id = check_known_id(schedule)
        if due is None:
            return schedule_id, None
        return schedule_id, due_time_us(due, None, 0)

    async def _write_records(
        self, records: list[Record], journal: Sequence[JournalRecord] = ()
    ) -> int:
        """Append records to ``{prefix}.cancelled``, confirmed; then journal a copy of
        each stream message written (a relay restores the stream from them, should it
        be deleted), with ``journal``'s records.

        Returns:
            When the stream confirmed the records, µs since the epoch.

        Raises:
            As ``schedule()``.
        """
        stream = self.topology.cancel_stream
        await self._stream_ready(stream)
        # user_id: the broker checks it is the login; the relays apply an unsigned record
        # to this user's schedules only (docs/security.md, "Owner-only without keys").
        properties = amqp.Properties(
            content_type="application/x-ndjson", delivery_mode=2, user_id=self._owner
        )
        records = self._signatures.sign_records(records)
        bodies = [
            encode_records(records[start : start + _RECORDS_PER_MESSAGE])
            for start in range(0, len(records), _RECORDS_PER_MESSAGE)
        ]
        writes = [
            Prepared(body, properties.encode(), "", stream, stream, Scheduled("", 0, stream))
            for body in bodies
        ]
        for result in await self._sender.send(writes):
            if isinstance(result, BaseException):
                raise result
        confirmed = self._clock()
        await self._write_journal(
            [cancel_copy_record(body, confirmed) for body in bodies] + [*journal]
        )
        return confirmed

    async def _stream_ready(self, stream: str) -> None:
        """Declare ``stream`` before the first write to it."""
        if stream not in self._streams_declared:
            publisher = await self._connected()  # first: a prefix that does not exist is refused
            with contextlib.suppress(AccessRefusedError):  # a producer: the relays declared it
                await self._declare_stream(publisher.connection, stream)
            self._streams_declared.add(stream)

    async def _declare_stream(self, connection: amqp.Connection, stream: str) -> None:
        """Declare a stream (``{prefix}.cancelled``, ``{prefix}.journal``) on the
        scheduler's own connection: a new one
        costs a TCP and AMQP handshake (8-107 ms measured on RabbitMQ 4.0 with Khepri),
        which a cancel confirmed ``CANCEL_LEAD_S`` ahead cannot spare. A refusal other
        than 403 is declared again over a connection of its own, for its explanation.

        Raises:
            AccessRefusedError: the user may not declare it (a producer's grant).
            As ``declare_topology``.
        """
        declare = commands.Queue.Declare(
            queue=stream, durable=True, arguments=self.topology.queues()[stream]
        )
        try:
            channel = await connection.channel()
            try:
                await channel.call(declare)
            finally:
                await channel.close()
        except ChannelClosedError as error:
            if error.reply_code == 403:
                raise AccessRefusedError(f"declaring {stream!r}: {error}") from None
            await self._declare([stream])  # 406, 404: explained there
        except BrokerUnavailableError:
            await self._declare([stream])  # the connection went: a new one, or its error

    async def _check_target(self, checked: Checked) -> None:
        """``routes.check_route`` for a checked call's target and headers."""
        await check_route(
            self.settings,
            checked.envelope.exchange,
            checked.envelope.routing_key,
            dict(checked.headers),
            management_url=self._management_url,
            first=self._connector.url,
        )

    def _check(self, request: ScheduleRequest) -> Checked:
        """Check a call (``prepare.check_request``), or raise InvalidScheduleError."""
        publisher = self._publisher
        now = self._clock()
        checked = check_request(
            request,
            now_us=now,
            avoid=self._avoided.avoided(now),
            ladder=self._ladder,
            topology=self.topology,
            targets=self._targets,
            login=self._login,
            frame_max=publisher.connection.frame_max if publisher is not None else 131_072,
            max_body_bytes=self.settings.max_message_size,
            owner=self._owner,
        )
        checked.envelope = self._signatures.sign_envelope(checked.envelope, checked.body)
        return checked
