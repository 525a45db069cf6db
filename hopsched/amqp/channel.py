"""An AMQP channel: confirmed publishing, consuming, acks and the methods around them.

Publishing and delivery run on callbacks, not tasks: a delivery reaches its consumer
callback, and a publisher confirm its publish's callback, inside the read that
brought it. That keeps the relay's cost per message near the codec's
(``hopsched.amqp.wire``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands
from pamqp.base import Frame

from hopsched.amqp.wire import (
    FRAME_BODY,
    FRAME_HEADER,
    FRAME_METHOD,
    FrameError,
    Properties,
    ack_frame,
    content_frames,
    credit_consume_frame,
    decode_confirm,
    decode_content_header,
    decode_deliver,
    decode_method,
    method_frame,
    method_id,
    nack_frame,
    publish_method,
)
from hopsched.errors import BrokerConnectionLost, ChannelClosedError

if TYPE_CHECKING:
    from hopsched.amqp.connection import Connection

__all__ = ["Channel", "ConfirmCallback", "Delivery", "Outcome", "Returned"]

log = logging.getLogger("hopsched.amqp")

_DELIVER, _ACK, _NACK, _RETURN, _CANCEL = (60, 60), (60, 80), (60, 120), (60, 50), (60, 30)
_CLOSE, _CLOSE_OK, _FLOW = (20, 40), (20, 41), (20, 20)


class Outcome(enum.Enum):
    """How a publish ended."""

    ACK = "ack"  #: the broker took responsibility for the message
    NACK = "nack"  #: the broker refused it (e.g. a queue full with reject-publish)
    RETURNED = "returned"  #: ``mandatory`` and no queue was bound (detail: ``Returned``)
    CLOSED = "closed"  #: the channel or connection closed first (detail: the error)
    #: no answer within the publish's ``silence_s`` while the broker answered a later
    #: publish on its channel: its queue neither confirms nor nacks (a frozen quorum
    #: leader); it may still be confirmed, and its message delivered, later
    SILENT = "silent"


class Returned:
    """The broker's ``basic.return`` for a publish: why it routed nowhere."""

    __slots__ = ("reply_code", "reply_text")

    def __init__(self, reply_code: int, reply_text: str) -> None:
        self.reply_code = reply_code
        self.reply_text = reply_text

    def __repr__(self) -> str:
        return f"Returned({self.reply_code} {self.reply_text})"


#: Called once per confirmed-mode publish: ``(outcome, detail)``, where detail is a
#: ``Returned`` for RETURNED, the error for CLOSED, else None.
ConfirmCallback = Callable[[Outcome, Any], None]


class Delivery:
    """A message from ``basic.deliver``.

    Attributes:
        properties: the decoded properties, or None if they could not be decoded
            (then ``error`` says why and ``raw_properties`` holds them as received).
        raw_properties: the properties as encoded on the wire (flags first).
    """

    __slots__ = (
        "body",
        "channel",
        "delivery_tag",
        "error",
        "exchange",
        "properties",
        "raw_properties",
        "redelivered",
        "routing_key",
    )

    def __init__(
        self,
        channel: Channel,
        delivery_tag: int,
        redelivered: bool,
        exchange: str,
        routing_key: str,
    ) -> None:
        self.channel = channel
        self.delivery_tag = delivery_tag
        self.redelivered = redelivered
        self.exchange = exchange
        self.routing_key = routing_key
        self.properties: Properties | None = None
        self.raw_properties = b""
        self.error: str | None = None
        self.body = b""


class _Pending:
    __slots__ = ("body", "callback", "exchange", "properties", "returned", "routing_key")

    def __init__(
        self,
        callback: ConfirmCallback | None,
        exchange: str,
        routing_key: str,
        properties: bytes,
        body: bytes,
    ) -> None:
        self.callback = callback
        self.exchange = exchange
        self.routing_key = routing_key
        self.properties = properties
        self.body = body
        self.returned: Returned | None = None


class _Incoming:
    """A content-bearing method (deliver or return) waiting for its header and body."""

    __slots__ = ("chunks", "consumer_tag", "delivery", "received", "returned", "size")

    def __init__(self, delivery: Delivery, consumer_tag: str, returned: Returned | None) -> None:
        self.delivery = delivery
        self.consumer_tag = consumer_tag
        self.returned = returned
        self.size = 0
        self.received = 0
        self.chunks: list[bytes] = []


class Channel:
    """One AMQP channel of a ``Connection``; open one with ``connection.channel()``.

    Attributes:
        closed: done once the channel is closed; its result is the reason
            (``ChannelClosedError`` from the broker, or ``BrokerConnectionLost``).
    """

    def __init__(self, connection: Connection, number: int) -> None:
        self.connection = connection
        self.number = number
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[ChannelClosedError | BrokerConnectionLost] = (
            self._loop.create_future()
        )
        self._error: ChannelClosedError | BrokerConnectionLost | None = None
        self._rpc_lock = asyncio.Lock()
        #: The answers awaited: the names a method's answer may have, its consumer tag
        #: (consume, cancel) and the future, oldest first. A caller that gave up
        #: (cancelled) leaves its future, cancelled, so that its answer, when it comes,
        #: goes to no one rather than to the next call; and the answer goes to the oldest
        #: entry it fits, not the oldest: RabbitMQ 3.10 sends a consume-ok after the
        #: answer to a method sent after the consume (seen with a consume given up).
        self._rpc_waiters: list[tuple[tuple[str, ...], str | None, asyncio.Future[Frame]]] = []
        #: Consumers whose consume was given up (cancelled) and then cancelled in turn:
        #: their no_ack flag, for what the broker sent them meanwhile.
        self._abandoned: dict[str, bool] = {}
        self._confirming = False
        self._next_seq = 1
        self._unconfirmed: dict[int, _Pending] = {}
        self._order: deque[int] = deque()
        self._consumers: dict[str, tuple[Callable[[Delivery], None], Callable[[str], None]]] = {}
        self._incoming: _Incoming | None = None
        self._flow_active = True
        self._held: list[bytes] = []
        self._close_sent = False

    @property
    def is_open(self) -> bool:
        return self._error is None

    @property
    def unconfirmed(self) -> int:
        """Publishes awaiting their confirm."""
        return len(self._unconfirmed)

    # --- methods with a reply --------------------------------------------------------------

    async def call(self, method: Frame, encoded: bytes | None = None) -> Frame:
        """Send a synchronous method and return the broker's reply (``*Ok``);
        ``encoded``: its frame, encoded already (what pamqp cannot encode).

        Raises:
            ChannelClosedError: the broker closed the channel in reply (e.g. 404, 406).
            BrokerConnectionLost: the connection went.
        """
        async with self._rpc_lock:
            if self._error is not None:
                raise self._error.with_traceback(None)  # one instance, raised again and again
            waiter: asyncio.Future[Frame] = self._loop.create_future()
            self._rpc_waiters.append(_awaiting(method, waiter))
            if isinstance(method, commands.Channel.Close):
                self._close_sent = True
            self.connection.send(encoded or method_frame(self.number, method))
            return await waiter  # cancelled: its answer is dropped when it comes

    def _send_unawaited(self, method: Frame) -> None:
        """Send a synchronous method whose answer no one awaits (it is dropped)."""
        if self._error is None:
            orphan: asyncio.Future[Frame] = self._loop.create_future()
            orphan.cancel()
            self._rpc_waiters.append(_awaiting(method, orphan))
            self.connection.send(method_frame(self.number, method))

    async def confirm_select(self) -> None:
        """Turn on publisher confirms (https://www.rabbitmq.com/docs/confirms)."""
        await self.call(commands.Confirm.Select())
        self._confirming = True

    async def qos(self, prefetch_count: int) -> None:
        """Per-consumer prefetch (``basic.qos``, global=false: quorum queues refuse global)."""
        await self.call(commands.Basic.Qos(prefetch_count=prefetch_count))

    async def consume(
        self,
        queue: str,
        on_delivery: Callable[[Delivery], None],
        on_cancel: Callable[[str], None],
        *,
        arguments: dict[str, Any] | None = None,
        no_ack: bool = False,
        credit: int | None = None,
    ) -> str:
        """Consume ``queue`` (with manual acks unless ``no_ack``); returns the consumer tag.

        ``on_delivery`` runs for each message inside the read that brought it;
        ``on_cancel`` runs with the tag if the broker cancels the consumer (the
        queue was deleted, or its leader moved: consumer cancel notification,
        https://www.rabbitmq.com/docs/consumer-cancel). ``credit`` (manual acks, no
        ``arguments``): RabbitMQ 3.x's ``x-credit``, at most that many deliveries
        (``wire.credit_consume_frame``); 4.x ignores it.
        """
        tag = f"hopsched-{uuid.uuid4().hex[:16]}"
        method = commands.Basic.Consume(
            queue=queue, consumer_tag=tag, no_ack=no_ack, arguments=arguments or {}
        )
        encoded = None
        if credit is not None:
            if no_ack or arguments:
                raise ValueError("a consumer with credit takes manual acks and no arguments")
            encoded = credit_consume_frame(self.number, queue, tag, credit)
        # Registered before consume-ok: deliveries may follow it in the same read.
        self._consumers[tag] = (on_delivery, on_cancel)
        try:
            await self.call(method, encoded)
        except asyncio.CancelledError:
            # Given up mid-way: the broker starts it all the same. It is cancelled once
            # its consume-ok comes (``_method``: a cancel before then crashes RabbitMQ
            # 3.10.8's channel, 541), and what it is sent meanwhile handed back.
            self._consumers.pop(tag, None)
            self._abandoned[tag] = no_ack
            raise
        except BaseException:
            self._consumers.pop(tag, None)
            raise
        return tag

    async def cancel(self, consumer_tag: str) -> None:
        """Stop a consumer; deliveries already sent still reach its callback."""
        try:
            await self.call(commands.Basic.Cancel(consumer_tag=consumer_tag))
        finally:
            self._consumers.pop(consumer_tag, None)

    # --- publishing and acks ---------------------------------------------------------------

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: bytes,
        *,
        mandatory: bool = True,
        callback: ConfirmCallback | None = None,
    ) -> None:
        """Publish; with confirms on, ``callback(outcome, detail)`` runs once it is known.

        Args:
            properties: encoded (``Properties.encode()``).

        Raises:
            ValueError: the properties do not fit in one frame (checked before sending).
            ChannelClosedError, BrokerConnectionLost: the channel is closed.
        """
        if self._error is not None:
            raise self._error.with_traceback(None)  # else each raise adds to its traceback
        frames = publish_method(self.number, exchange, routing_key, mandatory) + content_frames(
            self.number, properties, body, self.connection.frame_max
        )
        if self._confirming:
            seq = self._next_seq
            self._next_seq = seq + 1
            self._unconfirmed[seq] = _Pending(callback, exchange, routing_key, properties, body)
            self._order.append(seq)
        if self._flow_active:
            self.connection.send(frames)
        else:
            self._held.append(frames)

    def ack(self, delivery_tag: int, *, multiple: bool = False, lazy: bool = False) -> None:
        """Acknowledge a delivery (or all up to it); ``lazy``: sent with the connection's
        next write, ``LAZY_SEND_S`` later at the latest (``Connection.send``). Ignored once
        the channel is closed: the broker then requeues what was unacknowledged."""
        if self._error is None:
            self.connection.send(ack_frame(self.number, delivery_tag, multiple), lazy=lazy)

    def nack(self, delivery_tag: int, *, requeue: bool) -> None:
        if self._error is None:
            self.connection.send(nack_frame(self.number, delivery_tag, False, requeue))

    # --- closing ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the channel (``channel.close``); a no-op if it is already closed."""
        if self._error is not None:
            return
        try:
            await self.call(
                commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0)
            )
        except (ChannelClosedError, BrokerConnectionLost):
            # Closed meanwhile: with the connection, or by the broker (which then answers
            # our close too; that close-ok frees the number, see _method).
            return
        self._shutdown(ChannelClosedError(200, "closed by hopsched"))
        self.connection.channel_released(self.number)

    def connection_lost(self, error: BrokerConnectionLost) -> None:
        self._shutdown(error)

    def _shutdown(self, error: ChannelClosedError | BrokerConnectionLost) -> None:
        if self._error is not None:
            return
        self._error = error
        waiters, self._rpc_waiters = self._rpc_waiters, []
        for _, _, waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)
        pending = [self._unconfirmed[seq] for seq in self._order if seq in self._unconfirmed]
        self._unconfirmed.clear()
        self._order.clear()
        self._held.clear()
        for entry in pending:
            self._settle(entry, Outcome.CLOSED, error)
        if not self.closed.done():
            self.closed.set_result(error)

    # --- incoming frames -------------------------------------------------------------------

    def frame_received(self, kind: int, payload: bytes) -> None:
        """Handle one frame for this channel (called by the connection)."""
        try:
            if kind == FRAME_METHOD:
                self._method(payload)
            elif kind == FRAME_HEADER:
                self._content_header(payload)
            elif kind == FRAME_BODY:
                self._content_body(payload)
        except FrameError as error:
            self.connection._fail(f"channel {self.number}: {error}")

    def _method(self, payload: bytes) -> None:
        ident = method_id(payload)
        if ident == _DELIVER:
            consumer_tag, tag, redelivered, exchange, routing_key = decode_deliver(payload)
            delivery = Delivery(self, tag, redelivered, exchange, routing_key)
            self._incoming = _Incoming(delivery, consumer_tag, None)
        elif ident == _ACK:
            self._confirmed(*decode_confirm(payload), Outcome.ACK)
        elif ident == _NACK:
            self._confirmed(*decode_confirm(payload), Outcome.NACK)
        elif ident == _RETURN:
            method = decode_method(payload)
            assert isinstance(method, commands.Basic.Return)
            delivery = Delivery(self, 0, False, method.exchange or "", method.routing_key or "")
            self._incoming = _Incoming(
                delivery, "", Returned(method.reply_code or 0, method.reply_text or "")
            )
        elif ident == _CANCEL:
            self._cancelled_by_broker(decode_method(payload))
        elif ident == _CLOSE:
            method = decode_method(payload)
            assert isinstance(method, commands.Channel.Close)
            self.connection.send(method_frame(self.number, commands.Channel.CloseOk()))
            self._shutdown(
                ChannelClosedError(
                    method.reply_code or 0,
                    method.reply_text or "",
                    method.class_id or 0,
                    method.method_id or 0,
                )
            )
            if not self._close_sent:
                self.connection.channel_released(self.number)
            # else our channel.close crossed the broker's: RabbitMQ answers it with a
            # close-ok after this (its reader, for a channel it is closing), and a channel
            # reopened on this number meanwhile would take that close-ok for its open-ok.
        elif ident == _FLOW:
            method = decode_method(payload)
            assert isinstance(method, commands.Channel.Flow)
            self._flow(bool(method.active))
        else:
            response = decode_method(payload)
            waiter = self._take_waiter(response)
            if waiter is not None:
                if not waiter.done():  # else its caller gave up: the answer goes to no one
                    waiter.set_result(response)
                elif (
                    isinstance(response, commands.Basic.ConsumeOk)
                    and (response.consumer_tag or "") in self._abandoned
                ):
                    self._send_unawaited(commands.Basic.Cancel(consumer_tag=response.consumer_tag))
            elif ident == _CLOSE_OK:
                if self._close_sent:  # the broker's answer to our crossing close (above)
                    self.connection.channel_released(self.number)
            else:
                log.warning("channel %d: unexpected %s", self.number, response.name)

    def _take_waiter(self, response: Frame) -> asyncio.Future[Frame] | None:
        """The oldest waiter ``response`` answers, taken off the list; None if none."""
        tag = _consumer_tag(response)
        for index, (names, wanted, waiter) in enumerate(self._rpc_waiters):
            if response.name in names and (tag is None or wanted is None or tag == wanted):
                del self._rpc_waiters[index]
                return waiter
        return None

    def _content_header(self, payload: bytes) -> None:
        incoming = self._incoming
        if incoming is None:
            raise FrameError("content header without a method")
        delivery = incoming.delivery
        delivery.raw_properties = payload[12:]
        try:
            incoming.size, delivery.properties = decode_content_header(payload)
        except FrameError as error:  # the message is still delivered, for parking as is
            incoming.size = int.from_bytes(payload[4:12], "big")
            delivery.error = str(error)
        if incoming.size == 0:
            self._content_done(incoming, b"")

    def _content_body(self, payload: bytes) -> None:
        incoming = self._incoming
        if incoming is None:
            raise FrameError("content body without a method")
        incoming.chunks.append(payload)
        incoming.received += len(payload)
        if incoming.received >= incoming.size:
            chunks = incoming.chunks
            self._content_done(incoming, chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def _content_done(self, incoming: _Incoming, body: bytes) -> None:
        self._incoming = None
        delivery = incoming.delivery
        delivery.body = body
        if incoming.returned is not None:
            self._match_return(delivery, incoming.returned)
            return
        consumer = self._consumers.get(incoming.consumer_tag)
        if consumer is None and incoming.consumer_tag in self._abandoned:
            if not self._abandoned[incoming.consumer_tag]:  # back to the queue, for others
                self.nack(delivery.delivery_tag, requeue=True)
            return
        if consumer is None:
            log.warning(
                "channel %d: delivery for unknown consumer %r", self.number, incoming.consumer_tag
            )
            return
        try:
            consumer[0](delivery)
        except Exception:
            log.exception("channel %d: the delivery callback failed", self.number)

    def _cancelled_by_broker(self, method: Frame) -> None:
        assert isinstance(method, commands.Basic.Cancel)
        tag = method.consumer_tag or ""
        consumer = self._consumers.pop(tag, None)
        # RabbitMQ >= 4.3 waits for an answer when it says so; older brokers close the
        # channel on an unexpected cancel-ok.
        capabilities = self.connection.server_properties.get("capabilities") or {}
        if consumer is not None and capabilities.get("accept_consumer_cancel_ok"):
            self.connection.send(
                method_frame(self.number, commands.Basic.CancelOk(consumer_tag=tag))
            )
        if consumer is not None:
            try:
                consumer[1](tag)
            except Exception:
                log.exception("channel %d: the cancel callback failed", self.number)

    def _flow(self, active: bool) -> None:
        self.connection.send(method_frame(self.number, commands.Channel.FlowOk(active=active)))
        self._flow_active = active
        if active and self._held:
            for frames in self._held:
                self.connection.send(frames)
            self._held.clear()

    # --- confirms --------------------------------------------------------------------------

    def _confirmed(self, tag: int, multiple: bool, outcome: Outcome) -> None:
        unconfirmed, order = self._unconfirmed, self._order
        if multiple:
            done = []
            while order and order[0] <= tag:
                entry = unconfirmed.pop(order.popleft(), None)
                if entry is not None:
                    done.append(entry)
        else:
            entry = unconfirmed.pop(tag, None)
            done = [entry] if entry is not None else []
            while order and order[0] not in unconfirmed:
                order.popleft()
        for entry in done:
            if entry.returned is not None and outcome is Outcome.ACK:
                self._settle(entry, Outcome.RETURNED, entry.returned)
            else:
                self._settle(entry, outcome, None)

    def _settle(self, entry: _Pending, outcome: Outcome, detail: Any) -> None:
        """Run a publish's callback. One that raises is logged, as a delivery callback
        is: raised into ``data_received`` it would drop the connection, and with it
        the outcomes of the other publishes that the same ack settles."""
        if entry.callback is None:
            return
        try:
            entry.callback(outcome, detail)
        except Exception:
            log.exception("channel %d: a publish callback failed", self.number)

    def _match_return(self, message: Delivery, returned: Returned) -> None:
        """Pin a ``basic.return`` on its publish: the oldest unconfirmed one with the same
        target and content. The broker sends the return before that publish's ack
        (https://www.rabbitmq.com/docs/confirms#when-publishes-are-confirmed), and
        matching by content rather than ``message_id`` keeps publishes that share an id
        independent."""
        candidates = [
            self._unconfirmed[seq]
            for seq in self._order
            if seq in self._unconfirmed and self._unconfirmed[seq].returned is None
        ]
        same_target = [
            entry
            for entry in candidates
            if entry.exchange == message.exchange and entry.routing_key == message.routing_key
        ]
        for entry in same_target:
            if entry.body == message.body and entry.properties == message.raw_properties:
                entry.returned = returned
                return
        for entry in same_target:
            if entry.body == message.body:
                entry.returned = returned
                return
        if same_target:
            same_target[0].returned = returned
            return
        log.warning(
            "channel %d: a returned message matches no publish in flight (%s)",
            self.number,
            returned,
        )


def _consumer_tag(method: Frame) -> str | None:
    """The consumer tag of a consume, a cancel or their answers; None for others."""
    if isinstance(
        method,
        commands.Basic.Consume
        | commands.Basic.ConsumeOk
        | commands.Basic.Cancel
        | commands.Basic.CancelOk,
    ):
        return method.consumer_tag or ""
    return None


def _awaiting(
    method: Frame, waiter: asyncio.Future[Frame]
) -> tuple[tuple[str, ...], str | None, asyncio.Future[Frame]]:
    """A waiter list entry for ``method``: the names of its answers (pamqp's), its tag."""
    return (tuple(getattr(method, "valid_responses", ())), _consumer_tag(method), waiter)
