"""A relay's reading of ``{prefix}.cancelled``: the I/O around ``hopsched.cancel``.

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
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from hopsched import amqp
from hopsched.acks import Acker
from hopsched.cancel import (
    HANDED_BACK,
    MARKER,
    NOTICES,
    PARKED,
    Cancellations,
    Record,
    RecordTally,
    decode_records,
    encode_records,
)
from hopsched.clock import now_us
from hopsched.connect import Connector
from hopsched.envelope import HEADER_ID
from hopsched.errors import (
    AccessRefusedError,
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
)
from hopsched.publisher import LADDER_LANE, Publisher
from hopsched.settings import Settings
from hopsched.signing import Refusal, Signatures
from hopsched.topology import Topology

__all__ = ["CATCH_UP_TIMEOUT_S", "RELAYED", "CancelReader", "handed_back_reasons", "tally_records"]

log = logging.getLogger("hopsched.relay")

#: Stream messages read ahead of their acks (a stream consumer needs a prefetch); each
#: holds up to 1,000 records.
_PREFETCH = 2000
_PERSISTENT = amqp.Properties(delivery_mode=2).encode()

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
    """

    def __init__(
        self,
        stream: str,
        cancellations: Cancellations | None,
        clock: Callable[[], int],
        signatures: Signatures,
        tally: RecordTally,
    ) -> None:
        self.stream = stream
        self.cancellations = cancellations
        self.clock = clock
        self.signatures = signatures
        self.tally = tally
        self._offset: int | str = "first"  # where the next connection resumes
        # (offset, body digest) of the first stream message read: which stream this is
        self._first: tuple[int, bytes] | None = None
        #: schedule id -> reason of the handed-back notices read (``handed_back_reasons``)
        self.handed_back: dict[str, str] | None = None

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
            for record in decode_records(delivery.body):
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
        waits: set[asyncio.Future[Any]] = {
            asyncio.ensure_future(caught_up.wait()),
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
        if not caught_up.is_set():
            if lost.done():
                raise BrokerConnectionLost(f"the broker cancelled the reading of {self.stream}")
            if channel.closed.done():
                raise channel.closed.result()
            if connection.closed.done():
                raise connection.closed.result()
            raise BrokerUnavailableError(
                f"{self.stream} gave nothing back for {CATCH_UP_TIMEOUT_S:.0f} s after this "
                f"relay's marker record (read {read} records meanwhile)"
            )
        log.log(
            logging.INFO if self.cancellations is not None else logging.DEBUG,
            "read %d cancel and reschedule records in %.1f s (%d pending)",
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
        return lost

    async def _write_marker(self, publisher: Publisher, marker: str) -> None:
        """Append this reading's marker record and wait for the broker's confirm."""
        record = encode_records([Record(MARKER, marker, self.clock())])
        outcome, detail = await publisher.answer(
            LADDER_LANE, "", self.stream, record, _PERSISTENT, CATCH_UP_TIMEOUT_S
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
            LADDER_LANE, "", self.stream, encode_records([record]), _PERSISTENT, outcome
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
            publisher.publish(LADDER_LANE, "", self.stream, body, _PERSISTENT, written)
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
    finally:
        await publisher.close()
        await connection.close()


def _digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def _refused(error: ChannelClosedError, needs: str) -> AccessRefusedError:
    return AccessRefusedError(f"the broker refused ({error}): this needs {needs}")
