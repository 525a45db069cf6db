"""Schedule COUNT messages with delays uniform in [1 h, 24 h] through hopsched's
Scheduler, many in flight (the backlog scenario runs several of these at once, one per
core, since one Python process is the bottleneck). Prints ``N`` lines as it goes and
``done N FAILURES`` at the end.

Usage: python bench_fill.py URL PREFIX QUEUE_TYPE COUNT SEED TARGET_QUEUE ID_PREFIX
"""

from __future__ import annotations

import asyncio
import random
import sys
from datetime import timedelta

from bench_measure import Pipeline

import hopsched

IN_FLIGHT = 1000
REPORT_EVERY = 5000


async def main(
    url: str, prefix: str, queue_type: str, count: int, seed: int, target: str, ids: str
) -> None:
    settings = hopsched.Settings(url=url, prefix=prefix, queue_type=queue_type)  # type: ignore[arg-type]
    rng = random.Random(seed)
    pipeline = Pipeline(IN_FLIGHT)
    failures = 0
    async with hopsched.Scheduler(settings, declare=True) as scheduler:

        async def one(index: int) -> None:
            nonlocal failures
            try:
                await scheduler.schedule(
                    b"x" * 64,
                    delay=timedelta(seconds=rng.uniform(3600, 24 * 3600)),
                    routing_key=target,
                    schedule_id=f"{ids}-{index}",
                )
            except hopsched.HopschedError:
                failures += 1

        for index in range(count):
            await pipeline.submit(one(index))
            if index % REPORT_EVERY == 0:
                print(index, flush=True)
        await pipeline.drain()
    print(f"done {count} {failures}", flush=True)


if __name__ == "__main__":
    url, prefix, queue_type, count, seed, target, ids = sys.argv[1:8]
    asyncio.run(main(url, prefix, queue_type, int(count), int(seed), target, ids))
