"""Publish lanes never need more channels than the connection has (F32), and the
relay's unconfirmed publishes stay within a window (F35's bound), on a real broker.

F32: with more busy target exchanges than the broker's ``channel_max``, a relay task
died on "all 2047 channels are in use" and its deliveries were neither delivered nor
parked until the relay restarted. Here the lanes take turns on a few channels, so
every message is delivered or parked, exactly once, and no task fails unawaited
(``conftest.py`` fails a test during which asyncio says one did).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from support import Cleanup, Relays, Targets, message_count, unique
from support.amqp import Outcomes, encoded, open_connection
from support.private_nodes import PrivateBroker

import hopsched
from hopsched.amqp import Delivery, Outcome
from hopsched.amqp.acks import Acker
from hopsched.amqp.publisher import LADDER_LANE, Publisher, target_lane
from hopsched.errors import ChannelClosedError

StartBroker = Callable[..., Awaitable[PrivateBroker]]


async def test_lanes_take_turns_on_few_channels_within_the_window(
    broker_url: str, amqp: aio_pika.abc.AbstractConnection, targets: Targets
) -> None:
    """40 busy target exchanges (3 publishes each, all at once) and the ladder lane on a
    publisher allowed 4 channels and 8 unconfirmed publishes: all 150 confirmed and in
    their queue, one publish to a missing exchange refused alone (404), never more than
    4 channels held nor 8 publishes unconfirmed."""
    queue = await targets.queue(consume=False)
    exchanges = [await targets.exchange(kind=aio_pika.ExchangeType.FANOUT) for _ in range(40)]
    for exchange in exchanges:
        await targets.bind(queue.name, exchange)
    connection = await open_connection(broker_url)
    publisher = Publisher(connection, max_lanes=4, window=8)
    outcomes = Outcomes()
    most = {"channels": 0, "unconfirmed": 0}

    def measure() -> None:
        most["channels"] = max(most["channels"], publisher.channels)
        most["unconfirmed"] = max(most["unconfirmed"], publisher.unconfirmed)

    def publish(key: Any, lane: str, exchange: str, routing_key: str) -> None:
        done = outcomes.callback(key)

        def settled(outcome: Outcome, detail: Any) -> None:
            measure()
            done(outcome, detail)

        publisher.publish(lane, exchange, routing_key, b"x", encoded(), settled)
        measure()

    try:
        for round_ in range(3):
            for exchange in exchanges:
                publish((exchange, round_), target_lane(exchange), exchange, "")
            for index in range(10):
                publish(("ladder", round_, index), LADDER_LANE, "", queue.name)
        missing = unique("missing")
        publish("missing", target_lane(missing), missing, "")
        await outcomes.wait(within=30)
    finally:
        await publisher.close()
        await connection.close()

    refused = outcomes.calls.pop("missing")
    assert [outcome for outcome, _ in refused] == [Outcome.CLOSED], refused
    assert isinstance(refused[0][1], ChannelClosedError)
    assert refused[0][1].reply_code == 404
    assert all(calls == [(Outcome.ACK, None)] for calls in outcomes.calls.values())
    assert len(outcomes.calls) == 150
    assert await message_count(amqp, queue.name) == 150
    assert most["channels"] <= 4, most
    assert most["unconfirmed"] <= 8, most
    assert most["channels"] == 4  # they did take turns


async def test_a_lane_window_bounds_each_lane_alone(
    broker_url: str, targets: Targets, amqp: aio_pika.abc.AbstractConnection
) -> None:
    """``lane_window=8``: two lanes with 60 publishes each never have more than 8
    unconfirmed each (16 together), and all 120 are confirmed and in their queue."""
    queue = await targets.queue(consume=False)
    exchange = await targets.exchange(kind=aio_pika.ExchangeType.FANOUT)
    await targets.bind(queue.name, exchange)
    connection = await open_connection(broker_url)
    publisher = Publisher(connection, lane_window=8)
    outcomes = Outcomes()
    most = {"unconfirmed": 0}

    def publish(key: Any, lane: str, exchange: str, routing_key: str) -> None:
        done = outcomes.callback(key)

        def settled(outcome: Outcome, detail: Any) -> None:
            most["unconfirmed"] = max(most["unconfirmed"], publisher.unconfirmed)
            done(outcome, detail)

        publisher.publish(lane, exchange, routing_key, b"x", encoded(), settled)
        most["unconfirmed"] = max(most["unconfirmed"], publisher.unconfirmed)

    try:
        for index in range(60):
            publish(("ladder", index), LADDER_LANE, "", queue.name)
            publish(("target", index), target_lane(exchange), exchange, "")
        await outcomes.wait(within=30)
    finally:
        await publisher.close()
        await connection.close()

    assert all(calls == [(Outcome.ACK, None)] for calls in outcomes.calls.values())
    assert len(outcomes.calls) == 120
    assert await message_count(amqp, queue.name) == 120
    assert 8 < most["unconfirmed"] <= 16, most  # both lanes full at once, neither past its window


async def test_held_publishes_keep_their_slots_until_released(
    broker_url: str, targets: Targets, amqp: aio_pika.abc.AbstractConnection
) -> None:
    """``hold=True`` with ``lane_window=2, lane_held=4``: of 12 publishes on one lane,
    4 or 5 are confirmed (sending stops once 4 are held; one more in flight may then
    be confirmed: never more than ``lane_window + lane_held - 1``), then the rest wait,
    however long, while another lane's go on; releases let them go; all 12 reach their
    queue, each confirmed once. (The relay holds a delivery until its journal record
    is written: F35's bound is ``LANE_WINDOW + LANE_HELD``.)"""
    queue = await targets.queue(consume=False)
    connection = await open_connection(broker_url)
    publisher = Publisher(connection, lane_window=2, lane_held=4)
    outcomes, others = Outcomes(), Outcomes()
    try:
        for index in range(12):
            callback = outcomes.callback(index)
            publisher.publish("held", "", queue.name, b"x", encoded(), callback, hold=True)
        await outcomes.wait(4, within=30)
        for index in range(3):
            callback = others.callback(index)
            publisher.publish(LADDER_LANE, "", queue.name, b"y", encoded(), callback)
        await others.wait(within=30)  # the other lane is not held back
        stalled = outcomes.settled()
        await asyncio.sleep(0.3)
        assert outcomes.settled() == stalled  # nothing more was sent
        assert 4 <= stalled <= 5
        released = 0
        while outcomes.settled() < 12:  # release what was confirmed: the rest goes on
            settled = outcomes.settled()
            for _ in range(settled - released):
                publisher.release("held")
            released = settled
            await outcomes.wait(settled + 1, within=30)
    finally:
        await publisher.close()
        await connection.close()
    assert all(calls == [(Outcome.ACK, None)] for calls in outcomes.calls.values())
    assert all(calls == [(Outcome.ACK, None)] for calls in others.calls.values())
    assert await message_count(amqp, queue.name) == 15


async def test_a_confirm_s_acks_are_written_before_the_publishes_it_lets_go(
    broker_url: str, targets: Targets, amqp: aio_pika.abc.AbstractConnection
) -> None:
    """F35's bound, frame by frame: a relay-like consumer re-publishes each of 60
    deliveries with ``lane_window=8`` and acks it (``Acker``, lazily) at its confirm.
    In what is written to the socket, after every frame, the publishes sent minus the
    deliveries acked never exceed 8: whatever prefix a ``kill -9`` lets the broker
    read, at most the window is published and not acked, so duplicated. (Before, the
    publishes a confirm let go were written before its acks: up to twice the window.)"""
    source = await targets.queue(consume=False)
    sink = await targets.queue(consume=False)
    channel = await amqp.channel()
    for index in range(60):
        await channel.default_exchange.publish(aio_pika.Message(b"%d" % index), source.name)
    await channel.close()

    connection = await open_connection(broker_url)
    frames: list[tuple[int, int, bytes]] = []
    transport = connection._transport
    write = transport.write

    def recording_write(data: bytes) -> None:
        frames.extend(_frames(bytes(data)))
        write(data)

    transport.write = recording_write
    publisher = Publisher(connection, lane_window=8)
    consumer = await connection.channel()
    await consumer.qos(100)
    acker = Acker(consumer, lazy=True)
    delivered: list[int] = []
    all_delivered = asyncio.Event()

    def on_delivery(delivery: Delivery) -> None:
        tag = delivery.delivery_tag
        acker.received(tag)

        def settled(outcome: Outcome, detail: Any) -> None:
            assert outcome is Outcome.ACK, (outcome, detail)
            acker.done(tag)
            delivered.append(tag)
            if len(delivered) == 60:
                all_delivered.set()

        publisher.publish(LADDER_LANE, "", sink.name, delivery.body, encoded(), settled)

    try:
        await consumer.consume(source.name, on_delivery, lambda tag: None)
        async with asyncio.timeout(30):
            await all_delivered.wait()
            await acker.settled()
            await asyncio.sleep(0.05)  # the last lazy acks written
    finally:
        await publisher.close()
        await connection.close()

    published, acked, worst = 0, 0, 0
    for number, kind, payload in frames:
        if kind != 1 or payload[:2] != b"\x00\x3c":  # a method frame of class basic
            continue
        method = int.from_bytes(payload[2:4], "big")
        if method == 40:  # basic.publish
            published += 1
        elif method == 80 and number == consumer.number:  # basic.ack
            tag = int.from_bytes(payload[4:12], "big")
            acked = max(acked, tag) if payload[12] & 1 else acked + 1
        worst = max(worst, published - acked)
    assert published == 60
    assert acked == 60
    assert worst <= 8, f"{worst} publishes were written and their deliveries not acked"
    assert await message_count(amqp, sink.name) == 60


def _frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """The AMQP frames in ``data`` (whole frames: the client writes only those)."""
    frames = []
    while data:
        kind, number, size = (
            data[0],
            int.from_bytes(data[1:3], "big"),
            int.from_bytes(data[3:7], "big"),
        )
        frames.append((number, kind, data[7 : 7 + size]))
        data = data[8 + size :]
    return frames


@pytest.mark.slow  # starts a private node
async def test_F32_more_busy_targets_than_channels_delivers_or_parks_all(
    start_private_broker: StartBroker, prefix: str, relays: Relays
) -> None:
    """F32 on a node whose ``channel_max`` is 16 (the relay's lanes get 8): 60 fanout
    exchanges bound to one queue, one message each, 20 messages to the default exchange
    and 5 to missing exchanges, all due at one instant. Each of the 80 is delivered
    once, the 5 are parked, the relay never reconnects."""
    node = await start_private_broker("channel_max = 16")
    settings = hopsched.Settings(url=node.url, prefix=prefix, log_interval_s=5.0)
    connection = await aio_pika.connect(node.url)
    try:
        targets = Targets(connection, Cleanup(node.url))
        target = await targets.queue()
        exchanges = [await targets.exchange(kind=aio_pika.ExchangeType.FANOUT) for _ in range(60)]
        for exchange in exchanges:
            await targets.bind(target.name, exchange)
        relay = await relays.start(settings)
        parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
        due = datetime.now(UTC) + timedelta(seconds=4)
        routes = [(exchange, "") for exchange in exchanges] + [("", target.name)] * 20
        missing = [(unique("missing"), "") for _ in range(5)]
        async with hopsched.Scheduler(settings) as scheduler:
            scheduled = await asyncio.gather(
                *(
                    scheduler.schedule(b"f32", at=due, exchange=exchange, routing_key=key)
                    for exchange, key in routes + missing
                )
            )
        delivered_ids = {s.schedule_id for s in scheduled[: len(routes)]}
        parked_ids = {s.schedule_id for s in scheduled[len(routes) :]}
        await target.wait_for_ids(delivered_ids, within=60)
        await parked.wait_for_ids(parked_ids, within=60)
        await target.settle(1.0)

        assert sorted(target.counts().values()) == [1] * len(routes)
        assert set(target.counts()) == delivered_ids
        assert sorted(parked.counts().values()) == [1] * len(missing)
        assert set(parked.counts()) == parked_ids
        target.assert_never_early()
        assert relay.stats.reconnects == 0
        await relays.stop(relay)
    finally:
        await connection.close()
