"""hopsched's own AMQP client (``hopsched.amqp``) consuming from the shared broker:
prefetch, delivery tags, every basic property and header type, bodies around
frame_max, acks, nacks that dead-letter, consumer cancels by the broker and by the
client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from pamqp import commands, decode, encode
from support import Cleanup, until
from support.amqp import Deliveries, Outcomes, confirming, declare, encoded, open_connection

from hopsched import amqp
from hopsched.amqp import Outcome, Properties
from hopsched.amqp.connection import LAZY_SEND_S


@pytest.fixture
async def connection(broker_url: str) -> AsyncIterator[amqp.Connection]:
    opened: amqp.Connection = await open_connection(broker_url)
    yield opened
    await opened.close()


# --- consumers ----------------------------------------------------------------------------

HEADERS: dict[str, Any] = {
    "bool": True,
    "false": False,
    "int8": -5,
    "int16": 300,
    "int32": 70_000,
    "int64": 2**40,
    "negative64": -(2**62),
    "float": 1.5,
    "decimal": Decimal("3.14"),
    "timestamp": datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
    "string": "héllo wörld",
    "empty": "",
    "bytes": bytearray(b"\x00\xffraw"),
    "void": None,
    "array": [1, "two", 3.5, [4, {"five": 5}], None, True],
    "table": {"nested": {"deeper": ["x", {"deepest": 2**33}]}, "n": 1},
}


async def test_deliveries_carry_tags_properties_headers_and_bodies(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """Bodies of 0 bytes, 1 byte and more than frame_max, with every basic property and
    headers of every AMQP type (nested tables and arrays): each delivery has the
    right consumer, delivery tag, exchange, routing key, properties and body."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    stamp = int(datetime(2031, 5, 6, tzinfo=UTC).timestamp())
    sent = Properties(
        content_type="application/octet-stream",
        content_encoding="identity",
        headers=amqp.Table.from_dict(HEADERS),
        delivery_mode=2,
        priority=7,
        correlation_id="corr-1",
        reply_to="reply.q",
        expiration="600000",
        message_id="mid-1",
        timestamp=stamp,
        message_type="kind",
        user_id="guest",
        app_id="hopsched-tests",
    )
    bodies = [b"", b"\x01", bytes(range(256)) * (connection.frame_max // 256 + 7)]
    outcomes = Outcomes()
    for index, body in enumerate(bodies):
        channel.publish("", queue, body, sent.encode(), callback=outcomes.callback(index))
    await outcomes.wait()
    assert {outcomes.outcome(index) for index in range(3)} == {Outcome.ACK}

    deliveries = Deliveries()
    tag = await channel.consume(queue, deliveries.on_delivery, deliveries.on_cancel)
    got = await deliveries.wait_for(3)
    assert [delivery.body for delivery in got] == bodies
    assert [delivery.delivery_tag for delivery in got] == [1, 2, 3]
    expected_headers = decode.field_table(encode.field_table(HEADERS))[1]
    for delivery in got:
        assert delivery.error is None
        assert (delivery.exchange, delivery.routing_key, delivery.redelivered) == ("", queue, False)
        properties = delivery.properties
        assert properties is not None
        assert properties.headers is not None
        assert dict(properties.headers) == expected_headers
        assert properties.replace(headers=None) == sent.replace(headers=None)
    assert dict(got[0].properties.headers)["table"]["nested"]["deeper"][1] == {"deepest": 2**33}  # type: ignore[union-attr]
    channel.ack(3, multiple=True)
    await channel.cancel(tag)


async def test_prefetch_limits_unacked_and_acks_single_and_multiple(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """``qos(3)``: three deliveries until one is acked, then one more; an ack with
    ``multiple=True`` releases all it covers; the queue ends empty with nothing
    redelivered."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    outcomes = Outcomes()
    for index in range(10):
        channel.publish("", queue, b"%d" % index, encoded(), callback=outcomes.callback(index))
    await outcomes.wait()
    await channel.qos(3)
    deliveries = Deliveries()
    tag = await channel.consume(queue, deliveries.on_delivery, deliveries.on_cancel)
    await deliveries.wait_for(3)
    await asyncio.sleep(0.3)
    assert len(deliveries.received) == 3
    channel.ack(1)
    await deliveries.wait_for(4)
    await asyncio.sleep(0.3)
    assert len(deliveries.received) == 4
    channel.ack(4, multiple=True)  # tags 2, 3 and 4
    await deliveries.wait_for(7)
    await asyncio.sleep(0.3)
    assert len(deliveries.received) == 7
    channel.ack(7, multiple=True)
    got = await deliveries.wait_for(10)
    channel.ack(10, multiple=True)
    assert [delivery.body for delivery in got] == [b"%d" % index for index in range(10)]
    assert [delivery.delivery_tag for delivery in got] == list(range(1, 11))
    assert not any(delivery.redelivered for delivery in got)
    await channel.cancel(tag)
    reply = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
    assert isinstance(reply, commands.Queue.DeclareOk)
    assert reply.message_count == 0


async def test_nack_requeues_or_dead_letters_with_x_death(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """``nack(requeue=True)`` redelivers (``redelivered`` set, a new tag);
    ``nack(requeue=False)`` on a queue with a dead-letter target: the message arrives
    there with its body and headers, and the broker's x-death names the queue and
    the reason 'rejected'."""
    channel = await confirming(connection)
    dead = await declare(channel, cleanup)
    queue = await declare(
        channel,
        cleanup,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead},
    )
    outcomes = Outcomes()
    channel.publish(
        "", queue, b"doomed", encoded(headers={"mine": 1}), callback=outcomes.callback(0)
    )
    await outcomes.wait()
    first = Deliveries()
    await channel.consume(queue, first.on_delivery, first.on_cancel)
    (once,) = await first.wait_for(1)
    assert not once.redelivered
    channel.nack(once.delivery_tag, requeue=True)
    _, got = await first.wait_for(2)
    assert got.redelivered
    assert got.delivery_tag == once.delivery_tag + 1
    assert got.body == b"doomed"
    channel.nack(got.delivery_tag, requeue=False)
    second = Deliveries()
    await channel.consume(dead, second.on_delivery, second.on_cancel)
    (dead_lettered,) = await second.wait_for(1)
    channel.ack(dead_lettered.delivery_tag)
    assert dead_lettered.body == b"doomed"
    assert dead_lettered.properties is not None
    assert dead_lettered.properties.headers is not None
    headers = dict(dead_lettered.properties.headers)
    assert headers["mine"] == 1
    (death,) = headers["x-death"]
    assert death["queue"] == queue
    assert death["reason"] == "rejected"
    assert death["count"] == 1
    assert death["routing-keys"] == [queue]
    assert isinstance(death["time"], datetime)
    assert headers["x-first-death-reason"] == "rejected"


async def test_a_deleted_queue_cancels_its_consumer_and_the_channel_goes_on(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """Deleting a consumed queue: the broker's basic.cancel runs that consumer's
    on_cancel with its tag (and no other's); the channel stays open and a new
    consume on it receives."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    kept = await declare(channel, cleanup)
    doomed, other = Deliveries(), Deliveries()
    tag = await channel.consume(queue, doomed.on_delivery, doomed.on_cancel)
    await channel.consume(kept, other.on_delivery, other.on_cancel)
    admin = await connection.channel()
    await admin.call(commands.Queue.Delete(queue=queue))
    assert await doomed.wait_cancelled() == [tag]
    await asyncio.sleep(0.2)
    assert channel.is_open
    assert other.cancelled == []

    again = await declare(channel, cleanup)
    fresh = Deliveries()
    await channel.consume(again, fresh.on_delivery, fresh.on_cancel)
    outcomes = Outcomes()
    channel.publish("", again, b"after cancel", encoded(), callback=outcomes.callback(0))
    (got,) = await fresh.wait_for(1)
    assert got.body == b"after cancel"
    channel.ack(got.delivery_tag)
    assert doomed.received == []


async def test_cancel_stops_deliveries(connection: amqp.Connection, cleanup: Cleanup) -> None:
    """After ``cancel(tag)`` returns, no more deliveries reach that consumer: what is
    published later stays in the queue."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    deliveries = Deliveries()
    tag = await channel.consume(queue, deliveries.on_delivery, deliveries.on_cancel)
    outcomes = Outcomes()
    channel.publish("", queue, b"first", encoded(), callback=outcomes.callback(0))
    (got,) = await deliveries.wait_for(1)
    channel.ack(got.delivery_tag)
    await channel.cancel(tag)
    for index in range(1, 4):
        channel.publish("", queue, b"later", encoded(), callback=outcomes.callback(index))
    await outcomes.wait()
    await asyncio.sleep(0.3)
    assert len(deliveries.received) == 1
    assert deliveries.cancelled == []
    reply = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
    assert isinstance(reply, commands.Queue.DeclareOk)
    assert (reply.message_count, reply.consumer_count) == (3, 0)


async def test_an_on_cancel_that_raises_is_logged_and_the_channel_goes_on(
    connection: amqp.Connection, cleanup: Cleanup, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer's on_cancel that raises when the broker cancels it is logged; the
    connection, the channel and its other consumer go on."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    kept = await declare(channel, cleanup)
    cancelled: list[str] = []

    def raising(tag: str) -> None:
        cancelled.append(tag)
        raise RuntimeError("a bug in on_cancel")

    other = Deliveries()
    tag = await channel.consume(queue, other.on_delivery, raising)
    await channel.consume(kept, other.on_delivery, other.on_cancel)
    await channel.call(commands.Queue.Delete(queue=queue))
    outcomes = Outcomes()
    channel.publish("", kept, b"still here", encoded(), callback=outcomes.callback(0))
    (got,) = await other.wait_for(1)
    channel.ack(got.delivery_tag)
    # The broker's basic.cancel comes when it comes: on RabbitMQ 4.0 a CI run had it
    # after queue.delete-ok and after the other queue's delivery.
    await until(lambda: bool(cancelled), within=10)
    assert cancelled == [tag]
    assert connection.is_open
    assert channel.is_open
    assert "a bug in on_cancel" in caplog.text


async def test_a_lazy_ack_is_sent_on_its_own_and_many_lazy_acks_all_take_effect(
    connection: amqp.Connection, broker_url: str, cleanup: Cleanup
) -> None:
    """A lazy ack with nothing else to write still reaches the broker (within
    ``LAZY_SEND_S``): after it, a dropped connection redelivers nothing. Lazy acks of
    paced deliveries, between publishes, all take effect too."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    outcomes = Outcomes()
    channel.publish("", queue, b"first", encoded(), callback=outcomes.callback(0))
    await outcomes.wait()
    deliveries = Deliveries()
    await channel.consume(queue, deliveries.on_delivery, deliveries.on_cancel)
    (first,) = await deliveries.wait_for(1)
    channel.ack(first.delivery_tag, lazy=True)
    await asyncio.sleep(LAZY_SEND_S + 0.1)  # nothing else is written meanwhile
    connection.abort()  # no close: what was not sent is lost with the socket

    second: amqp.Connection = await open_connection(broker_url)
    try:
        channel = await confirming(second)
        deliveries = Deliveries()

        def received(delivery: amqp.Delivery) -> None:
            deliveries.on_delivery(delivery)
            channel.ack(delivery.delivery_tag, lazy=True)

        await channel.consume(queue, received, deliveries.on_cancel)
        await asyncio.sleep(0.3)
        assert deliveries.received == [], "the lazily acked message came back"
        outcomes = Outcomes()
        for index in range(50):  # paced: each ack waits for the next publish, or 5 ms
            channel.publish("", queue, b"%d" % index, encoded(), callback=outcomes.callback(index))
            await asyncio.sleep(0.002)
        await outcomes.wait()
        got = await deliveries.wait_for(50)
        assert [delivery.body for delivery in got] == [b"%d" % index for index in range(50)]
        await asyncio.sleep(LAZY_SEND_S + 0.1)
    finally:
        second.abort()
    check: amqp.Connection = await open_connection(broker_url)
    try:
        channel = await check.channel()
        reply = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
        assert isinstance(reply, commands.Queue.DeclareOk)
        assert reply.message_count == 0, "an ack sent lazily never reached the broker"
    finally:
        await check.close()


async def test_a_call_given_up_leaves_the_next_call_its_own_answer(
    connection: amqp.Connection, cleanup: Cleanup, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller cancelled while it awaits a synchronous method's answer (a ``get()`` given
    up): the answer, when it comes, goes to no one, not to the channel's next call; a
    consume given up is cancelled on the broker, and what it was sent meanwhile goes
    back to the queue (found by the look-ups' tests: a late consume-ok answered the next
    call, with a warning)."""
    channel = await confirming(connection)
    first, second = await declare(channel, cleanup), await declare(channel, cleanup)
    for index in range(5):
        channel.publish("", first, b"m%d" % index, encoded())
    for _ in range(20):  # each given up before its answer can come (no read in between)
        call = asyncio.ensure_future(
            channel.call(commands.Queue.Declare(queue=first, passive=True))
        )
        await asyncio.sleep(0)
        call.cancel()
        consume = asyncio.ensure_future(channel.consume(first, lambda _: None, lambda _: None))
        await asyncio.sleep(0)
        consume.cancel()
        declared = await channel.call(commands.Queue.Declare(queue=second, passive=True))
        assert isinstance(declared, commands.Queue.DeclareOk)
        assert declared.queue == second
    await asyncio.sleep(0.2)  # the consumers' cancel-oks, and any delivery, come in
    declared = await channel.call(commands.Queue.Declare(queue=first, passive=True))
    assert isinstance(declared, commands.Queue.DeclareOk)
    assert declared.consumer_count == 0
    deliveries = Deliveries()
    await channel.consume(first, deliveries.on_delivery, deliveries.on_cancel, no_ack=True)
    received = await deliveries.wait_for(5)
    assert sorted(d.body for d in received) == [b"m%d" % index for index in range(5)]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
