"""The private-node fixture itself: its own port and config, a crash, a restart on the data."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import aio_pika
import pytest
from broker import PrivateBroker
from support import message_count

#: The fault tests' machinery: in the slow tier with them (the demo's tests start a node too).
pytestmark = pytest.mark.slow


async def test_a_private_node_survives_kill_9_with_its_durable_messages(
    private_broker: PrivateBroker,
) -> None:
    assert private_broker.port != 5672
    connection = await aio_pika.connect(private_broker.url)
    channel = await connection.channel()  # publisher confirms: the message is on disk
    await channel.declare_queue("kept", durable=True)
    await channel.default_exchange.publish(
        aio_pika.Message(b"x", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "kept"
    )
    # The confirm puts the message on disk, but RabbitMQ 3.x keeps queue definitions in
    # Mnesia, whose log reaches the disk lazily: a kill -9 right after the declaration
    # lost the queue itself once in CI. Flush it, as time would.
    await private_broker.rabbitmqctl("eval", "mnesia:dump_log().")
    pid = private_broker.pid
    assert pid is not None

    await private_broker.kill()
    with contextlib.suppress(Exception):
        await connection.close()  # its broker is gone; left open, it outlives the test
    with pytest.raises(aio_pika.exceptions.AMQPConnectionError):  # down, no reply
        await aio_pika.connect(private_broker.url)
    await private_broker.start()

    assert private_broker.pid != pid
    assert (private_broker.starts, private_broker.kills) == (2, 1)
    connection = await aio_pika.connect(private_broker.url)
    assert await message_count(connection, "kept") == 1
    await connection.close()
    assert "kept" in await private_broker.rabbitmqctl("list_queues", "-q", "name")


async def test_extra_config_reaches_the_node(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]],
) -> None:
    node = await start_private_broker(config="consumer_timeout = 61000")

    setting = await node.rabbitmqctl("eval", "application:get_env(rabbit, consumer_timeout).")
    assert setting.strip() == "{ok,61000}"
    listeners = await node.rabbitmqctl("eval", "rabbit_networking:active_listeners().")
    assert f"port = {node.port}" in listeners or str(node.port) in listeners
    assert "5672," not in listeners
