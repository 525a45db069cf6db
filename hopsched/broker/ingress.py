"""Declaring, listing and removing ingresses (``hopsched.core.ingress``) on the broker.

An ingress ``E`` of type ``T`` is:

* exchange ``E`` (topic, durable), the name producers publish to, bound to the prefix's
  quorum queue ``{prefix}.ingress`` with ``#`` (every message; plus exact keys given for a
  migration from a ``direct`` plugin exchange);
* exchange ``{prefix}.due.E`` of type ``T``: the relay publishes each message there when
  it is due; consumers bind their queues to it as they bound them to the plugin's;
* a record in the stream ``{prefix}.ingresses``, which ``list_ingresses`` folds.

``E`` is a topic exchange whatever ``T``: its one job is to take everything to the
ingress queue (a direct exchange has no catch-all binding); routing by ``T`` happens at
the due exchange, when the message is due.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import aio_pika
import aiormq

from hopsched.broker.objects import UNBIND_HINT, exists
from hopsched.connect import connect
from hopsched.core.ingress import Ingress, IngressRegistry
from hopsched.errors import (
    AccessRefusedError,
    BrokerUnavailableError,
    HopschedError,
    PrefixNotDeclaredError,
)
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = ["bind_to_due_exchange", "declare_ingress", "list_ingresses", "remove_ingress"]

log = logging.getLogger("hopsched.ingress")

#: How long reading the registry may take, s.
READ_TIMEOUT_S = 30.0


async def declare_ingress(
    settings: Settings,
    ingress: Ingress,
    *,
    bindings: tuple[tuple[str, str], ...] = (),
    replace: bool = False,
) -> None:
    """Declare ``ingress`` on ``settings``' prefix (idempotent): its due exchange, the
    consumers' ``bindings`` (queue, routing key) to it, its exchange, the binding to
    ``{prefix}.ingress``, and its record, in that order.

    With ``replace``, an exchange of that name that exists (the delayed-message plugin's)
    is deleted just before hopsched's is declared: the consumers are bound to the due
    exchange by then. Keep the plugin enabled until its longest pending delay has
    passed: it routes a message that comes due through the exchange's *name*, now
    hopsched's, which takes it to the ingress and delivers it at once (for a ``direct``
    plugin exchange, only by the exact ``Ingress.keys``).

    Raises:
        PrefixNotDeclaredError: the prefix has no relay queue (a mistyped prefix, or no
            relay ran there yet): nothing declared.
        HopschedError: exchange ``E`` exists with another type or arguments (the
            delayed-message plugin's, say): it names what to do.
        AccessRefusedError, BrokerUnavailableError.
    """
    topology = Topology.from_settings(settings)
    due = topology.due_exchange(ingress.exchange)
    connection = await connect(settings, name="hopsched-ingress")
    async with connection:
        await _require_prefix(connection, settings, topology)
        declaring = f"exchange {due!r}"
        try:
            channel = await connection.channel()
            await channel.declare_exchange(due, ingress.delayed_type, durable=True)
            for queue_name, key in bindings:
                declaring = f"the binding of queue {queue_name!r} to {due!r}"
                bound = await channel.declare_queue(queue_name, passive=True)
                await bound.bind(due, routing_key=key)
            declaring = f"exchange {ingress.exchange!r}"
            if replace:
                await channel.exchange_delete(ingress.exchange)
                log.warning("deleted exchange %s to declare it as an ingress", ingress.exchange)
            entry = await channel.declare_exchange(
                ingress.exchange, aio_pika.ExchangeType.TOPIC, durable=True
            )
            declaring = f"the binding of {ingress.exchange!r} to {topology.ingress_queue!r}"
            queue = await channel.declare_queue(topology.ingress_queue, passive=True)
            for key in ("#", *ingress.keys):
                await queue.bind(entry, routing_key=key)
            await _append(channel, topology, IngressRegistry.declared(ingress))
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            if declaring == f"exchange {due!r}":
                raise HopschedError(
                    f"declaring {declaring}: {error.args[0] if error.args else error}. Ingress "
                    f"{ingress.exchange!r} exists with another type: to change it, remove it "
                    f"first (`hopsched ingress remove {ingress.exchange} --force`: messages of it "
                    "still pending are parked when due), then declare it again"
                ) from None
            raise HopschedError(
                f"declaring {declaring}: {error.args[0] if error.args else error}. An exchange "
                "of that name exists with another type: if it is the delayed-message "
                "plugin's, follow docs/migrating-from-the-delayed-message-plugin.md "
                "(`hopsched ingress declare --replace`, the plugin kept enabled until its "
                "longest pending delay has passed)"
            ) from None
        except aiormq.exceptions.ChannelNotFoundEntity as error:
            raise HopschedError(
                f"declaring {declaring}: {error.args[0] if error.args else error}: declare "
                "the consumers' queues first"
            ) from None
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise AccessRefusedError(
                f"declaring {declaring}: {error.args[0] if error.args else error}: declaring "
                "an ingress needs the operator's grant (`hopsched permissions --role operator`)"
            ) from None
    log.info(
        "ingress %s declared: %s -> %s -> %s (%s)",
        ingress.exchange,
        ingress.exchange,
        topology.ingress_queue,
        due,
        ingress.delayed_type,
    )


async def remove_ingress(settings: Settings, exchange: str, *, force: bool = False) -> list[str]:
    """Remove ingress ``exchange``: its exchange, its due exchange and its record. Return
    what was removed. Messages of it still on the ladder are parked at their due time
    (their due exchange is gone): without ``force``, a due exchange with bindings
    (consumers still expecting messages) is not removed.

    Raises:
        HopschedError: no such ingress, or (without ``force``) its due exchange is bound.
        AccessRefusedError, BrokerUnavailableError.
    """
    topology = Topology.from_settings(settings)
    due = topology.due_exchange(exchange)
    known = {ingress.exchange for ingress in await list_ingresses(settings)}
    connection = await connect(settings, name="hopsched-ingress")
    removed: list[str] = []
    async with connection:
        present = [name for name in (exchange, due) if await _exchange_exists(connection, name)]
        if exchange not in known and not present:
            raise HopschedError(
                f"no ingress {exchange!r} on prefix {settings.prefix!r} "
                "(`hopsched ingress list` shows those there are)"
            )
        channel = await connection.channel()
        try:
            if due in present:
                try:
                    await channel.exchange_delete(due, if_unused=not force)
                except aiormq.exceptions.ChannelPreconditionFailed:
                    raise HopschedError(
                        f"not removed: {due} still has bindings (consumers waiting for "
                        f"{exchange}'s messages, and messages of it pending on the ladder "
                        "would be parked at their due time)" + UNBIND_HINT
                    ) from None
                removed.append(due)
            if exchange in present:
                await channel.exchange_delete(exchange)
                removed.append(exchange)
            await _append(channel, topology, IngressRegistry.removed(exchange))
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise AccessRefusedError(
                f"removing ingress {exchange!r}: {error.args[0] if error.args else error}: "
                "that needs the operator's grant (`hopsched permissions --role operator`)"
            ) from None
    return removed


async def bind_to_due_exchange(
    settings: Settings,
    exchange: str,
    queue: str,
    routing_key: str = "",
    arguments: dict[str, object] | None = None,
) -> str:
    """Bind ``queue`` to ingress ``exchange``'s due exchange, as it was bound to the
    plugin's exchange; return the due exchange's name.

    Raises:
        HopschedError: the due exchange or the queue does not exist.
        AccessRefusedError, BrokerUnavailableError.
    """
    due = Topology.from_settings(settings).due_exchange(exchange)
    connection = await connect(settings, name="hopsched-ingress")
    async with connection:
        channel = await connection.channel()
        try:
            await channel.declare_exchange(due, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise HopschedError(
                f"no ingress {exchange!r} on prefix {settings.prefix!r} ({due} does not "
                f"exist): declare it first (`hopsched ingress declare {exchange} --type ...`)"
            ) from None
        channel = await connection.channel()
        try:
            bound = await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise HopschedError(f"no queue {queue!r} to bind to {due}") from None
        await bound.bind(due, routing_key=routing_key, arguments=arguments)  # type: ignore[arg-type]
    return due


async def list_ingresses(settings: Settings) -> list[Ingress]:
    """The ingresses declared on ``settings``' prefix, by exchange name: the registry
    stream read from its start to a marker this call writes.

    Raises:
        PrefixNotDeclaredError: the prefix has no ingress registry (no relay of a
            hopsched with ingresses declared it).
        BrokerUnavailableError: the stream gave nothing back within ``READ_TIMEOUT_S``.
        AccessRefusedError.
    """
    topology = Topology.from_settings(settings)
    registry = IngressRegistry()
    marker = uuid.uuid4().hex
    connection = await connect(settings, name="hopsched-ingress")
    async with connection:
        stream = topology.ingress_registry
        if not await exists(connection, lambda c: c.declare_queue(stream, passive=True)):
            raise PrefixNotDeclaredError(
                f"prefix {settings.prefix!r} has no ingress registry ({stream}) at "
                f"{settings.masked_url}: check --prefix; a relay of this version declares it",
                prefix=settings.prefix,
                queue=stream,
            )
        channel = await connection.channel()
        try:
            await _append(channel, topology, IngressRegistry.marker(marker))
            reader = await connection.channel()
            await reader.set_qos(prefetch_count=100)
            queue = await reader.declare_queue(stream, passive=True)
            caught_up = asyncio.Event()

            async def received(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                await message.ack()
                if registry.apply(message.body) == marker:
                    caught_up.set()

            await queue.consume(received, arguments={"x-stream-offset": "first"})
            try:
                await asyncio.wait_for(caught_up.wait(), READ_TIMEOUT_S)
            except TimeoutError:
                raise BrokerUnavailableError(
                    f"{stream} gave its records back within {READ_TIMEOUT_S:.0f} s"
                ) from None
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise AccessRefusedError(
                f"reading {stream}: {error.args[0] if error.args else error}: listing "
                "ingresses needs read and write on it (the operator's grant)"
            ) from None
    return registry.sorted()


async def _exchange_exists(connection: aio_pika.abc.AbstractConnection, name: str) -> bool:
    return await exists(connection, lambda channel: channel.declare_exchange(name, passive=True))


async def _require_prefix(
    connection: aio_pika.abc.AbstractConnection, settings: Settings, topology: Topology
) -> None:
    queue = topology.ingress_queue
    if not await exists(connection, lambda c: c.declare_queue(queue, passive=True)):
        raise PrefixNotDeclaredError(
            f"prefix {settings.prefix!r} has no ingress queue ({queue}) at "
            f"{settings.masked_url}: check --prefix, and start a relay of this version "
            f"there first (`hopsched relay --prefix {settings.prefix}`): it declares it",
            prefix=settings.prefix,
            queue=queue,
        )


async def _append(channel: aio_pika.abc.AbstractChannel, topology: Topology, body: bytes) -> None:
    """Append one record to the registry, confirmed (``channel`` confirms publishes)."""
    await channel.default_exchange.publish(
        aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
        topology.ingress_registry,
        mandatory=True,
    )
