"""``pending()`` and ``get()`` over N pending schedules: one process schedules N messages
(100-byte bodies, one byte repeated or random; due in an hour or more; ``schedule_many``
in batches of 10,000) on a prefix of its own, times ``pending()`` over all of them and
one ``get()``, prints the peak RSS before and after (``getrusage``), and tears the
prefix down (with ``--keep``: leaves it, to time ``hopsched pending --prefix P`` in a
process of its own and ``du`` the journal's stream files; ``hopsched teardown --force``
removes it).

    python -P benchmarks/journal_pending.py --count 1000000 [--random-bodies] [--one-by-one]
        [--keep] [--url URL]

``--one-by-one`` schedules each message with a ``schedule()`` call of its own (awaited
before the next: a journal record per stream message, the costliest storage case).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
import uuid

import hopsched
from hopsched import ScheduleRequest
from hopsched.broker.objects import teardown
from hopsched.connect import connect


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("HOPSCHED_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument(
        "--random-bodies",
        action="store_true",
        help="bodies of random bytes (nothing to compress), not one byte repeated",
    )
    parser.add_argument(
        "--one-by-one",
        action="store_true",
        help="a schedule() call per message, one after another (not schedule_many)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the prefix on the broker (printed)"
    )
    args = parser.parse_args()

    def body() -> bytes:
        return os.urandom(100) if args.random_bodies else b"x" * 100

    settings = hopsched.Settings(url=args.url, prefix=f"jpending-{uuid.uuid4().hex[:6]}")
    try:
        async with hopsched.Scheduler(settings, declare=True) as scheduler:
            started = time.monotonic()
            for i in range(args.count if args.one_by_one else 0):
                await scheduler.schedule(body(), routing_key="orders.timeout", delay=3600 + i)
            for start in range(0, 0 if args.one_by_one else args.count, 10_000):
                await scheduler.schedule_many(
                    ScheduleRequest(body(), "orders.timeout", delay=3600 + i)
                    for i in range(start, min(args.count, start + 10_000))
                )
            print(f"scheduled {args.count} in {time.monotonic() - started:.1f} s")
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
            started = time.monotonic()
            listed, last = 0, None
            async for info in scheduler.pending():
                listed, last = listed + 1, info.schedule_id
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
            print(
                f"pending() listed {listed} in {time.monotonic() - started:.1f} s; "
                f"peak RSS {before} -> {after} MB"
            )
            if last is not None:
                started = time.monotonic()
                await scheduler.get(last)
                print(f"get() in {time.monotonic() - started:.1f} s")
    finally:
        if args.keep:
            print(f"kept prefix {settings.prefix}")
        else:
            connection = await connect(settings)
            async with connection:
                await teardown(hopsched.Topology.from_settings(settings), connection, force=True)


asyncio.run(main())
