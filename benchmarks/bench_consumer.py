"""The consumer of a strategy's target queue, in a process of its own: its receive
instants do not wait behind the load generator's event loop (pacing, publishing,
confirms). Consumes QUEUE with auto-ack; for each message it takes the receive instant
first, then queues one line for stdout:

    RECEIVED_US <tab> DUE_US <tab> HOPS <tab> STAMPED_DUE_US or - <tab> SCHEDULE_ID
    stray                                   (no id or no due time in the headers)

Lines are written every ~20 ms, not one write per message. Prints ``ready`` once it
consumes; stops on SIGTERM or when its parent process is gone. It ignores SIGINT: a
Ctrl-C at the terminal reaches the whole process group, and the benchmark's cleanup
stops it (SIGTERM) after reading its last lines.

It is the measuring instrument, so it must not be what limits a burst: it consumes with
this repository's own AMQP client (``hopsched.amqp``, ~25 µs per message; an aio-pika
consumer takes ~200 µs and caps a burst at ~4,000 messages/s here), whichever hopsched
is being measured (``--hopsched-path``).

Usage: python bench_consumer.py URL QUEUE
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the consumer process: this repository's hopsched, whichever
    # one is measured (the benchmark process imports this module only for its line format)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_measure import delivery_fields

__all__ = ["READY", "STRAY", "format_line", "parse_line"]

READY = b"ready\n"
STRAY = "stray\n"
FLUSH_S = 0.02


def format_line(fields: tuple[str, int, int, int | None] | None, received_us: int) -> str:
    """One output line: the fields of ``bench_measure.delivery_fields`` (None: a stray)."""
    if fields is None or "\n" in fields[0]:  # an id that would break the line is no bench id
        return STRAY
    schedule_id, due_us, hops, stamped = fields
    stamped_text = "-" if stamped is None else str(stamped)
    return f"{received_us}\t{due_us}\t{hops}\t{stamped_text}\t{schedule_id}\n"


def parse_line(line: str) -> tuple[str, int, int, int, int | None] | None:
    """(schedule id, due µs, hops, received µs, stamped due µs or None) from a
    ``format_line`` line; None for a stray. ValueError for anything else."""
    if line == STRAY:
        return None
    received_us, due_us, hops, stamped, schedule_id = line.rstrip("\n").split("\t", 4)
    stamped_us = None if stamped == "-" else int(stamped)
    return schedule_id, int(due_us), int(hops), int(received_us), stamped_us


async def main(url: str, queue_name: str) -> None:
    from hopsched import amqp

    parent = os.getppid()
    out = sys.stdout.buffer
    lines: list[str] = []
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)

    def flush() -> None:
        if lines:
            out.write("".join(lines).encode(errors="replace"))
            lines.clear()
            out.flush()

    connection = await amqp.connect(amqp.ConnectionParams.from_url(url), name="bench-consumer")
    channel = await connection.channel()

    def on_message(delivery: amqp.Delivery) -> None:
        received_us = time.time_ns() // 1000  # first: lateness is measured here
        headers = delivery.properties.headers if delivery.properties is not None else None
        lines.append(format_line(delivery_fields(headers), received_us))

    await channel.consume(queue_name, on_message, lambda _: stopping.set(), no_ack=True)
    out.write(READY)
    out.flush()
    while not stopping.is_set() and os.getppid() == parent:
        await asyncio.sleep(FLUSH_S)
        flush()
    await connection.close()
    flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # before asyncio.run, which would catch it
    asyncio.run(main(*sys.argv[1:3]))
