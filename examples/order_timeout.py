"""Schedule an order time-out 3 seconds ahead, relay it, and receive it: a whole round
trip in one process, against the broker at HOPSCHED_URL (default: guest on localhost).

    python examples/order_timeout.py

It declares its own target queue, ``hopsched-example-order-timeouts``, and the ladder
of prefix ``hopsched-example`` (``HOPSCHED_PREFIX`` names another, and the queue with
it), and removes both at the end, as ``hopsched teardown --prefix hopsched-example``
would (a ladder is 31 quorum queues: leave none you do not use). In
production the relay runs as its own process (``hopsched relay``), the ladder stays, and
the consumer is your service.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta

import aio_pika

from hopsched import DeliveryInfo, Relay, Scheduler, Settings, Topology
from hopsched.broker.objects import teardown
from hopsched.connect import connect

PREFIX = os.environ.get("HOPSCHED_PREFIX", "hopsched-example")
QUEUE = f"{PREFIX}-order-timeouts"  # not "{PREFIX}.…": hopsched's own names are no target


async def main() -> None:
    settings = Settings(
        url=os.environ.get("HOPSCHED_URL", "amqp://guest:guest@localhost:5672/"),
        prefix=PREFIX,
    )
    relay = Relay(settings)
    relaying = asyncio.create_task(relay.run())
    await relay.wait_consuming()

    connection = await connect(settings)  # an aio-pika connection; walks a URL list
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(QUEUE, durable=True)
        received: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        consumer_tag = await queue.consume(received.put)

        async with Scheduler(settings) as scheduler:
            scheduled = await scheduler.schedule(
                aio_pika.Message(b'{"order": 42}', content_type="application/json"),
                at=datetime.now(UTC) + timedelta(seconds=3),
                routing_key=QUEUE,  # the default exchange routes by queue name
            )
        print(f"scheduled {scheduled.schedule_id} due {scheduled.due.isoformat()}")

        message = await asyncio.wait_for(received.get(), 30)
        async with message.process():
            info = DeliveryInfo.from_headers(message.headers)
            late_ms = (datetime.now(UTC).timestamp() * 1e6 - info.due_us) / 1000
            print(f"received {message.body!r} ({info.schedule_id}), {late_ms:.1f} ms late")
        await queue.cancel(consumer_tag)
        await queue.delete(if_unused=False, if_empty=False)

        await relay.stop()
        await relaying
        await teardown(Topology.from_settings(settings), connection)  # refuses if in use


if __name__ == "__main__":
    asyncio.run(main())
