"""Confirmed, mandatory publishing that survives the broker closing a channel.

Shared by the Scheduler and the Relay. A publish returns only once the broker has
confirmed it (publisher confirms, https://www.rabbitmq.com/docs/confirms); a
``basic.return`` (no queue bound) raises ``Unroutable``.

A publish to a missing exchange (404) or one the user may not write to (403) makes
the broker close the channel. Every other publish in flight on that channel fails
too, and aiormq may still write frames queued behind the close, which the broker
answers by closing the whole connection (504 CHANNEL_ERROR). So a publish goes on
the shared "fast" channel only to an exchange this publisher has already published
to successfully; the first publish to any other exchange, and every publish whose
channel was closed under it, goes one at a time on a "careful" channel, where a
close can only be its own fault and becomes ``TargetRefused``.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aio_pika
import aiormq
from pamqp.commands import Basic

from hopsched.errors import PublishRejectedError

__all__ = ["ConfirmedPublisher", "TargetRefused", "Unroutable", "with_properties"]

_CHANNEL_GONE = (aiormq.exceptions.ChannelClosed, aiormq.exceptions.ChannelInvalidStateError)


class Unroutable(PublishRejectedError):
    """The broker returned the message: no queue is bound for its routing key."""


class TargetRefused(PublishRejectedError):
    """The broker closed the channel for this publish (missing exchange, access refused)."""


_PROPERTY_NAMES = tuple(Basic.Properties.__slots__)


def with_properties(properties: Basic.Properties, **changes: Any) -> Basic.Properties:
    """A copy of ``properties`` with ``changes`` applied (pamqp attribute names)."""
    # On the relay's hot path: copying the slots directly takes 2.8 us here,
    # copy.copy 6.7 us (it goes through __reduce_ex__).
    result = Basic.Properties.__new__(Basic.Properties)
    for name in _PROPERTY_NAMES:
        setattr(result, name, getattr(properties, name, None))
    for name, value in changes.items():
        setattr(result, name, value)
    return result


class ConfirmedPublisher:
    """Publishes on one connection with publisher confirms and ``mandatory`` set.

    aiormq matches a ``basic.return`` to its publish by ``message_id``, so two
    publishes with the same ``message_id`` are never in flight at once here.
    """

    def __init__(self, connection: aio_pika.abc.AbstractConnection) -> None:
        self._connection = connection
        self._channels: dict[str, aio_pika.abc.AbstractChannel] = {}
        self._open_lock = asyncio.Lock()
        self._careful_lock = asyncio.Lock()
        self._in_flight: dict[str, asyncio.Future[None]] = {}
        # Exchanges a publish has reached on this connection; the default one always exists.
        self._proven_exchanges: set[str] = {""}

    async def _channel(self, role: str) -> aiormq.abc.AbstractChannel:
        channel = self._channels.get(role)
        if channel is None or channel.is_closed:
            async with self._open_lock:
                channel = self._channels.get(role)
                if channel is None or channel.is_closed:
                    channel = await self._connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
                    self._channels[role] = channel
        return await channel.get_underlay_channel()

    async def publish(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> None:
        """Publish and wait for the broker's confirm.

        Args:
            body: message body, bytes.
            properties: AMQP basic properties; a missing ``message_id`` is filled in
                (aiormq would do so anyway).

        Raises:
            Unroutable: returned by the broker (no binding for the routing key).
            TargetRefused: the broker closed the channel for this publish (404 no such
                exchange, 403 access refused, 406 e.g. a ``user_id`` that is not the
                login user); the text says which.
            PublishRejectedError: the broker nacked it.
            aiormq.exceptions.AMQPConnectionError: the connection is gone.
        """
        if not properties.message_id:
            properties = with_properties(properties, message_id=uuid.uuid4().hex)
        message_id: str = properties.message_id or ""
        while (previous := self._in_flight.get(message_id)) is not None:
            await previous
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._in_flight[message_id] = done
        try:
            if exchange in self._proven_exchanges:
                try:
                    channel = await self._channel("fast")
                    await self._publish_on(channel, body, properties, exchange, routing_key)
                    return
                except _CHANNEL_GONE:
                    pass  # some publish closed the shared channel: was it this one?
            await self._publish_carefully(body, properties, exchange, routing_key)
        finally:
            del self._in_flight[message_id]
            done.set_result(None)

    async def _publish_carefully(
        self, body: bytes, properties: Basic.Properties, exchange: str, routing_key: str
    ) -> None:
        async with self._careful_lock:
            channel = await self._channel("careful")
            try:
                await self._publish_on(channel, body, properties, exchange, routing_key)
            except Unroutable:
                self._proven_exchanges.add(exchange)  # it exists: the return says so
                raise
            except aiormq.exceptions.ChannelClosed as error:
                self._proven_exchanges.discard(exchange)
                raise TargetRefused(_describe(error, exchange, routing_key)) from None
            self._proven_exchanges.add(exchange)

    @staticmethod
    async def _publish_on(
        channel: aiormq.abc.AbstractChannel,
        body: bytes,
        properties: Basic.Properties,
        exchange: str,
        routing_key: str,
    ) -> None:
        try:
            confirmation = await channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=True,
            )
        except aiormq.exceptions.PublishError as error:
            frame: Basic.Return = error.frame  # type: ignore[assignment]
            raise Unroutable(
                f"returned by the broker ({frame.reply_code} {frame.reply_text}): no queue "
                f"is bound to exchange {exchange!r} for routing key {routing_key!r}"
            ) from None
        if not isinstance(confirmation, Basic.Ack):
            raise PublishRejectedError(
                f"the broker nacked the publish to exchange {exchange!r}, routing key "
                f"{routing_key!r} (queue full with x-overflow=reject-publish, or an "
                f"internal error)"
            )

    async def close(self) -> None:
        for channel in self._channels.values():
            if not channel.is_closed:
                await channel.close()
        self._channels.clear()


def _describe(error: aiormq.exceptions.ChannelClosed, exchange: str, routing_key: str) -> str:
    text = error.args[0] if error.args else str(error)
    if isinstance(error, aiormq.exceptions.ChannelNotFoundEntity):
        what = f"target exchange {exchange!r} does not exist"
    elif isinstance(error, aiormq.exceptions.ChannelAccessRefused):
        what = f"access refused to exchange {exchange!r}"
    else:
        what = f"the broker refused the publish to {exchange!r}/{routing_key!r}"
    return f"{what} (broker: {text})"
