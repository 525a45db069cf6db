"""The consumer-hold worker: consume at once, hold each message in memory until its due
time (header ``x-bench-due``, µs since the epoch), publish it to the target queue with a
publisher confirm, then ack. Runs until SIGTERM.

Usage: python bench_hold_worker.py URL SOURCE_QUEUE TARGET_QUEUE
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import aio_pika

# As bench_measure.BENCH_DUE, not imported from there: that module loads psutil and the
# HDR histogram, which would add to the RSS this worker is measured by.
BENCH_DUE = "x-bench-due"


async def _sleep_until(due_us: int) -> None:
    while (wait_us := due_us - time.time_ns() // 1000) > 0:  # noqa: ASYNC110 - a timer
        await asyncio.sleep(wait_us / 1_000_000)


async def main(url: str, source: str, target: str) -> None:
    connection = await aio_pika.connect(url, name="bench-hold-worker")
    async with connection:
        publisher = await connection.channel(publisher_confirms=True)
        consumer = await connection.channel()
        await consumer.set_qos(prefetch_count=0)  # unlimited, as Celery does for ETA tasks
        queue = await consumer.get_queue(source, ensure=False)
        held: set[asyncio.Task[None]] = set()

        async def hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            due_us = (message.headers or {}).get(BENCH_DUE)
            if isinstance(due_us, int):
                await _sleep_until(due_us)
            await publisher.default_exchange.publish(
                aio_pika.Message(
                    message.body,
                    headers=message.headers,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=target,
            )
            await message.ack()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            task = asyncio.create_task(hold(message))
            held.add(task)
            task.add_done_callback(held.discard)

        await queue.consume(on_message)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        for task in held:  # unacked: the broker requeues them when the connection closes
            task.cancel()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
