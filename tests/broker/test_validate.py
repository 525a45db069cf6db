"""The header and property checks of ``tests/unit/test_validate.py`` against the broker:
what the edge values become at a consumer, what closes a connection, the frame-size
boundary and the expiration edges (F14, F17, F18)."""

from __future__ import annotations

import contextlib

import aio_pika
import aiormq
import pytest
from pamqp.commands import Basic
from support import Targets, message_count
from unit.test_validate import EDGE_HEADERS, INF, NAN, after_wire, rabbitmq_accepts, refusal, same

from hopsched.core.validate import (
    check_expiration,
    check_frame_size,
    check_headers,
    content_header_size,
)
from hopsched.errors import InvalidScheduleError


async def doomed_publish(
    broker_url: str, queue: str, message: aio_pika.Message, error: type[Exception]
) -> None:
    """Publish ``message`` on a connection of its own, which the broker must close
    with ``error`` (no other test's publishes share it)."""
    connection = await aio_pika.connect(broker_url)
    try:
        channel = await connection.channel()
        with pytest.raises(error):
            await channel.default_exchange.publish(message, routing_key=queue)
    finally:
        with contextlib.suppress(Exception):
            await connection.close()


async def test_F14_edge_values_reach_a_consumer_as_documented(
    amqp: aio_pika.abc.AbstractConnection, targets: Targets
) -> None:
    # Once straight to the queue, once dead-lettered: RabbitMQ re-encodes the headers
    # when it adds x-death, as on every hop of the ladder.
    target = await targets.queue()
    dead_letter = targets.name("dead-letter")
    await targets.queue(
        dead_letter,
        arguments={
            "x-message-ttl": 0,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": target.name,
        },
        consume=False,
    )
    headers = check_headers(EDGE_HEADERS)

    async with amqp.channel() as channel:
        for queue in (target.name, dead_letter):
            message = aio_pika.Message(b"edges", headers=headers, message_id=queue)
            await channel.default_exchange.publish(message, routing_key=queue)
    received = await target.wait_for(2, within=30)

    assert {copy.properties.message_id for copy in received} == {target.name, dead_letter}
    for copy in received:
        ours = {name: value for name, value in copy.headers.items() if name in EDGE_HEADERS}
        assert same(ours, after_wire(EDGE_HEADERS)), copy.properties.message_id


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=repr)
async def test_F14_a_nan_or_infinite_header_closes_the_connection(
    broker_url: str, targets: Targets, value: float
) -> None:
    target = await targets.queue(consume=False)

    assert "541 INTERNAL_ERROR" in refusal({"f": value})
    await doomed_publish(
        broker_url,
        target.name,
        aio_pika.Message(b"x", headers={"f": value}),
        aiormq.exceptions.ConnectionInternalError,
    )


async def test_F17_the_frame_size_boundary_on_the_broker(
    broker_url: str, amqp: aio_pika.abc.AbstractConnection, targets: Targets
) -> None:
    frame_max = amqp.transport.connection.connection_tune.frame_max
    target = await targets.queue(consume=False)

    def message(frame_size: int) -> aio_pika.Message:
        def padded(pad: str) -> aio_pika.Message:
            return aio_pika.Message(b"x", headers={"pad": pad}, message_id="m")

        unpadded = content_header_size(padded("").properties, 1)
        built = padded("p" * (frame_size - unpadded))
        assert content_header_size(built.properties, 1) == frame_size
        return built

    largest, tolerated, too_large = (message(frame_max + extra) for extra in (0, 8, 9))
    check_frame_size(largest.properties, 1, frame_max)
    for refused in (tolerated, too_large):
        with pytest.raises(InvalidScheduleError, match="501 FRAME_ERROR"):
            check_frame_size(refused.properties, 1, frame_max)

    async with amqp.channel() as channel:
        for accepted in (largest, tolerated):  # RabbitMQ's 8 bytes of slack past the spec
            await channel.default_exchange.publish(accepted, routing_key=target.name)
    await doomed_publish(broker_url, target.name, too_large, aiormq.exceptions.ConnectionFrameError)
    assert await message_count(amqp, target.name) == 2
    print(f"frame_max {frame_max}: header frames of {frame_max + 8} bytes pass, one more fails")


EXPIRATIONS_ON_THE_BROKER = [
    # (the property, RabbitMQ takes it, what check_expiration returns; None: refused)
    ("0", True, "0"),
    ("007", True, "7"),
    ("315360000000", True, "315360000000"),
    ("315360000001", False, None),
    ("99999999999999999999", False, None),
    ("-5000", False, None),
    ("+5", True, None),  # a sign RabbitMQ takes; hopsched asks for plain digits
    ("-0", True, None),
    (" 5", False, None),
    ("5 ", False, None),
    ("1.5", False, None),
    ("abc", False, None),
    ("\u0663", False, None),
]


async def test_F18_expiration_edges_on_the_broker(
    amqp: aio_pika.abc.AbstractConnection, targets: Targets
) -> None:
    target = await targets.queue(consume=False)

    for text, broker_takes, normalized in EXPIRATIONS_ON_THE_BROKER:
        assert rabbitmq_accepts(text) == broker_takes, text
        if normalized is None:
            with pytest.raises(InvalidScheduleError, match="expiration"):
                check_expiration(text)
        else:
            assert check_expiration(text) == normalized
        channel = await amqp.channel()
        raw = await channel.get_underlay_channel()
        publish = raw.basic_publish(
            b"x", routing_key=target.name, properties=Basic.Properties(expiration=text)
        )
        if broker_takes:
            assert isinstance(await publish, Basic.Ack), text
            await channel.close()
        else:
            with pytest.raises(
                aiormq.exceptions.ChannelPreconditionFailed, match="invalid expiration"
            ):
                await publish
