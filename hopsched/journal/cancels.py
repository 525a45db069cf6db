"""A relay's reading of ``{prefix}.cancelled``: the I/O around ``hopsched.core.cancel``.

``CancelReader`` belongs to a relay and outlives its connections: each new connection
resumes the stream at the offset the last one reached (the first starts at the
stream's first record), unless the stream is not the one read before (deleted and
declared again, e.g. by a teardown and a relay starting): then it reads the new one from
its start. ``follow`` returns only once the reading has caught up with every record
written before it was called. A relay must not deliver a message for
want of a cancel it had not read, so it consumes its queue only after that.

Every record is checked (``Signatures.check_record``) before it is applied; one that
fails is ignored and counted in a ``RecordTally``, as is a whole stream message that a
relay *delivered* there (it carries ``x-hopsched-id``: a target routed into the stream
through a binding hopsched cannot see). ``tally_records`` reads the whole stream the
same way for ``hopsched status``.

A relay's reader also restores a stream declared anew (``needs_restore``: deleted, say,
while the journal lived on): before ``follow`` returns it copies the journal's copies of
the stream's messages (``CANCEL_COPY`` records, which every writer of the stream adds
once the stream confirmed a write) back into it, then a ``RESTORED`` notice, and reads
up to that notice; so cancels confirmed before the deletion hold again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any

from hopsched import amqp
from hopsched.amqp.acks import Acker
from hopsched.amqp.publisher import LADDER_LANE, Publisher
from hopsched.connect import Connector
from hopsched.core.cancel import (
    HANDED_BACK,
    MARKER,
    NOTICES,
    OWN_EVERY,
    PARKED,
    RESTORED,
    Cancellations,
    Record,
    RecordTally,
    decode_records,
    encode_records,
)
from hopsched.core.clock import now_us
from hopsched.core.envelope import HEADER_ID
from hopsched.core.signing import Refusal, Signatures
from hopsched.errors import (
    AccessRefusedError,
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
    HopschedError,
)
from hopsched.journal.records import CANCEL_COPY, CANCEL_COPY_ID, JournalRecord
from hopsched.journal.stream import read_journal
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = [
    "CATCH_UP_TIMEOUT_S",
    "RELAYED",
    "CancelReader",
    "handed_back_reasons",
    "journal_copies",
    "tally_records",
]

log = logging.getLogger("hopsched.relay")

#: Stream messages read ahead of their acks (a stream consumer needs a prefetch); each
#: holds up to 1,000 records.
_PREFETCH = 2000
_PERSISTENT = amqp.Properties(delivery_mode=2)

#: ``RecordTally.refused`` key: a stream message a relay delivered there (a target bound
#: to the stream), whose records are ignored.
RELAYED = "relayed"

#: How long ``follow`` waits to read its marker back, s. 1,000,000 records take ~6 s
#: here; a stream consumer that gets nothing for this long (seen on RabbitMQ 3.10 when
#: the stream's leader moved during a rolling restart) is given up, and the relay
#: connects again rather than wait for ever without consuming.
CATCH_UP_TIMEOUT_S = 60.0


class CancelReader:
    """Follows one prefix's cancellation stream into ``cancellations``.

    Args:
        stream: the stream's name, ``{prefix}.cancelled``.
        cancellations: where each record read is applied (None: count them only).
        clock: µs since the epoch (the marker's instant).
        signatures: the keys records are checked with, and whether one is required.
        tally: where the records read are counted, by signature.
        journal: a relay's settings, whose journal it restores a stream declared anew
            from (``needs_restore``); None (``hopsched status``): it only tells.
        user_id: the login set on the records it writes (``Settings.owner``): the
            relays apply its restores and lineage claims with the scope they name.
    """

    def __init__(
        self,
        stream: str,
        cancellations: Cancellations | None,
        clock: Callable[[], int],
        signatures: Signatures,
        tally: RecordTally,
        *,
        journal: Settings | None = None,
        user_id: str | None = None,
    ) -> None:
        self.stream = stream
        self.properties = _PERSISTENT.replace(user_id=user_id).encode()
        self.cancellations = cancellations
        self.clock = clock
        self.signatures = signatures
        self.tally = tally
        self._offset: int | str = "first"  # where the next connection resumes
        # (offset, body digest) of the first stream message read: which stream this is
        self._first: tuple[int, bytes] | None = None
        #: schedule id -> reason of the handed-back notices read (``handed_back_reasons``)
        self.handed_back: dict[str, str] | None = None
        self.journal = journal
        #: set once a ``RESTORED`` notice is read from this stream (cleared for a new one)
        self.restored = asyncio.Event()

    async def follow(
        self,
        connection: amqp.Connection,
        publisher: Publisher,
        on_record: Callable[[str], None],
    ) -> asyncio.Future[None]:
        """Consume the stream on a channel of ``connection`` and return once every record
        written before this call is read; then go on following it. ``on_record(id)`` is
        called after each record (not markers) is applied.

        A marker record of this call's own, written through ``publisher`` and read back,
        says the reading has caught up.

        Returns:
            A future that completes if the broker cancels the reading (the stream was
            deleted): the caller starts over on a new connection.

        Raises:
            BrokerUnavailableError: the stream did not take the marker (nack, return).
            BrokerConnectionLost, ChannelClosedError: the connection or the channel went
                (e.g. the stream is down: 404 on consume).
            AccessRefusedError: 403: the user may not read the stream, or write the marker
                through the default exchange; names the permission.
        """
        marker = uuid.uuid4().hex
        caught_up = asyncio.Event()
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The marker goes first: a reading that starts at any offset this stream had
        # before reads it, and a stream declared anew holds at least it (see _same_stream).
        try:
            await self._write_marker(publisher, marker)
        except ChannelClosedError as error:
            if error.reply_code == 403:
                raise _refused(
                    error, f"write permission on amq.default (to append to {self.stream})"
                ) from None
            raise
        if self._offset != "first" and not await self._same_stream(connection):
            log.warning(
                "%s is not the stream this relay read before (deleted and declared again, "
                "e.g. by a teardown): reading it from its start",
                self.stream,
            )
            self._offset, self._first = "first", None
            self.restored.clear()
        channel = await connection.channel()
        await channel.qos(_PREFETCH)
        acker = Acker(channel)
        read = 0

        def received(delivery: amqp.Delivery) -> None:
            nonlocal read
            acker.received(delivery.delivery_tag)
            acker.done(delivery.delivery_tag)
            headers = delivery.properties.headers if delivery.properties is not None else None
            offset = headers.get("x-stream-offset") if headers is not None else None
            if type(offset) is int:
                if self._first is None:
                    self._first = (offset, _digest(delivery.body))
                self._offset = offset + 1
            if headers is not None and HEADER_ID in headers:
                self.tally.refused[RELAYED] += 1  # a relay delivered it here: no record
                return
            # who wrote it, as the broker checked (https://www.rabbitmq.com/docs/validated-user-id)
            user = delivery.properties.user_id if delivery.properties is not None else None
            for record in decode_records(delivery.body, user):
                if record.op == MARKER:
                    if record.schedule_id == marker:
                        caught_up.set()
                    continue
                checked = self.signatures.check_record(record)
                if isinstance(checked, Refusal):
                    self.tally.refused[checked.kind] += 1
                    continue
                self.tally.count(checked if self.signatures.enabled else record)
                if checked.op == HANDED_BACK and self.handed_back is not None:
                    self.handed_back[checked.schedule_id] = checked.reason or "?"
                elif checked.op == RESTORED:
                    self.restored.set()
                if checked.op in NOTICES or self.cancellations is None:
                    continue
                self.cancellations.apply(checked)
                read += 1
                on_record(checked.schedule_id)

        def cancelled(_: Any) -> None:
            if not lost.done():
                lost.set_result(None)

        try:
            await channel.consume(
                self.stream, received, cancelled, arguments={"x-stream-offset": self._offset}
            )
        except ChannelClosedError as error:
            if error.reply_code == 403:
                raise _refused(error, f"read permission on {self.stream}") from None
            raise
        started = time.monotonic()
        await self._until(caught_up, connection, channel, lost, "this relay's marker record")
        log.log(
            logging.INFO if self.cancellations is not None else logging.DEBUG,
            "read %d cancel and reschedule records in %.1f s (%d schedule ids with one in force)",
            read,
            time.monotonic() - started,
            len(self.cancellations or ()),
        )
        if ignored := sum(self.tally.refused.values()):
            log.warning(
                "ignored %d records of %s so far for their signature or origin (%s)",
                ignored,
                self.stream,
                ", ".join(f"{kind} {count}" for kind, count in sorted(self.tally.refused.items())),
            )
        if self.journal is not None and self.needs_restore:
            notice = await self._restore(publisher)
            if notice is not None:
                await self._until(notice, connection, channel, lost, "the restored notice")
        return lost

    @property
    def needs_restore(self) -> bool:
        """Whether the stream read was declared anew and no relay has restored into it
        what the journal kept of the stream's earlier records: its first message is at
        offset 0 (nothing has passed its retention: it may be younger than the prefix)
        and no ``RESTORED`` notice was read."""
        return self._first is not None and self._first[0] == 0 and not self.restored.is_set()

    async def _restore(self, publisher: Publisher) -> asyncio.Event | None:
        """Copy the journal's ``CANCEL_COPY`` records back into the stream, then a
        ``RESTORED`` notice; the event set once the notice is read back. None (logged
        as an ERROR, tried again at the next start) if the journal cannot be read or
        the stream does not take them."""
        assert self.journal is not None
        journal = Topology.from_settings(self.journal).journal_stream
        started = time.monotonic()
        try:
            bodies = await journal_copies(self.journal)
            for body, user in bodies:
                await self._append(publisher, owned(body, user, self.journal.trusted_users))
            notice = Record(RESTORED, uuid.uuid4().hex, self.clock(), kind=str(len(bodies)))
            await self._append(publisher, encode_records([self.signatures.sign_notice(notice)]))
        except (HopschedError, ConnectionError) as error:
            log.error(
                "%s was declared anew (deleted, or a prefix made before this version), and "
                "the cancels and reschedules it held could not be restored from %s (%s): "
                "messages cancelled before may be delivered. `hopsched status` exits 1 "
                "until a relay restores them; this relay tries again when it next starts",
                self.stream,
                journal,
                error,
            )
            return None
        if bodies:
            log.warning(
                "%s was declared anew (deleted, or a prefix made before this version): "
                "restored the %d stream messages of cancels and reschedules that %s kept of "
                "it in %.1f s",
                self.stream,
                len(bodies),
                journal,
                time.monotonic() - started,
            )
        else:  # a new prefix: nothing to say
            log.debug("%s is new and %s holds no cancel to restore into it", self.stream, journal)
        return self.restored

    async def _append(self, publisher: Publisher, body: bytes) -> None:
        """Append one stream message, confirmed."""
        outcome, detail = await publisher.answer(
            LADDER_LANE, "", self.stream, body, self.properties, CATCH_UP_TIMEOUT_S
        )
        if outcome is amqp.Outcome.ACK:
            return
        if isinstance(detail, (ChannelClosedError, BrokerConnectionLost)):
            raise detail
        raise BrokerUnavailableError(f"{self.stream} did not take a record ({outcome.value})")

    async def _until(
        self,
        event: asyncio.Event,
        connection: amqp.Connection,
        channel: amqp.Channel,
        lost: asyncio.Future[None],
        what: str,
    ) -> None:
        """Wait until the reading sets ``event`` (it read ``what`` back).

        Raises:
            BrokerConnectionLost: the broker cancelled the reading (the stream deleted).
            ChannelClosedError, BrokerConnectionLost: the channel or connection went.
            BrokerUnavailableError: nothing came for ``CATCH_UP_TIMEOUT_S``.
        """
        waits: set[asyncio.Future[Any]] = {
            asyncio.ensure_future(event.wait()),
            asyncio.ensure_future(asyncio.shield(connection.closed)),
            asyncio.ensure_future(asyncio.shield(channel.closed)),
            asyncio.ensure_future(asyncio.shield(lost)),
        }
        try:
            await asyncio.wait(
                waits, timeout=CATCH_UP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiting in waits:
                waiting.cancel()
        if event.is_set():
            return
        if lost.done():
            raise BrokerConnectionLost(f"the broker cancelled the reading of {self.stream}")
        if channel.closed.done():
            raise channel.closed.result()
        if connection.closed.done():
            raise connection.closed.result()
        raise BrokerUnavailableError(
            f"{self.stream} gave nothing back for {CATCH_UP_TIMEOUT_S:.0f} s after {what}"
        )

    async def _write_marker(self, publisher: Publisher, marker: str) -> None:
        """Append this reading's marker record and wait for the broker's confirm."""
        record = encode_records([Record(MARKER, marker, self.clock())])
        outcome, detail = await publisher.answer(
            LADDER_LANE, "", self.stream, record, self.properties, CATCH_UP_TIMEOUT_S
        )
        if outcome is amqp.Outcome.ACK:
            return
        if isinstance(detail, (ChannelClosedError, BrokerConnectionLost)):
            raise detail  # e.g. 403: the user may not write there
        raise BrokerUnavailableError(
            f"{self.stream} did not take this relay's marker record ({outcome.value}: {detail})"
        )

    async def _same_stream(self, connection: amqp.Connection) -> bool:
        """Whether the stream's first message is the one this reader read first.

        A stream's offsets only grow and a stream declared anew starts at 0 again, so
        a first message at the same offset with another body, or at a lower offset, is
        another stream (one at a higher offset: the same, its oldest records past their
        retention). The stream holds at least the marker just written: this cannot wait
        for a message that never comes.
        """
        if self._first is None:
            return False
        channel = await connection.channel()
        first: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

        def received(delivery: amqp.Delivery) -> None:
            headers = delivery.properties.headers if delivery.properties is not None else None
            offset = headers.get("x-stream-offset") if headers is not None else None
            if not first.done() and type(offset) is int:
                first.set_result((offset, _digest(delivery.body)))

        try:
            await channel.qos(1)
            await channel.consume(
                self.stream, received, lambda _: None, arguments={"x-stream-offset": "first"}
            )
            closed: asyncio.Future[Any] = asyncio.ensure_future(asyncio.shield(channel.closed))
            await asyncio.wait(
                {first, closed}, timeout=CATCH_UP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            closed.cancel()
            if channel.closed.done():
                raise channel.closed.result()
            if not first.done():
                raise BrokerUnavailableError(
                    f"{self.stream} gave nothing back for {CATCH_UP_TIMEOUT_S:.0f} s"
                )
            offset, digest = first.result()
        finally:
            await channel.close()
        first_offset, first_digest = self._first
        return offset > first_offset or (offset == first_offset and digest == first_digest)

    def claim(
        self,
        publisher: Publisher,
        record: Record,
        outcome: Callable[[amqp.Outcome, Any], None],
    ) -> None:
        """Append a relay's lineage claim (signed), confirmed: ``outcome`` gets the
        confirm. Raises BrokerConnectionLost (nothing sent)."""
        publisher.publish(
            LADDER_LANE, "", self.stream, encode_records([record]), self.properties, outcome
        )

    def note_parked(
        self, publisher: Publisher, schedule_id: str, kind: str, reason: str | None = None
    ) -> None:
        """Append a notice that this relay parked ``schedule_id``'s message for its
        signature or target (``kind``), for ``hopsched status``; or, with ``reason``, that
        it handed it back to be dead-lettered into parking as it is (``HANDED_BACK``), for
        ``hopsched parked list``. Signed with the first key. Not confirmed: a notice lost
        in a crash costs a count or a reason, never a message."""
        op = PARKED if reason is None else HANDED_BACK
        notice = Record(op, schedule_id, self.clock(), kind=kind, reason=reason)
        record = self.signatures.sign_notice(notice)

        def written(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is not amqp.Outcome.ACK:
                log.debug("a parked notice was not written to %s (%s)", self.stream, detail)

        try:
            body = encode_records([record])
            publisher.publish(LADDER_LANE, "", self.stream, body, self.properties, written)
        except BrokerConnectionLost:
            pass


async def handed_back_reasons(settings: Settings) -> dict[str, str]:
    """Why relays handed messages back to ``{prefix}.relay`` to be dead-lettered into
    parking as they were (the broker refused even their parked copy: a body over its
    ``max_message_size``, say): schedule id -> the relay's reason, from the notices in
    the cancel stream (the latest for an id). Raises as ``tally_records``."""
    reasons: dict[str, str] = {}
    await _read_stream(settings, RecordTally(), reasons)
    return reasons


async def journal_copies(settings: Settings) -> list[tuple[bytes, str | None]]:
    """The journal's copies of the cancel stream's messages (``CANCEL_COPY`` records),
    as written, oldest first, each with the user that wrote it (its journal message's
    ``user_id``: the broker checked it; None: unset). Raises as ``read_journal``."""
    bodies: list[tuple[bytes, str | None]] = []

    def copied(record: JournalRecord) -> None:
        if record.op == CANCEL_COPY and record.copy is not None:
            bodies.append((record.copy.body, record.user))

    await read_journal(settings, only=CANCEL_COPY_ID, on_record=copied)
    return bodies


def owned(body: bytes, user: str | None, trusted: Collection[str]) -> bytes:
    """A cancel stream message written by ``user``, as a relay writes it back: each
    unsigned record names the scope it had (``Record.own``: ``user``, ``""`` for none,
    ``OWN_EVERY`` for a trusted user), whatever the body said; signed ones as they are."""
    own = "" if user is None else OWN_EVERY if user in trusted else user
    return encode_records(
        record if record.key_id is not None else dataclasses.replace(record, own=own)
        for record in decode_records(body)
    )


async def tally_records(settings: Settings) -> RecordTally:
    """Read the whole of ``settings``' cancel stream as a relay would, applying nothing:
    every record counted by signature (checked with ``settings.signing_keys``; unsigned
    ones count as ignored with ``require_signatures``, as the relays ignore them then)
    and every relay's notice of a message it parked for its signature or target.

    It writes a marker record, as a relay does, to know where the stream ends (a
    relay's user may write there; a producer's too).

    Raises:
        BrokerUnavailableError: cannot connect, or the stream took no marker (or gave
            nothing back within ``CATCH_UP_TIMEOUT_S``); ChannelClosedError: the stream
            is missing (404); AccessRefusedError: it may not be read or written (403).
    """
    tally = RecordTally(checked=settings.signatures.enabled)
    await _read_stream(settings, tally, None)
    return tally


async def _read_stream(
    settings: Settings, tally: RecordTally, handed_back: dict[str, str] | None
) -> None:
    stream = Topology.from_settings(settings).cancel_stream
    reader = CancelReader(stream, None, now_us, settings.signatures, tally)
    reader.handed_back = handed_back
    connection = await Connector(settings, name="hopsched-status").connect()
    publisher = Publisher(connection)
    try:
        await reader.follow(connection, publisher, lambda _: None)
        tally.unrestored = reader.needs_restore
    finally:
        await publisher.close()
        await connection.close()


def _digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def _refused(error: ChannelClosedError, needs: str) -> AccessRefusedError:
    return AccessRefusedError(f"the broker refused ({error}): this needs {needs}")
