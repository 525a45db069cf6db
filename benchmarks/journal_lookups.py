"""``get()`` answered by a relay (``hopsched relay --lookups``) over N pending schedules:
one process schedules N messages (100-byte bodies, due in a day or more;
``schedule_many`` in batches of 10,000) on a prefix of its own, starts ``hopsched relay
--lookups`` as a process of its own, waits for its "answering" line (how long it took
to read the journal), then times ``get(id)`` of ``--gets`` random ids one after another
(p50 / p99 / max) while another Scheduler schedules ``--rate`` messages a second (each
look-up reads what was written since the last), one ``get_many`` of 1,000 ids, the
relay's RSS and CPU, and one ``get()`` read from the journal (no relay answering: the
relay stopped) to compare; then tears the prefix down.

    python -P benchmarks/journal_lookups.py --count 1000000 [--gets 2000] [--rate 500]
        [--url URL]

Use a broker of its own (a million pending messages): e.g. a private node
(``.ci/node.py``, docs/private-nodes.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import sys
import time
import uuid

import psutil

import hopsched
from hopsched import ScheduleRequest
from hopsched.broker.objects import teardown
from hopsched.connect import connect

_ANSWERING = re.compile(r"look-ups: answering on \S+ \(read (\d+) ids")


def process_cpu_s(pid: int) -> float:
    """User + system CPU of process ``pid`` so far, s."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def schedule_at(scheduler: hopsched.Scheduler, rate: float) -> None:
    """Schedule ``rate`` messages a second (due in a day) until cancelled."""
    if rate <= 0:
        return
    started, sent = time.monotonic(), 0
    while True:
        await scheduler.schedule(b"y" * 100, routing_key="orders.timeout", delay=86_400)
        sent += 1
        await asyncio.sleep(max(0.0, started + sent / rate - time.monotonic()))


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("HOPSCHED_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--gets", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=500.0, help="schedules/s meanwhile")
    args = parser.parse_args()
    settings = hopsched.Settings(url=args.url, prefix=f"jlookups-{uuid.uuid4().hex[:6]}")
    ids: list[str] = []
    relay: asyncio.subprocess.Process | None = None
    try:
        async with hopsched.Scheduler(settings, declare=True) as scheduler:
            started = time.monotonic()
            for start in range(0, args.count, 10_000):
                done = await scheduler.schedule_many(
                    ScheduleRequest(b"x" * 100, "orders.timeout", delay=86_400 + i)
                    for i in range(start, min(args.count, start + 10_000))
                )
                ids.extend(s.schedule_id for s in done if isinstance(s, hopsched.Scheduled))
            print(f"scheduled {len(ids)} in {time.monotonic() - started:.1f} s", flush=True)

            environment = {**os.environ, "HOPSCHED_URL": args.url}
            environment["HOPSCHED_PREFIX"] = settings.prefix
            started = time.monotonic()
            relay = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hopsched", "relay", "--lookups",
                env=environment, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert relay.stderr is not None
            while not (match := _ANSWERING.search((await relay.stderr.readline()).decode())):
                if relay.returncode is not None:
                    raise SystemExit("the relay exited before it answered look-ups")
            print(
                f"relay: read {int(match.group(1))} ids in {time.monotonic() - started:.1f} s "
                f"(from its start); RSS {rss_mib(relay.pid):.0f} MiB",
                flush=True,
            )
            drained = asyncio.ensure_future(relay.stderr.read())  # keep its pipe drained

            await scheduler.get(ids[0])  # the asking channel opened
            for rate in sorted({0.0, args.rate}):
                async with hopsched.Scheduler(settings) as producer:
                    writing = asyncio.ensure_future(schedule_at(producer, rate))
                    cpu_before = process_cpu_s(relay.pid)
                    took: list[float] = []
                    for schedule_id in random.sample(ids, min(args.gets, len(ids))):
                        started = time.perf_counter()
                        info = await scheduler.get(schedule_id)
                        took.append((time.perf_counter() - started) * 1000)
                        if info is None or info.state != "pending":
                            raise SystemExit(f"{schedule_id}: {info}, where it is pending")
                    relay_cpu_ms = (process_cpu_s(relay.pid) - cpu_before) * 1000 / len(took)
                    writing.cancel()
                    await asyncio.wait({writing})
                print(
                    f"get() x {len(took)}, {rate:g} schedules/s meanwhile: "
                    f"p50 {statistics.median(took):.2f} ms, "
                    f"p99 {percentile(took, 0.99):.2f} ms, max {max(took):.2f} ms; "
                    f"relay CPU {relay_cpu_ms:.2f} ms per get",
                    flush=True,
                )
            sample = random.sample(ids, min(1000, len(ids)))
            started = time.perf_counter()
            many = await scheduler.get_many(sample)
            assert all(info is not None for info in many.values())
            print(
                f"get_many({len(sample)} ids): {(time.perf_counter() - started) * 1000:.1f} ms; "
                f"relay RSS {rss_mib(relay.pid):.0f} MiB",
                flush=True,
            )

            relay.send_signal(signal.SIGTERM)
            await relay.wait()
            await drained
            relay = None
            started = time.perf_counter()
            info = await scheduler.get(ids[-1])
            assert info is not None
            print(
                f"get() with no relay answering (the journal read): "
                f"{time.perf_counter() - started:.1f} s",
                flush=True,
            )
    finally:
        if relay is not None and relay.returncode is None:
            relay.send_signal(signal.SIGTERM)
            await relay.wait()
        connection = await connect(settings)
        async with connection:
            await teardown(hopsched.Topology.from_settings(settings), connection, force=True)


asyncio.run(main())
