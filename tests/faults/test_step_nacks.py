"""A step queue that nacks every publish is routed around by a smaller step (F39 on one
node), on a private node: a policy (``max-length`` 0, ``overflow`` reject-publish) makes
one step queue refuse each publish with ``basic.nack``, as a quorum queue does while it
elects a leader after its leader's node went down (``tests/faults/test_cluster.py`` shows that
on a cluster).

Before: ``schedule()`` sent the message to the same step again and again with back-off
and raised ``PublishRejectedError`` after ``publish_timeout_s``. After: the first nack
sends it by the next smaller step at once; later calls skip the step for a while.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Awaitable, Callable

import aio_pika
import pytest
from support import Relays, message_count
from support.private_nodes import PrivateBroker

import hopsched
from hopsched.broker.objects import declare_topology
from hopsched.core.clock import now_us
from hopsched.core.envelope import HEADER_HOP_EXPIRES, Envelope
from hopsched.core.ladder import US_PER_MS

pytestmark = pytest.mark.slow

SECOND = 1_000_000
NACK_ALL = '{"max-length": 0, "overflow": "reject-publish"}'


async def nack_everything_in(node: PrivateBroker, queue: str) -> None:
    """Set the policy on ``queue`` alone and wait until the broker applies it."""
    await node.rabbitmqctl(
        "set_policy", "--apply-to", "queues", "nack-all", f"^{re.escape(queue)}$", NACK_ALL
    )
    for _ in range(100):
        out = await node.rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "policy")
        if f"{queue}\tnack-all" in out or any(
            line.split() == [queue, "nack-all"] for line in out.splitlines()
        ):
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"the policy never applied to {queue}: {out}")


async def queue_depths(node: PrivateBroker, *queues: str) -> tuple[int, ...]:
    """Ready messages in each of ``queues``, exact: a passive declare asks the queue
    itself, where ``rabbitmqctl list_queues`` shows a quorum queue's statistics as of its
    last tick (every 5 s), 0 for a message published just before (seen in CI)."""
    connection = await aio_pika.connect(node.url)
    try:
        return tuple([await message_count(connection, queue) for queue in queues])
    finally:
        await connection.close()


async def test_a_nacking_step_queue_is_routed_around_by_a_smaller_step(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = await start_private_broker()
    prefix = f"n{uuid.uuid4().hex[:8]}"
    settings = hopsched.Settings(url=node.url, prefix=prefix, publish_timeout_s=20)
    await declare_topology(settings)
    nacking, smaller = f"{prefix}.step.524288", f"{prefix}.step.262144"  # 600 s: 524288 first
    caplog.set_level(logging.DEBUG, logger="hopsched.scheduler")
    async with hopsched.Scheduler(settings) as scheduler:
        filler = await scheduler.schedule(b"filler", delay=600, routing_key="anywhere")
        assert filler.first_queue == nacking
        # a quorum queue refuses publishes once over its length limit: one message is over 0
        await nack_everything_in(node, nacking)
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = await scheduler.schedule(b"first", delay=600, routing_key="anywhere")
        took_s = loop.time() - started
        second = await scheduler.schedule(b"second", delay=600, routing_key="anywhere")
    print(f"\nnacked by {nacking}: scheduled by {first.first_queue} in {took_s:.2f} s")
    assert first.first_queue == second.first_queue == smaller
    nacks = [r for r in caplog.records if "nacked a publish" in r.getMessage()]
    # one nack: the second call skipped the step (avoided for a while after it)
    assert [(r.levelno, nacking in r.getMessage()) for r in nacks] == [(logging.WARNING, True)]
    assert await queue_depths(node, nacking, smaller) == (1, 2)
    # each carries its own step's hop stamp: the relay measures it against 262,144 ms
    connection = await aio_pika.connect(node.url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(smaller, ensure=False)
        stamps = {}
        for _ in range(2):  # both held: a requeued one would come first again (4.0)
            message = await queue.get(no_ack=False)
            assert message is not None
            stamps[message.headers["x-hopsched-id"]] = message.headers[HEADER_HOP_EXPIRES]
    finally:
        await connection.close()  # returns both to the queue
    for scheduled in (first, second):
        expires_us = stamps[scheduled.schedule_id]  # publish time + 262,144 ms
        assert isinstance(expires_us, int)
        assert scheduled.due_us - 600 * SECOND <= expires_us - 262_144 * US_PER_MS
        assert expires_us <= scheduled.due_us  # the hop ends before the due time

    # The relay's hops: two messages due in 600 s reach it (as from a step); the first
    # hop is nacked by the step, tried again by the smaller one, the second goes there.
    relays = Relays()
    connection = await aio_pika.connect(node.url)
    try:
        relay = await relays.start(settings)
        channel = await connection.channel()
        for name in ("relayed-1", "relayed-2"):
            envelope = Envelope(name, now_us() + 600 * SECOND, "", "anywhere")
            message = aio_pika.Message(b"relayed", headers=envelope.to_headers())  # type: ignore[arg-type]
            await channel.default_exchange.publish(message, routing_key=f"{prefix}.relay")
            for _ in range(300):
                depths = await queue_depths(node, nacking, smaller, f"{prefix}.parked")
                if depths[1] == 2 + int(name[-1]):
                    break
                await asyncio.sleep(0.1)
        assert depths == (1, 4, 0)
        assert relay.stats.hop_nacks == 1  # the second hop skipped the step
    finally:
        await relays.stop_all()
        await connection.close()
