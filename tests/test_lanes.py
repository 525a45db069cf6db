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
from amqp_support import Outcomes, encoded, open_connection
from broker import PrivateBroker
from support import Cleanup, Relays, Targets, message_count, unique

import hopsched
from hopsched.amqp import Outcome
from hopsched.errors import ChannelClosedError
from hopsched.publisher import LADDER_LANE, Publisher, target_lane

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
