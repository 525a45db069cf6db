"""The I/O around ``hopsched.journal.records``: the one writer of ``{prefix}.journal``
(a relay's batched writes, a Scheduler's awaited ones), and the reading of the whole
stream into a ``JournalFold`` (``get``, ``pending``, ``reschedule``, ``hopsched
status``).

Journal records are never in a message's way: they are written once the broker
confirmed what they tell of, on a lane of their own (a refused stream publish closes
only that channel); the message a record told of is delivered or parked all the same
when its write fails. A relay's records (``JournalWriter.add``) are gathered for
``FLUSH_AFTER_S`` (10 ms, or until a thousand) into one stream message; the acks of
the deliveries and parks they tell of wait for its answer (a second at most), no
message does. A write that fails is logged and counted (``RelayStats.journal_failures``),
and its records are not written. A Scheduler's (``JournalWriter.write``) are published
at once and awaited, so that ``get()`` right after ``schedule()`` knows the schedule;
``write`` gives back the records of a write that failed, which the Scheduler keeps and
writes again (``retry.JournalRetry``; ``Scheduler.journal_backlog``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pamqp import commands

from hopsched import amqp
from hopsched.amqp.acks import Acker
from hopsched.amqp.publisher import Publisher
from hopsched.connect import Connector
from hopsched.errors import (
    AccessRefusedError,
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
    HopschedError,
)
from hopsched.journal.records import (
    MARKER,
    WRITER_OWNED,
    JournalFold,
    JournalRecord,
    decode_journal,
    encode_journal,
    pack_journal,
)
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = [
    "JOURNAL_LANE",
    "JOURNAL_PROPERTIES",
    "READ_TIMEOUT_S",
    "JournalWriter",
    "fold_message",
    "holds_marker",
    "read_journal",
]

log = logging.getLogger("hopsched.journal")

#: The publisher lane journal records go on (not the ladder's: a refused stream publish
#: closes its channel, and every publish in flight on it would be tried again).
JOURNAL_LANE = "journal"
#: Records per stream message at most (a relay's batch, ``schedule_many``'s).
RECORDS_PER_MESSAGE = 1000
#: A relay's records wait this long (s) for others to share their stream write: the
#: broker's work per delivery is what bounds a relay's rate on a shared machine.
FLUSH_AFTER_S = 0.01
#: A batch with this many records waiting on it (``add``'s ``then``) is written without
#: waiting for ``FLUSH_AFTER_S``: a relay's lane never stands still with its
#: ``LANE_HELD`` (128) deliveries waiting for a batch's timer.
WAITING_PER_FLUSH = 128
#: A write with no answer after this long (s) runs its records' ``then`` all the same: a
#: journal that answers nothing (its stream's leader frozen) never holds deliveries up.
THEN_AFTER_S = 1.0
#: How long reading the journal may go without a message before it is given up, s.
READ_TIMEOUT_S = 60.0
#: Seconds between the writes of a marker the broker returned from a stream it knows.
MARKER_RETRY_S = 0.5
_PROPERTIES = amqp.Properties(content_type="application/x-hopsched-journal", delivery_mode=2)
#: A journal stream message's encoded properties (a relay's, a Scheduler's, a marker's).
JOURNAL_PROPERTIES = _PROPERTIES.encode()
#: Stream messages read ahead: 64 of schedule_many's (up to 1,000 records, ~60-170 KB
#: deflated) is ~10 MB; 16 with lazy acks took 4.3 s over 10,000 lone records, 64 with
#: acks at once 2.8 s (then the broker's reading of the stream is what is left).
_PREFETCH = 64


class JournalWriter:
    """Journal records written to one stream through one publisher: a relay session's
    in batches (``add``), a Scheduler's awaited (``write``).

    Args:
        publisher: the session's publisher (a Scheduler's: its journal connection's).
        stream: ``{prefix}.journal``.
        on_result: ``on_result(records, ok)`` after each stream write's outcome (counting).
        user_id: the writer's login (``Settings.owner``), set on each stream message: a
            reader learns who wrote a cancel from it (the broker checked it). None: unset.
        on_returned: ``on_returned(records)`` after a batch of ``add`` came back
            unroutable (no stream of that name: deleted?), its ``then`` run already; a
            relay declares the stream again and adds the records again.
    """

    def __init__(
        self,
        publisher: Publisher,
        stream: str,
        on_result: Callable[[int, bool], None],
        *,
        user_id: str | None = None,
        on_returned: Callable[[list[JournalRecord]], None] | None = None,
    ) -> None:
        self.publisher = publisher
        self.stream = stream
        self.on_result = on_result
        self.on_returned = on_returned
        self.properties = _PROPERTIES.replace(user_id=user_id).encode()
        self._batch: list[JournalRecord] = []
        self._then: list[Callable[[], None]] = []  # of the batch's records
        self._flushing_soon = False
        self._warned = False
        self._in_flight = 0  # stream writes not answered yet
        self._idle: asyncio.Event | None = None

    def add(
        self, record: JournalRecord, then: Callable[[], None] | None = None, *, hurry: bool = False
    ) -> None:
        """Write ``record`` with the others added within ``FLUSH_AFTER_S``; ``then()``
        runs once that write is answered, whatever the answer (a record the stream did
        not take is counted and lost, as a record is), or ``THEN_AFTER_S`` after it was
        sent with no answer, or at once if it could not be sent. A relay acks a
        delivery in ``then``: a crash before its record is written delivers it again
        rather than leave it "held" in the journal for ever. ``hurry``: publishes wait
        for the slot ``then`` frees, so the batch is written once this loop step's
        callbacks have run (every confirm of one read together), not ``FLUSH_AFTER_S``
        later."""
        if not self._batch:
            asyncio.get_running_loop().call_later(FLUSH_AFTER_S, self.flush)
        self._batch.append(record)
        if then is not None:
            self._then.append(then)
        if len(self._batch) >= RECORDS_PER_MESSAGE or len(self._then) >= WAITING_PER_FLUSH:
            self.flush()
        elif hurry and not self._flushing_soon:
            self._flushing_soon = True
            asyncio.get_running_loop().call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flushing_soon = False
        self.flush()

    def flush(self) -> None:
        """Publish the records gathered so far, as one stream message."""
        batch, self._batch = self._batch, []
        then, self._then = self._then, []
        if not batch:
            return
        count = len(batch)
        late: asyncio.TimerHandle | None = None

        def run_then() -> None:
            waiting = then.copy()
            then.clear()  # each runs once: at the answer or at THEN_AFTER_S
            for call in waiting:
                call()

        def written(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.RETURNED and self.on_returned is not None:
                self.on_result(count, False)  # on_returned says what became of them
            else:
                self._answered(count, outcome, detail)
            self._in_flight -= 1
            if late is not None:
                late.cancel()
            run_then()
            if outcome is amqp.Outcome.RETURNED and self.on_returned is not None:
                self.on_returned(batch)
            if not self._in_flight and self._idle is not None:
                self._idle.set()

        if then:
            late = asyncio.get_running_loop().call_later(THEN_AFTER_S, run_then)

        self._in_flight += 1
        try:
            self.publisher.publish(
                JOURNAL_LANE, "", self.stream, pack_journal(batch), self.properties, written
            )
        except (BrokerConnectionLost, ValueError) as error:
            written(amqp.Outcome.CLOSED, error)

    async def write(
        self, records: Sequence[JournalRecord], timeout_s: float
    ) -> tuple[list[JournalRecord], str]:
        """Publish ``records`` at once, a thousand per stream message, and wait for each
        write's answer; one with none within ``timeout_s`` seconds counts as failed.
        Never raises, and logs nothing: each write is counted (``on_result``).

        Returns:
            The records of the writes that failed (empty: all were taken), in order,
            and why the first of those failed ("" if none did).
        """
        batches = [
            records[start : start + RECORDS_PER_MESSAGE]
            for start in range(0, len(records), RECORDS_PER_MESSAGE)
        ]
        answers = [self._answer(batch, timeout_s) for batch in batches]
        if len(answers) == 1:  # a lone schedule()'s write is awaited as it is: no gather
            reasons = [await answers[0]]
        else:
            reasons = await asyncio.gather(*answers)
        failed = [r for batch, why in zip(batches, reasons, strict=True) if why for r in batch]
        return failed, next((why for why in reasons if why), "")

    async def _answer(self, batch: Sequence[JournalRecord], timeout_s: float) -> str:
        """Write ``batch`` as one stream message: "" once taken, else why not."""
        try:
            outcome, detail = await self.publisher.answer(
                JOURNAL_LANE, "", self.stream, pack_journal(batch), self.properties, timeout_s
            )
        except TimeoutError:
            outcome, detail = amqp.Outcome.CLOSED, f"no confirm within {timeout_s:g} s"
        except (HopschedError, ValueError) as error:
            outcome, detail = amqp.Outcome.CLOSED, error
        ok = outcome is amqp.Outcome.ACK
        self.on_result(len(batch), ok)
        if ok:
            return ""
        return f"{outcome.value}: {detail}" if detail else outcome.value

    def _answered(self, count: int, outcome: amqp.Outcome, detail: Any) -> None:
        ok = outcome is amqp.Outcome.ACK
        if not ok and not self._warned:
            self._warned = True  # once per writer: the count goes on in the stats
            log.warning(
                "%s did not take %d journal records (%s: %s): the messages they tell of "
                "are delivered or parked all the same; get() and pending() may not know them",
                self.stream,
                count,
                outcome.value,
                detail or "",
            )
        self.on_result(count, ok)

    async def settled(self) -> None:
        """Write what is gathered and wait until every write has its answer (a relay
        stopping: the last deliveries' records are not left behind)."""
        self.flush()
        if self._in_flight:
            self._idle = asyncio.Event()
            await self._idle.wait()


async def read_journal(
    settings: Settings,
    *,
    only: str | None = None,
    copies: bool = True,
    on_record: Callable[[JournalRecord], None] | None = None,
) -> JournalFold:
    """Read ``settings``' journal from its first record (what retention kept) to its end,
    folded.

    It writes a marker record and reads until it reads the marker back: everything
    confirmed before the call is in the fold.

    Args:
        settings: the broker and prefix.
        only: fold only this schedule id (the others' copies are not even decoded).
        copies: keep the copies of the messages (``reschedule`` needs the one of its id).
        on_record: called with each record read (a listing's progress, tests).

    Raises:
        BrokerUnavailableError: cannot connect, or the stream gave nothing for
            ``READ_TIMEOUT_S``, or routed nothing for as long (a node not yet recovered).
        ChannelClosedError: the journal is missing (404: a prefix declared by a hopsched
            before the journal, or the journal deleted: a relay declares it).
        AccessRefusedError: may not write the marker or read the stream (403).
    """
    stream = Topology.from_settings(settings).journal_stream
    fold = JournalFold(only, trusted=settings.trusted_users)
    marker = uuid.uuid4().hex
    connection = await Connector(settings, name="hopsched-journal").connect()
    publisher = Publisher(connection)
    try:
        await _write_marker(connection, publisher, stream, marker)
        caught_up = asyncio.Event()
        lost = asyncio.Event()  # the broker cancelled the reading (the stream deleted)
        channel = await connection.channel()
        await channel.qos(_PREFETCH)
        acker = Acker(channel, lazy=False)  # its window would wait for lazy acks
        last_read = [time.monotonic()]

        def received(delivery: amqp.Delivery) -> None:
            acker.received(delivery.delivery_tag)
            acker.done(delivery.delivery_tag)
            last_read[0] = time.monotonic()
            user = delivery.properties.user_id if delivery.properties is not None else None
            fold_message(fold, delivery.body, user, copies=copies, only=only, on_record=on_record)
            if holds_marker(delivery.body, marker):
                caught_up.set()

        try:
            await channel.consume(
                stream, received, lambda _: lost.set(), arguments={"x-stream-offset": "first"}
            )
        except ChannelClosedError as error:
            if error.reply_code == 403:
                raise AccessRefusedError(
                    f"the broker refused ({error}): reading the journal needs read "
                    f"permission on {stream}, and asking a relay that answers look-ups "
                    f"write on {settings.prefix}.lookups (both in the operator's grant)"
                ) from None
            raise
        while not caught_up.is_set():
            closed: asyncio.Future[Any] = asyncio.ensure_future(asyncio.shield(channel.closed))
            waiting: asyncio.Future[Any] = asyncio.ensure_future(caught_up.wait())
            await asyncio.wait({closed, waiting}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
            waiting.cancel()
            if channel.closed.done():
                raise channel.closed.result()
            if lost.is_set():
                raise BrokerConnectionLost(f"the broker cancelled the reading of {stream}")
            if time.monotonic() - last_read[0] > READ_TIMEOUT_S:
                raise BrokerUnavailableError(
                    f"{stream} gave nothing back for {READ_TIMEOUT_S:.0f} s while it was read"
                )
    finally:
        await publisher.close()
        await connection.close()
    return fold


def fold_message(
    fold: JournalFold,
    body: bytes,
    user: str | None,
    *,
    copies: bool,
    only: str | None = None,
    on_record: Callable[[JournalRecord], None] | None = None,
) -> None:
    """Apply one journal stream message's records to ``fold``; ``user``: the message's
    ``user_id`` (the broker checked it), the owner of the cancels it records."""
    for record in decode_journal(body, copies=copies, only=only):
        if record.op in WRITER_OWNED:  # whose cancel: the writer the broker checked
            record.user = user
        fold.apply(record)
        if on_record is not None:
            on_record(record)


def holds_marker(body: bytes, marker: str) -> bool:
    """Whether a journal stream message holds the marker record ``marker``."""
    return marker.encode() in body and any(
        r.op == MARKER and r.schedule_id == marker
        for r in decode_journal(body, copies=False, only=marker)
    )


async def _write_marker(
    connection: amqp.Connection, publisher: Publisher, stream: str, marker: str
) -> None:
    """Write the read's end marker to ``stream``, with a confirm.

    A marker returned unroutable means no stream only if a passive declare says so too:
    a node just restarted routes nothing to a stream it has not recovered yet (seen on
    RabbitMQ 4.0.5 seconds after a ``kill -9``), so the marker is written again, every
    ``MARKER_RETRY_S``, for up to ``READ_TIMEOUT_S``."""
    record = encode_journal([JournalRecord(MARKER, marker, 0, 0)])
    deadline = time.monotonic() + READ_TIMEOUT_S
    while True:
        outcome, detail = await publisher.answer(
            JOURNAL_LANE, "", stream, record, JOURNAL_PROPERTIES, READ_TIMEOUT_S
        )
        if outcome is amqp.Outcome.ACK:
            return
        if isinstance(detail, ChannelClosedError) and detail.reply_code == 403:
            raise AccessRefusedError(
                f"the broker refused ({detail}): reading the journal writes a marker to "
                f"{stream} through amq.default (write permission)"
            )
        if isinstance(detail, (ChannelClosedError, BrokerConnectionLost)):
            raise detail
        if outcome is not amqp.Outcome.RETURNED:
            raise BrokerUnavailableError(f"{stream} did not take the marker ({outcome.value})")
        if not await _declared(connection, stream):
            raise ChannelClosedError(
                404,
                f"NOT_FOUND - no stream {stream!r}: the prefix was declared by a hopsched "
                "without a journal, the journal deleted, or the prefix torn down (a relay "
                "declares it at its start or its next journal write; so does `hopsched "
                "declare`)",
            )
        if time.monotonic() + MARKER_RETRY_S > deadline:
            raise BrokerUnavailableError(
                f"{stream} exists but routed no message for {READ_TIMEOUT_S:.0f} s (a node "
                "that has not recovered it since it started?)"
            )
        await asyncio.sleep(MARKER_RETRY_S)


async def _declared(connection: amqp.Connection, stream: str) -> bool:
    """Whether the broker knows ``stream`` (a passive ``queue.declare``): False only for
    its "no queue" 404; another 404 (its node down, not recovered) means it exists."""
    channel = await connection.channel()
    try:
        await channel.call(commands.Queue.Declare(queue=stream, passive=True))
    except ChannelClosedError as error:
        if error.reply_code == 404 and "no queue" in error.reply_text:
            return False
        if error.reply_code != 404:
            raise
    else:
        await channel.close()
    return True
