"""The topology's dead-letter path and delivery limits, and the upgrade of a prefix
declared by an earlier hopsched, against the real broker."""

from __future__ import annotations

import re
from typing import Any

import aio_pika
import pytest
from support import Cleanup, get_all, hopsched_cli, queue_arguments, rabbitmqctl_path

import hopsched
from hopsched.broker.objects import declare_topology, inspect, upgrade
from hopsched.topology import (
    DEAD_LETTER_ROUTING_KEY,
    LEADER_LOCATOR,
    PARKED_DELIVERY_LIMIT,
    RELAY_DELIVERY_LIMIT,
)

AMQP = aio_pika.abc.AbstractConnection


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_the_relay_queue_dead_letters_into_the_parking_queue(queue_type: str) -> None:
    settings = hopsched.Settings(prefix="p", queue_type=queue_type)  # type: ignore[arg-type]
    topology = hopsched.Topology.from_settings(settings)

    relay = topology.relay_arguments()

    assert relay["x-dead-letter-exchange"] == ""
    assert relay["x-dead-letter-routing-key"] == "p.parked"
    if queue_type == "quorum":
        assert relay["x-delivery-limit"] == RELAY_DELIVERY_LIMIT
        assert relay["x-dead-letter-strategy"] == "at-least-once"
        assert topology.parked_arguments()["x-delivery-limit"] == PARKED_DELIVERY_LIMIT
    else:  # classic queues have no delivery limit
        assert "x-delivery-limit" not in relay


def test_the_least_grant_covers_every_object_of_the_prefix() -> None:
    """Every queue (the stream included) and the exchange match the operator's and the
    relay's configure patterns and the operator's read; another prefix's do not. The
    relay may not read the parking queue (it reads the journal, to restore a cancel
    stream deleted under it); the producer configures and reads nothing."""
    topology = hopsched.Topology.from_settings(hopsched.Settings(prefix="app.x"))
    operator, relay = topology.permissions("operator"), topology.permissions("relay")
    producer = topology.permissions("producer", ["orders"])
    names = [*topology.all_queues(), topology.expired_exchange]
    for pattern in (operator.configure, operator.read, relay.configure):
        assert all(re.match(pattern, name) for name in names), (pattern, names)
        assert not re.match(pattern, "app.y.relay")
        assert not re.match(pattern, "app.xrelay")
    assert [name for name in names if not re.match(relay.read, name)] == [
        "app.x.parked",
        "app.x.ingresses",
    ]
    assert (producer.configure, producer.read) == ("^$", "^$")
    assert [name for name in ("amq.default", "app.x.expired", "orders", "app.x.relay")
            if re.match(producer.write, name)] == ["amq.default", "app.x.expired"]  # fmt: skip
    assert re.match(relay.write, "orders") is None
    assert re.match(topology.permissions("relay", ["orders"]).write, "orders")
    with pytest.raises(ValueError, match="one of producer, relay, operator"):
        topology.permissions("admin")  # type: ignore[arg-type]


@pytest.mark.skipif(rabbitmqctl_path() is None, reason="needs rabbitmqctl to read arguments")
async def test_declared_arguments_are_what_the_broker_holds(
    settings: hopsched.Settings,
) -> None:
    await declare_topology(settings)
    topology = hopsched.Topology.from_settings(settings)

    held = await queue_arguments()

    for name, wanted in topology.queues().items():
        assert {key: value for key, (_, value) in held[name].items()} == wanted


async def old_topology(settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup) -> None:
    """What hopsched < 0.2 declared for the relay and parked queues (no delivery limit,
    no dead-lettering), with a message in each."""
    topology = hopsched.Topology.from_settings(settings)
    cleanup.queues.update(
        f"{name}.upgrade" for name in (topology.relay_queue, topology.parked_queue)
    )
    async with amqp.channel() as channel:
        exchange = await channel.declare_exchange(
            topology.expired_exchange, aio_pika.ExchangeType.DIRECT, durable=True
        )
        for name in (topology.relay_queue, topology.parked_queue):
            await channel.declare_queue(
                name, durable=True, arguments={"x-queue-type": settings.queue_type}
            )
            await channel.default_exchange.publish(
                aio_pika.Message(name.encode(), headers={"k": 1}, delivery_mode=2),
                routing_key=name,
            )
        relay = await channel.get_queue(topology.relay_queue)
        await relay.bind(exchange, DEAD_LETTER_ROUTING_KEY)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_an_earlier_prefix_is_refused_with_the_upgrade_path_then_upgraded(
    settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup, queue_type: str
) -> None:
    """Declaring over hopsched < 0.2's queues names ``hopsched upgrade``; the upgrade
    re-declares them and keeps their messages, and the topology then declares cleanly."""
    await old_topology(settings, amqp, cleanup)
    topology = hopsched.Topology.from_settings(settings)

    with pytest.raises(hopsched.TopologyMismatchError) as caught:
        await declare_topology(settings)
    print(f"\n{caught.value}")
    assert "hopsched upgrade" in str(caught.value)
    assert caught.value.queue == topology.relay_queue

    done = await upgrade(topology, amqp)

    print("\n".join(done))
    assert len(done) == 2
    await declare_topology(settings)  # no mismatch now
    for name in (topology.relay_queue, topology.parked_queue):
        kept: list[Any] = await get_all(amqp, name)
        assert [m.body for m in kept] == [name.encode()]
        kept[0].headers.pop("x-delivery-count", None)  # a quorum queue adds it to a get
        assert kept[0].headers == {"k": 1}
    for name in (topology.relay_queue, topology.parked_queue):
        async with amqp.channel() as channel:
            with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
                await channel.declare_queue(f"{name}.upgrade", passive=True)


async def test_the_upgrade_refuses_while_a_relay_consumes(
    settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup
) -> None:
    await old_topology(settings, amqp, cleanup)
    topology = hopsched.Topology.from_settings(settings)

    async def ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        pass

    async with amqp.channel() as channel:
        queue = await channel.get_queue(topology.relay_queue)
        await queue.consume(ignore)

        with pytest.raises(hopsched.HopschedError, match="stop every relay"):
            await upgrade(topology, amqp)


async def test_the_cli_names_the_upgrade_and_runs_it(
    settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup
) -> None:
    """``hopsched declare`` over an earlier prefix exits 1 naming ``hopsched upgrade``;
    that command upgrades it, and ``declare`` then succeeds."""
    await old_topology(settings, amqp, cleanup)

    status, _, err = await hopsched_cli("declare", settings=settings)
    assert status == 1
    assert "hopsched upgrade" in err

    status, out, err = await hopsched_cli("upgrade", settings=settings)
    assert status == 0, err
    assert "1 message kept" in out

    status, _, err = await hopsched_cli("declare", settings=settings)
    assert status == 0, err


async def test_queues_declared_without_the_leader_locator_are_kept_as_they_are(
    make_settings: Any, amqp: AMQP
) -> None:
    """A ladder declared before ``x-queue-leader-locator=balanced``: RabbitMQ refuses the
    redeclare (406), declare() keeps the queues as they are, ``status`` checks pass."""
    settings = make_settings(queue_type="quorum")
    topology = hopsched.Topology.from_settings(settings)
    async with amqp.channel() as channel:
        for name, arguments in topology.queues().items():
            older = {k: v for k, v in arguments.items() if k != LEADER_LOCATOR}
            await channel.declare_queue(name, durable=True, arguments=older)

    await declare_topology(settings)  # no TopologyMismatchError

    held = await queue_arguments()
    assert all(LEADER_LOCATOR not in held[name] for name in topology.queues())
    depths = await inspect(topology, amqp)
    assert all(depth is not None for depth in depths.values())
