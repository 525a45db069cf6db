"""Parked messages: list them, and replay them through the relay once their cause is fixed.

Both read ``{prefix}.parked`` with ``basic.get`` and manual acks. Listing acks nothing:
closing the channel returns every message to the queue. Replaying publishes a copy
to ``{prefix}.relay`` (confirmed) before it acks the parked one, so a crash duplicates,
never loses. The relay then treats the copy like any expired message: a hop if it is
not yet due, delivery if it is, parking again (with a fresh reason) if it still cannot.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import aio_pika
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from hopsched import amqp
from hopsched.broker.objects import Progress, inspect
from hopsched.connect import connect
from hopsched.core.envelope import (
    HEADER_DUE,
    HEADER_EXCHANGE,
    HEADER_ID,
    HEADER_INGRESS,
    HEADER_PARKED_AT,
    HEADER_PARKED_KIND,
    HEADER_PARKED_REASON,
    HEADER_PARKED_USER_ID,
    HEADER_ROUTING_KEY,
    HEADER_VERSION,
    unparked_properties,
)
from hopsched.errors import PrefixNotDeclaredError
from hopsched.journal.cancels import handed_back_reasons
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = ["ParkedListing", "ParkedMessage", "ReplayResult", "list_parked", "replay_parked"]


@dataclass(frozen=True, slots=True)
class ParkedMessage:
    """One parked message, as ``hopsched parked list`` shows it.

    Attributes:
        schedule_id: header ``x-hopsched-id``; None if the envelope lacked it.
        reason: why the relay parked it.
        kind: the ``hopsched.ParkKind`` value the relay counted it under (header
            ``x-hopsched-parked-kind``, as in ``hopsched_parked_total{kind}``); None for a
            message the broker itself dead-lettered here (``reason`` says why) or one
            parked by a hopsched older than the header.
        exchange, routing_key: the target it was scheduled for (None if unknown).
        due_us, parked_at_us: µs since the Unix epoch (UTC), or None.
        body_bytes: size of the body in bytes.
    """

    schedule_id: str | None
    reason: str
    kind: str | None
    exchange: str | None
    routing_key: str | None
    due_us: int | None
    parked_at_us: int | None
    body_bytes: int

    @classmethod
    def from_delivery(cls, delivered: DeliveredMessage) -> ParkedMessage:
        headers: Mapping[str, Any] = delivered.header.properties.headers or {}

        def get(name: str, kind: type) -> Any:
            value = headers.get(name)
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        return cls(
            schedule_id=get(HEADER_ID, str),
            reason=get(HEADER_PARKED_REASON, str) or _dead_letter_reason(headers),
            kind=get(HEADER_PARKED_KIND, str),
            exchange=get(HEADER_EXCHANGE, str),
            routing_key=get(HEADER_ROUTING_KEY, str),
            due_us=get(HEADER_DUE, int),
            parked_at_us=get(HEADER_PARKED_AT, int),
            body_bytes=len(delivered.body),
        )


_HANDED_BACK = "a relay could not park it and handed it back"


def _dead_letter_reason(headers: Mapping[str, Any]) -> str:
    """Why the broker itself moved a message here (``{prefix}.relay`` dead-letters into
    the parking queue), from the ``x-last-death-*`` headers it adds: the death that
    brought it here, not an earlier one (a step's ``expired``). RabbitMQ < 3.13 sets no
    ``x-last-death-*``: then ``x-first-death-*``."""
    reason = headers.get("x-last-death-reason") or headers.get("x-first-death-reason")
    queue = headers.get("x-last-death-queue") or headers.get("x-first-death-queue")
    if reason == "delivery_limit":
        return (
            f"returned to {queue} more often than its delivery limit (relays crashed or "
            "lost their connection while holding it)"
        )
    if reason == "rejected":
        return f"{_HANDED_BACK} to {queue}"
    if reason:
        return f"dead-lettered by the broker from {queue} ({reason})"
    return "(no reason recorded)"


@dataclass
class ReplayResult:
    """What ``replay_parked`` did: schedule ids replayed, and those it left parked, why;
    ``to_ingress``: of the replayed, ingress messages never scheduled, sent back to their
    ingress exchange."""

    replayed: list[str]
    left: dict[str, str]
    to_ingress: int = 0


@dataclass(frozen=True, slots=True)
class ParkedListing:
    """What ``list_parked`` found: the messages read and how many were parked in all.

    Attributes:
        messages: the parked messages read, oldest first (at most the limit asked for).
        total: the parked queue's depth when listing started.
    """

    messages: list[ParkedMessage]
    total: int


async def list_parked(settings: Settings, *, limit: int | None = None) -> ParkedListing:
    """The parked messages of ``settings.prefix``, oldest first, left in place.

    Each one listed is returned to the queue, which RabbitMQ 4.0-4.2 count as a
    delivery attempt of a quorum queue (https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling).

    Raises:
        BrokerUnavailableError: cannot connect. TopologyMismatchError: the prefix's queues
        exist with other arguments (e.g. another queue type). PrefixNotDeclaredError: no
        parked queue.
    """
    found: list[ParkedMessage] = []
    async with _parked_messages(settings) as (_, total, messages):
        async for delivered in messages:
            found.append(ParkedMessage.from_delivery(delivered))
            if limit is not None and len(found) >= limit:
                break
    if any(message.reason.startswith(_HANDED_BACK) for message in found):
        # the broker's refusal, which the relay wrote to the cancel stream
        reasons = await handed_back_reasons(settings)
        found = [
            dataclasses.replace(
                message, reason=f"{reasons[message.schedule_id]} ({message.reason})"
            )
            if message.reason.startswith(_HANDED_BACK) and message.schedule_id in reasons
            else message
            for message in found
        ]
    return ParkedListing(found, total)


async def replay_parked(
    settings: Settings, ids: Collection[str] | None, *, progress: Progress | None = None
) -> ReplayResult:
    """Move parked messages back to the relay queue: those whose schedule id is in
    ``ids``, or all of them if ``ids`` is None.

    One at a time, each published (confirmed) before the parked one is acked: stopped at
    any instant (even killed), it loses nothing and duplicates at most the one in flight;
    run it again to replay the rest. ``progress`` is called after each confirmed replay,
    with the count so far (``Progress``).

    A message parked because its ``user_id`` was not the relay's login is left parked
    unless this connection logs in as that user (RabbitMQ checks ``user_id``,
    https://www.rabbitmq.com/docs/validated-user-id).

    Raises:
        BrokerUnavailableError: cannot connect. TopologyMismatchError: the prefix's queues
        exist with other arguments (e.g. another queue type). PrefixNotDeclaredError: no
        parked queue.
    """
    result = ReplayResult(replayed=[], left={})
    topology = Topology.from_settings(settings)
    async with (
        _parked_messages(settings) as (connection, _, messages),
        connection.channel(publisher_confirms=True) as channel,
    ):
        publisher = await channel.get_underlay_channel()
        async for delivered in messages:
            parked = ParkedMessage.from_delivery(delivered)
            name = parked.schedule_id or f"(no schedule id; {parked.reason})"
            if ids is not None and parked.schedule_id not in ids:
                continue  # returned to the queue when the channel closes
            properties = delivered.header.properties
            user_id = (properties.headers or {}).get(HEADER_PARKED_USER_ID)
            if user_id is not None and user_id != settings.login:
                result.left[name] = f"its user_id is {user_id!r}: replay it logged in as that user"
                continue
            replayed = unparked_properties(amqp.Properties.from_pamqp(properties))
            exchange, routing_key = _replayed_to(replayed, topology)
            confirm = await publisher.basic_publish(
                delivered.body,
                exchange=exchange,
                routing_key=routing_key,
                properties=replayed.to_pamqp(),
                mandatory=True,
            )
            if not isinstance(confirm, Basic.Ack):
                result.left[name] = f"the broker refused the replay ({confirm!r})"
                continue
            result.replayed.append(name)
            result.to_ingress += exchange != ""
            if progress is not None:  # before the ack: stopped here, this one is duplicated
                progress(f"replayed to {exchange or routing_key}", len(result.replayed))
            await delivered.channel.basic_ack(delivered.delivery_tag or 0)
    return result


@contextlib.asynccontextmanager
async def _parked_messages(
    settings: Settings,
) -> AsyncIterator[tuple[aio_pika.abc.AbstractConnection, int, AsyncIterator[DeliveredMessage]]]:
    """Connect, check the prefix's queues (declaring nothing), and yield the parked queue's
    depth and an iterator of its ``basic.get`` deliveries (unacked); closing returns every
    unacked one to the queue."""
    topology = Topology.from_settings(settings)
    queue = topology.parked_queue
    connection = await connect(settings, name="hopsched-parked")
    async with connection:
        depth = (await inspect(topology, connection))[queue]
        if depth is None:
            raise PrefixNotDeclaredError(
                f"queue {queue!r} does not exist on {settings.masked_url}: this prefix is not "
                "declared there, or was torn down (check --prefix / HOPSCHED_PREFIX)",
                prefix=settings.prefix,
                queue=queue,
            )
        channel = await connection.channel(publisher_confirms=False)
        getter = await channel.get_underlay_channel()

        async def messages() -> AsyncIterator[DeliveredMessage]:
            # At most the count seen at the start: a message parked meanwhile, or one
            # returned by a replay that failed, is not read twice.
            for _ in range(depth.messages):
                delivered = await getter.basic_get(queue, no_ack=False)
                if not isinstance(delivered.delivery, Basic.GetOk):
                    return
                yield delivered

        yield connection, depth.messages, messages()


def _replayed_to(properties: amqp.Properties, topology: Topology) -> tuple[str, str]:
    """Where a replay publishes (exchange, routing key): ``{prefix}.relay``, or, for an
    ingress message that was never scheduled (no envelope; ``HEADER_INGRESS``), its
    ingress exchange with its routing key, to be taken in again as it was published."""
    headers: Mapping[str, Any] = properties.headers or {}
    ingress = headers.get(HEADER_INGRESS)
    if isinstance(ingress, str) and ingress and HEADER_VERSION not in headers:
        routing_key = headers.get(HEADER_ROUTING_KEY)
        return ingress, routing_key if isinstance(routing_key, str) else ""
    return "", topology.relay_queue
