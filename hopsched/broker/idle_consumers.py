"""Consumers that take nothing: what keeps a quorum queue in use on RabbitMQ 3.x.

A quorum queue's ``expires`` lease counts a consumer (``rabbit_fifo:is_expired``: no
consumer, and no ``basic.get`` for the lease). A consumer given no credit (RabbitMQ 3.x's
``x-credit`` with credit 0, ``hopsched.amqp.wire.credit_consume_frame``) is one that
never gets a message: the queue's messages expire and are dead-lettered on time under
it (measured on 3.10.8: a 2 s TTL dead-lettered at 2.01 s, and the queue outlived an
8 s ``expires``). The alternative, a ``basic.get`` whose message is returned, makes a
busy step's returned head expire up to 8 s late on 3.10.8.

RabbitMQ 4.x ignores ``x-credit`` (measured on 4.0.5: the consumer got every message),
so ``IdleConsumers`` attaches only to brokers older than 4.0 and, should one deliver
anyway, returns that message, cancels, and is not used again: the caller then keeps the
queue in use its other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from hopsched import amqp
from hopsched.connect import Connector
from hopsched.errors import BrokerConnectionLost, ChannelClosedError
from hopsched.settings import Settings

__all__ = ["IdleConsumers", "takes_credit"]

log = logging.getLogger("hopsched.policies")

#: How long cancelling the consumers, then closing the connection, may each take, s (a
#: broker that never answers): within the 2 s a stopping relay gives its policy watch.
CLOSE_TIMEOUT_S = 1.0


def takes_credit(server_properties: dict[str, object]) -> bool:
    """Whether a broker honours ``x-credit`` on ``basic.consume``: RabbitMQ before 4.0
    (``connection.start``'s ``product`` and ``version``)."""
    product = server_properties.get("product")
    version = server_properties.get("version")
    if isinstance(product, bytes):
        product = product.decode(errors="replace")
    if isinstance(version, bytes):
        version = version.decode(errors="replace")
    if product != "RabbitMQ" or not isinstance(version, str):
        return False
    major = re.match(r"(\d+)\.", version)
    return major is not None and int(major.group(1)) < 4


class IdleConsumers:
    """One consumer without credit per queue kept, on a connection of its own.

    Args:
        settings: the relay's settings (its broker URLs).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._connection: amqp.Connection | None = None
        self._channel: amqp.Channel | None = None
        self._tags: dict[str, str] = {}  # queue -> its consumer's tag
        # The broker is RabbitMQ 4.x, or delivered to such a consumer: for good (a broker
        # upgraded to 4.x does not go back), so no connection is kept open for nothing.
        self._refused = False
        self._closing: set[asyncio.Future[None]] = set()

    @property
    def kept(self) -> frozenset[str]:
        """The queues a consumer is on now."""
        return frozenset(self._tags)

    async def keep(self, queue: str) -> bool:
        """Have a consumer without credit on ``queue``; False if this broker cannot
        (RabbitMQ 4.x, or one that delivered to such a consumer): keep it in use
        another way.

        Raises:
            BrokerUnavailableError: the broker cannot be reached.
            ChannelClosedError: it refused the consume (e.g. 404: no such queue).
        """
        channel = await self._open()
        if channel is None:
            return False
        if queue in self._tags:
            return True

        def delivered(delivery: amqp.Delivery) -> None:
            self._delivered(channel, delivery)

        consuming = asyncio.ensure_future(
            channel.consume(queue, delivered, self._cancelled, credit=0)
        )
        try:
            tag = await asyncio.shield(consuming)
            if self._refused:  # it delivered at once: all closed already, or closing
                return False
            self._tags[queue] = tag
        except asyncio.CancelledError:
            # Stopped mid-consume (the relay stopping): the consumer is the broker's all the
            # same, so its tag is kept for close() to cancel.
            with contextlib.suppress(Exception):
                self._tags[queue] = await consuming
            raise
        return True

    async def release(self, queue: str) -> None:
        """Take ``queue``'s consumer off, if it has one."""
        tag = self._tags.pop(queue, None)
        if tag is not None and self._channel is not None:
            with contextlib.suppress(BrokerConnectionLost, ChannelClosedError):
                await self._channel.cancel(tag)

    async def close(self) -> None:
        """Cancel every consumer, then close the connection, within ``CLOSE_TIMEOUT_S``.

        Cancelled one by one first: a quorum queue's ``basic.cancel-ok`` comes once the
        queue has removed the consumer, while one that goes with its connection stays
        in the queue's consumer count for a while after (a ``teardown`` run just after
        a relay stopped would count it and refuse)."""
        connection, channel, tags = self._connection, self._channel, list(self._tags.values())
        self._connection, self._channel = None, None
        self._tags.clear()
        if connection is None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if channel is not None and not channel.closed.done():
                    for tag in tags:
                        await channel.cancel(tag)
        with contextlib.suppress(Exception):
            await connection.close(timeout_s=CLOSE_TIMEOUT_S)

    async def _open(self) -> amqp.Channel | None:
        if self._connection is not None and self._connection.closed.done():
            await self.close()  # its consumers went with it
        if self._refused:
            return None
        if self._connection is None:
            self._connection = await Connector(self.settings, name="hopsched-keep-in-use").connect()
            if not takes_credit(self._connection.server_properties):
                self._refused = True
                await self.close()
                return None
        if self._channel is None or self._channel.closed.done():
            self._tags.clear()
            self._channel = await self._connection.channel()
            await self._channel.qos(1)  # should credit be ignored: one message, not all
        return self._channel

    def _delivered(self, channel: amqp.Channel, delivery: amqp.Delivery) -> None:
        # A broker that gave credit it was not asked for: return the message (its TTL runs
        # on) and stop using consumers on it.
        channel.nack(delivery.delivery_tag, requeue=True)
        if not self._refused:
            self._refused = True
            log.warning(
                "the broker delivered to a consumer given no credit: queues are kept in "
                "use by basic.get instead"
            )
            closing = asyncio.ensure_future(self.close())  # every consumer, at once
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _cancelled(self, tag: str) -> None:
        # The broker cancelled it (the queue deleted, its leader moved): attached again at
        # the next keep.
        for queue, kept in list(self._tags.items()):
            if kept == tag:
                del self._tags[queue]
