"""Look-ups answered by relays: ``get()`` in milliseconds however long the journal.

Reading ``{prefix}.journal`` from its start costs a second per million records
(``read_journal``). A relay started with ``lookups`` (``hopsched relay --lookups``)
reads it once, keeps the fold, and answers look-ups from it, reading when asked what
was written since:

* It declares exchange ``{prefix}.lookups`` (fanout) and queue ``{prefix}.lookups``, both
  auto-delete: they exist while a relay answers, and go with the last one. Writing to
  the exchange is the right to ask (the operator's grant, as reading the journal is);
  several relays share the queue, each request goes to one of them.
* A request (``encode_request``) names up to ``MAX_IDS`` ids and a direct reply-to
  address (https://www.rabbitmq.com/docs/direct-reply-to). Its answer is never older
  than the request: the relay writes a marker record to the journal once it has the
  request, reads the journal from where it stopped last, and answers once it read that
  marker back, so every record confirmed before the request was sent is in the fold it
  answers from (one marker serves every request that came while the last one was on its
  way). Then it stops reading: a relay nobody asks spends nothing on the journal.
* Until its first reading reached the journal's end, and while its connection is being
  made again, a relay answers ``unavailable``, at once.

``LookupAsker.ask`` asks; ``None`` from it (no relay answers look-ups, one is catching up,
no answer within the timeout, the grant lacks the exchange) means: read the journal.

The fold is read anew from the stream's start every ``REREAD_AFTER_S`` (a day), so that
it holds what the stream holds, not every id since the relay started: memory is the
``JournalFold``'s, about 127 bytes per pending id and a record per finished one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pamqp import commands

from hopsched import amqp
from hopsched.amqp.acks import Acker
from hopsched.amqp.publisher import Publisher
from hopsched.connect import Connector, RetryLog
from hopsched.core.ladder import US_PER_MS
from hopsched.errors import (
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
    HopschedError,
)
from hopsched.journal.records import (
    MARKER,
    JournalFold,
    JournalRecord,
    ScheduleInfo,
    encode_journal,
)
from hopsched.journal.stream import JOURNAL_LANE, JOURNAL_PROPERTIES, fold_message, holds_marker
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = [
    "MAX_IDS",
    "REREAD_AFTER_S",
    "LookupAsker",
    "LookupServer",
    "decode_answer",
    "decode_request",
    "encode_answer",
    "encode_request",
]

log = logging.getLogger("hopsched.relay")

#: Ids one request names at most (``get_many`` asks in requests of this many).
MAX_IDS = 10_000
#: The fold is read anew from the stream's start this often, s (see the module's doc).
REREAD_AFTER_S = 86_400.0
#: Between a lost connection and the next attempt, s (doubling up to 5 s).
_RETRY_FIRST_S, _RETRY_MAX_S = 0.5, 5.0
#: A marker not read back after this long (s) ends the session: the journal is read
#: anew from its start (a stream deleted and declared again, a reading that stalled);
#: the askers, who wait ``Settings.lookup_timeout_s`` (1 s), read it meanwhile.
_MARKER_READ_S = 5.0
#: After a refusal (403: a grant without ``{prefix}.lookups``), s.
_REFUSED_RETRY_S = 60.0
#: Stream messages read ahead of their acks (as ``read_journal``).
_PREFETCH = 64
_JSON = "application/json"
_REPLY_TO = "amq.rabbitmq.reply-to"
_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduleInfo) if f.name != "copy")


def encode_request(ids: Sequence[str]) -> bytes:
    return json.dumps({"ids": list(ids)}).encode()


def decode_request(body: bytes) -> list[str]:
    """The ids a request names.

    Raises:
        ValueError: not a request (not JSON, no list of strings, more than ``MAX_IDS``).
    """
    request = json.loads(body)
    ids = request.get("ids") if isinstance(request, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError("'ids' must be a list of strings")
    if len(ids) > MAX_IDS:
        raise ValueError(f"{len(ids)} ids: at most {MAX_IDS} per request")
    return ids


def encode_answer(infos: Sequence[ScheduleInfo | None] | None, unavailable: str = "") -> bytes:
    """An answer: each id's info in the request's order (None: no record of it), or
    why the relay cannot answer (``unavailable``)."""
    if infos is None:
        return json.dumps({"unavailable": unavailable}).encode()
    rows = [None if i is None else {name: getattr(i, name) for name in _FIELDS} for i in infos]
    return json.dumps({"infos": rows}).encode()


def decode_answer(body: bytes, ids: Sequence[str]) -> dict[str, ScheduleInfo | None] | str:
    """An answer to a request for ``ids``: each id -> its info, or why there is none.

    Raises:
        ValueError: not an answer to that request.
    """
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise ValueError("not an answer: no JSON object")
    if "unavailable" in answer:
        return str(answer["unavailable"])
    rows = answer.get("infos")
    if not isinstance(rows, list) or len(rows) != len(ids):
        count = len(rows) if isinstance(rows, list) else "no"
        raise ValueError(f"an answer of {count} rows to a request of {len(ids)} ids")
    infos: dict[str, ScheduleInfo | None] = {}
    for schedule_id, row in zip(ids, rows, strict=True):
        if row is None:
            infos[schedule_id] = None
            continue
        if not isinstance(row, dict):
            raise ValueError(f"an answer's row for {schedule_id!r} is no JSON object")
        try:
            info = ScheduleInfo(**{name: row[name] for name in _FIELDS if name in row})
        except TypeError as error:  # a field missing
            raise ValueError(f"an answer's row for {schedule_id!r}: {error}") from None
        if info.schedule_id != schedule_id:
            raise ValueError(f"an answer for {info.schedule_id!r} where {schedule_id!r} was asked")
        infos[schedule_id] = info
    return infos


class _Request:
    __slots__ = ("correlation_id", "ids", "reply_to")

    def __init__(self, ids: list[str], reply_to: str, correlation_id: str | None) -> None:
        self.ids = ids
        self.reply_to = reply_to
        self.correlation_id = correlation_id


class LookupServer:
    """A relay's answering of look-ups (see the module's doc): ``await run()`` until
    cancelled, connecting again after a loss.

    Args:
        settings: the broker and prefix; ``hold_window_ms`` tells pending from held.
        clock: the time now, µs since the epoch (the relay's).
        on_journal_missing: called when a reading finds no journal (404): a relay
            declares it again if it is gone.

    Attributes:
        answered: requests answered from the fold.
        readings: readings of the journal from its start (one per connection, and one
            every ``REREAD_AFTER_S``).
        ready: see the property.
    """

    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], int],
        *,
        on_journal_missing: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_journal_missing = on_journal_missing
        self.topology = Topology.from_settings(settings)
        self.name = self.topology.lookups
        self.clock = clock
        self.answered = 0
        self.readings = 0
        self._session: _Session | None = None
        self.connector = Connector(settings, name="hopsched-lookups")

    @property
    def ready(self) -> bool:
        """Whether it answers from its fold now (its first reading of the journal done)."""
        return self._session is not None and self._session.ready

    async def run(self) -> None:
        delay = _RETRY_FIRST_S
        retries = RetryLog(self.settings.log_interval_s)
        while True:
            try:
                connection = await self.connector.connect()
            except HopschedError as error:
                said, more = retries.say()
                if said:
                    log.warning(
                        "look-ups: cannot connect (%s); trying again in %.1f s%s",
                        error,
                        delay,
                        more,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            retries.reset()
            session = self._session = _Session(self, connection)
            self.readings += 1
            try:
                await session.serve()
                delay = _RETRY_FIRST_S  # read anew after REREAD_AFTER_S
            except (HopschedError, ValueError) as error:
                if isinstance(error, ChannelClosedError) and error.reply_code == 403:
                    log.error(
                        "look-ups: the broker refused (%s): answering them needs configure, "
                        "write and read on %s (the relay's grant, `hopsched permissions "
                        "--role relay`); trying again in %.0f s",
                        error,
                        self.name,
                        _REFUSED_RETRY_S,
                    )
                    await asyncio.sleep(_REFUSED_RETRY_S)
                    continue
                if isinstance(error, ChannelClosedError) and error.reply_code == 404:
                    log.warning(
                        "look-ups: %s is missing (%s); it is declared again if it is gone "
                        "(the relay, or `hopsched declare`), and read anew in %.1f s; "
                        "meanwhile get() reads it itself, and fails as this did",
                        self.topology.journal_stream,
                        error,
                        delay,
                    )
                    if self.on_journal_missing is not None:
                        self.on_journal_missing()
                else:
                    log.warning(
                        "look-ups: %s; the journal is read anew in %.1f s (get() reads it "
                        "meanwhile)",
                        error,
                        delay,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
            finally:
                self._session = None
                await session.close_replies()
                await connection.close(timeout_s=1.0)


class _Session:
    """One connection's reading of the journal and answering of requests."""

    def __init__(self, server: LookupServer, connection: amqp.Connection) -> None:
        self.server = server
        self.connection = connection
        self.publisher = Publisher(connection)
        self.fold = JournalFold(trusted=server.settings.trusted_users)
        self.hold_us = server.settings.hold_window_ms * US_PER_MS
        self.ready = False
        self.marker: str | None = None  # on its way: answers ``behind`` once read back
        self.behind: list[_Request] = []
        self.waiting: list[_Request] = []  # came while ``marker`` was on its way
        #: Replies go on a connection of their own: RabbitMQ (3.10.8, 4.0.5) closes the
        #: connection (541 INTERNAL_ERROR) of a publish to a crafted reply-to address,
        #: which must not cost the fold. Opened anew when it goes.
        self.replies: amqp.Channel | None = None
        self.reopening: asyncio.Future[None] | None = None
        self.unsent: list[tuple[str, bytes, bytes]] = []  # reply-to, body, properties
        self.ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.stream = server.topology.journal_stream
        self.offset: int | str = "first"  # where the next reading starts
        self.asked = asyncio.Event()  # a marker is on its way: read until it is back
        self.idle = asyncio.Event()  # none is: stop reading (``asked``'s opposite)
        self.reading: amqp.Channel
        self.acker: Acker

    async def serve(self) -> None:
        """Read the journal, answer requests; return after ``REREAD_AFTER_S``.

        Raises:
            HopschedError: the connection or a channel went, a declare was refused.
        """
        started = time.monotonic()
        self.connection.closed.add_done_callback(self._channel_closed)
        requests = await self._channel()
        name = self.server.name
        await requests.call(
            commands.Exchange.Declare(exchange=name, exchange_type="fanout", auto_delete=True)
        )
        await requests.call(commands.Queue.Declare(queue=name, auto_delete=True))
        await requests.call(commands.Queue.Bind(queue=name, exchange=name))
        await self._open_replies()
        self.reading = await self._channel()
        await self.reading.qos(_PREFETCH)
        self.acker = Acker(self.reading, lazy=False)
        self._write_marker()  # the first reading: ready once it is read back
        reader = asyncio.ensure_future(self._read_when_asked())
        # Requests before then are answered "catching up" at once: their askers read.
        await requests.consume(name, self._request, self._lost(name), no_ack=True)
        left = REREAD_AFTER_S - (time.monotonic() - started)
        try:
            async with asyncio.timeout(max(left, 0)):  # wait_for may lose a cancel (3.11)
                error = await asyncio.shield(self.ended)
        except TimeoutError:
            log.info("look-ups: reading %s anew (every %.0f s)", self.stream, REREAD_AFTER_S)
            return
        finally:
            self._answer_all(None, "the relay's look-ups are stopping or reconnecting")
            # Closed before the reader is cancelled: an answer to a consume or a cancel
            # it awaits would come to no one (a warning per frame); closed, it ends them.
            await self.connection.close(timeout_s=1.0)
            reader.cancel()
            await asyncio.wait({reader})
        raise error

    async def _read_when_asked(self) -> None:
        """Consume the journal from where the last reading stopped while a marker is on
        its way, and stop once none is: a relay reads the journal for look-ups only when
        asked, each time what was written since (the broker sends a backlog in chunks:
        following each record as it is written cost 165 µs of the relay's CPU per
        ``schedule()`` at 500/s)."""
        try:
            while True:
                await self.asked.wait()
                offset = {"x-stream-offset": self.offset}
                lost = self._lost("the journal's reading")
                tag = await self.reading.consume(self.stream, self._read, lost, arguments=offset)
                await self.idle.wait()
                await self.reading.cancel(tag)  # what it sent before is read all the same
        except HopschedError as error:  # the channel's closing ends the session too
            if not self.ended.done():
                self.ended.set_result(error)

    def _read(self, delivery: amqp.Delivery) -> None:
        self.acker.received(delivery.delivery_tag)
        self.acker.done(delivery.delivery_tag)
        properties = delivery.properties
        headers = properties.headers if properties is not None else None
        offset = headers.get("x-stream-offset") if headers is not None else None
        if type(offset) is int:
            if isinstance(self.offset, int) and offset < self.offset:
                return  # read before (a chunk's start)
            self.offset = offset + 1
        user = properties.user_id if properties is not None else None
        fold_message(self.fold, delivery.body, user, copies=False)
        if self.marker is not None and holds_marker(delivery.body, self.marker):
            self._marker_read()

    async def _open_replies(self) -> None:
        """Raises: HopschedError (cannot connect)."""
        connection = await self.server.connector.connect()
        try:
            self.replies = await connection.channel()
        except BaseException:
            await connection.close(timeout_s=1.0)
            raise

    def _reopen_replies(self) -> None:
        """The replies' channel or connection closed (a reply to an address the broker
        refuses): open another, once at a time, for the next replies."""
        if self.reopening is None and not self.ended.done():

            async def reopen() -> None:
                old = self.replies
                self.replies = None
                if old is not None:
                    log.warning(
                        "look-ups: the broker closed the replies' channel (%s: a reply-to "
                        "address it refuses); opening another",
                        old.closed.result() if old.closed.done() else "unknown",
                    )
                    await old.connection.close(timeout_s=1.0)
                try:
                    await self._open_replies()
                except HopschedError as error:
                    self.unsent.clear()  # their askers read the journal after their timeout
                    log.warning("look-ups: cannot open the replies' connection (%s)", error)
                finally:
                    self.reopening = None
                self._send_replies()

            self.reopening = asyncio.ensure_future(reopen())

    async def close_replies(self) -> None:
        reopening = self.reopening
        if reopening is not None:
            reopening.cancel()
            await asyncio.wait({reopening})
        if self.replies is not None:
            await self.replies.connection.close(timeout_s=1.0)

    async def _channel(self) -> amqp.Channel:
        """A new channel whose closing ends the session."""
        channel = await self.connection.channel()
        channel.closed.add_done_callback(self._channel_closed)
        return channel

    def _lost(self, what: str) -> Callable[[str], None]:
        def cancelled(_: str) -> None:
            if not self.ended.done():
                self.ended.set_result(BrokerConnectionLost(f"the broker cancelled {what}"))

        return cancelled

    def _channel_closed(self, closed: asyncio.Future[Any]) -> None:
        if not self.ended.done():
            error = closed.result()
            self.ended.set_result(
                error if isinstance(error, BaseException) else BrokerConnectionLost(str(error))
            )

    def _request(self, delivery: amqp.Delivery) -> None:
        properties = delivery.properties
        reply_to = properties.reply_to if properties is not None else None
        if not reply_to:
            return  # no one to answer
        correlation_id = properties.correlation_id if properties is not None else None
        try:
            ids = decode_request(delivery.body)
        except ValueError as error:
            self._reply(_Request([], reply_to, correlation_id), None, f"not a request: {error}")
            return
        request = _Request(ids, reply_to, correlation_id)
        if not self.ready:
            self._reply(request, None, f"catching up with {self.server.topology.journal_stream}")
            return
        self.waiting.append(request)
        if self.marker is None:
            self._write_marker()

    def _write_marker(self) -> None:
        """Write a marker for the requests waiting; read until it is back."""
        marker = uuid.uuid4().hex
        self.marker = marker
        self.behind, self.waiting = self.waiting, []
        self.idle.clear()
        self.asked.set()

        def written(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.ACK or self.marker != marker:
                return
            why = f"the journal did not take a marker ({outcome.value}: {detail})"
            if not self.ready and not self.ended.done():  # read anew by run()
                self.ended.set_result(BrokerUnavailableError(why))
            self._answer_all(None, why)
            self._stop_reading()

        def overdue() -> None:  # a reading that stalls (a stream declared anew, say)
            if self.marker == marker and not self.ended.done():
                why = f"a marker not read back within {_MARKER_READ_S:g} s"
                self.ended.set_result(BrokerUnavailableError(why))  # read it all anew

        record = encode_journal([JournalRecord(MARKER, marker, 0, 0)])
        try:
            self.publisher.publish(
                JOURNAL_LANE, "", self.stream, record, JOURNAL_PROPERTIES, written
            )
        except (BrokerConnectionLost, ValueError) as error:
            written(amqp.Outcome.CLOSED, error)
        if self.ready:  # not the first reading: it takes as long as the journal is long
            asyncio.get_running_loop().call_later(_MARKER_READ_S, overdue)

    def _marker_read(self) -> None:
        if not self.ready:
            self.ready = True
            log.info(
                "look-ups: answering on %s (read %d ids from %s)",
                self.server.name,
                len(self.fold),
                self.stream,
            )
        now = self.server.clock()
        for request in self.behind:
            self._reply(request, [self.fold.info(i, now, self.hold_us) for i in request.ids])
        self.behind = []
        if self.waiting:
            self._write_marker()
        else:
            self._stop_reading()

    def _stop_reading(self) -> None:
        self.marker = None
        self.asked.clear()
        self.idle.set()

    def _answer_all(self, infos: None, why: str) -> None:
        for request in (*self.behind, *self.waiting):
            self._reply(request, infos, why)
        self.behind, self.waiting = [], []

    def _reply(
        self, request: _Request, infos: list[ScheduleInfo | None] | None, why: str = ""
    ) -> None:
        properties = amqp.Properties(content_type=_JSON, correlation_id=request.correlation_id)
        reply = (request.reply_to, encode_answer(infos, why), properties.encode())
        if infos is not None:
            self.server.answered += 1
        self.unsent.append(reply)
        self._send_replies()

    def _send_replies(self) -> None:
        """Publish the replies not sent yet, or open the replies' connection anew first."""
        if not self.unsent:
            return
        channel = self.replies
        if channel is None or not channel.is_open:
            self._reopen_replies()
            return
        while self.unsent:
            reply_to, body, properties = self.unsent[0]
            try:
                channel.publish("", reply_to, body, properties, mandatory=False)
            except (ChannelClosedError, BrokerConnectionLost):
                self._reopen_replies()
                return
            self.unsent.pop(0)


class LookupAsker:
    """Look-up requests over one connection: a channel of its own (publisher confirms,
    so that a request no relay takes comes back at once) that consumes direct reply-to.
    Open one with ``await LookupAsker.open(connection)``; a Scheduler keeps one per
    connection."""

    def __init__(self, channel: amqp.Channel, exchange: str) -> None:
        self.channel = channel
        self.exchange = exchange
        self._waiting: dict[str, asyncio.Future[bytes]] = {}

    @classmethod
    async def open(cls, connection: amqp.Connection, exchange: str) -> LookupAsker:
        """``exchange``: ``Topology.lookups``.

        Raises: BrokerConnectionLost, ChannelClosedError (the broker refused).
        """
        channel = await connection.channel()
        await channel.confirm_select()
        asker = cls(channel, exchange)
        await channel.consume(_REPLY_TO, asker._replied, lambda _: None, no_ack=True)
        return asker

    def usable_on(self, connection: amqp.Connection) -> bool:
        return self.channel.is_open and self.channel.connection is connection

    def _replied(self, delivery: amqp.Delivery) -> None:
        properties = delivery.properties
        key = properties.correlation_id if properties is not None else None
        waiter = self._waiting.pop(key or "", None)
        if waiter is not None and not waiter.done():
            waiter.set_result(delivery.body)

    async def ask(
        self, ids: Sequence[str], timeout_s: float
    ) -> dict[str, ScheduleInfo | None] | None:
        """What the journal says of ``ids`` (at most ``MAX_IDS``), from a relay: each
        id -> its info (``pending_copies`` None), or None if no relay answered within
        ``timeout_s`` seconds (none answers look-ups, one is catching up, the login may
        not write to ``{prefix}.lookups``, a 404 or 403 that closed this channel): then
        read the journal.

        Raises:
            BrokerConnectionLost: the connection went.
        """
        key = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        replied: asyncio.Future[bytes] = loop.create_future()
        routed: asyncio.Future[amqp.Outcome] = loop.create_future()

        def confirmed(outcome: amqp.Outcome, _: Any) -> None:
            if not routed.done():
                routed.set_result(outcome)

        properties = amqp.Properties(
            content_type=_JSON,
            correlation_id=key,
            reply_to=_REPLY_TO,
            expiration=str(max(1, int(timeout_s * 1000))),  # not answered after: dropped
        )
        self._waiting[key] = replied
        try:
            self.channel.publish(
                self.exchange, "", encode_request(ids), properties.encode(), callback=confirmed
            )
            async with asyncio.timeout(timeout_s):
                if await routed is not amqp.Outcome.ACK:
                    return None  # returned: no relay answers look-ups; closed: 404, 403
                body = await replied
        except (TimeoutError, ChannelClosedError):
            return None
        finally:
            self._waiting.pop(key, None)
        try:
            answer = decode_answer(body, ids)
        except ValueError as error:
            log.warning("a relay's look-up answer does not read (%s): reading the journal", error)
            return None
        return None if isinstance(answer, str) else answer
