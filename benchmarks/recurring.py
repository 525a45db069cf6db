"""Recurring schedules at scale: lateness per occurrence beside one-shot messages in the
same run, the relay's CPU per delivered message, and the broker's queue depths over time.

One hopsched (quorum ladder, relay as its own process) on a fresh prefix of the broker at
``--url``: ``--schedules`` recurring schedules every ``--every`` seconds (their starts
spread over the first interval), and one-shot messages paced at ``--one-shots`` per
second (delays uniform in 1 s .. ``--every``), for ``--minutes``. Every occurrence and
one-shot is received by a consumer of one target queue: lateness = receive instant - due
time (``x-hopsched-due``). Every 5 s it samples the relay process's CPU time (psutil) and
the depth of the relay queue and of all step queues (passive declares): stable depths say
the chains do not grow. At the end it cancels every schedule, counts what arrived per
occurrence key (``x-hopsched-key``: lost, duplicated), and tears the prefix down.

    python benchmarks/recurring.py --url amqp://… --json benchmarks/results/recurring/r.json
    # the issue's run: --schedules 10000 --every 10 --minutes 10 (a quiet machine)
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aio_pika
import click
import psutil

import hopsched
from hopsched import mask_url
from hopsched.clock import now_us, us_to_datetime
from hopsched.envelope import HEADER_DUE, HEADER_KEY
from hopsched.topology import Topology

S = 1_000_000
SAMPLE_S = 5.0


def percentiles(values_us: list[int]) -> dict[str, float | int | None]:
    if not values_us:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "min_ms": None}
    ordered = sorted(values_us)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000, 2)

    return {
        "n": len(ordered),
        "min_ms": round(ordered[0] / 1000, 2),
        "p50_ms": at(0.50),
        "p99_ms": at(0.99),
        "max_ms": round(ordered[-1] / 1000, 2),
    }


async def start_relay(url: str, prefix: str) -> tuple[asyncio.subprocess.Process, list[str]]:
    env = dict(os.environ) | {"HOPSCHED_URL": url, "HOPSCHED_PREFIX": prefix}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "hopsched", "relay", env=env, stderr=asyncio.subprocess.PIPE
    )
    lines: list[str] = []
    assert process.stderr is not None
    async with asyncio.timeout(60):
        while True:
            line = (await process.stderr.readline()).decode(errors="replace")
            if not line:
                raise RuntimeError("the relay exited:\n" + "".join(lines))
            lines.append(line)
            if "relay consuming" in line:
                break

    async def drain() -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            lines.append(line.decode(errors="replace"))

    asyncio.get_running_loop().create_task(drain())
    return process, lines


async def depths(channel: aio_pika.abc.AbstractChannel, topology: Topology) -> dict[str, int]:
    relay = await channel.declare_queue(topology.relay_queue, passive=True)
    steps = 0
    for name in topology.step_queues:
        queue = await channel.declare_queue(name, passive=True)
        steps += queue.declaration_result.message_count or 0
    return {"relay": relay.declaration_result.message_count or 0, "steps": steps}


async def run(
    url: str, schedules: int, every_s: float, minutes: float, one_shots: float
) -> dict[str, Any]:
    prefix = f"hopsched-bench-recurring-{uuid.uuid4().hex[:8]}"
    settings = hopsched.Settings(url=url, prefix=prefix)
    topology = Topology.from_settings(settings)
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    target = await channel.declare_queue(f"{prefix}-target", durable=True)
    received: list[tuple[str | None, int, int]] = []  # (occurrence key, due, received)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        key = headers.get(HEADER_KEY)
        due = headers.get(HEADER_DUE)
        received.append((key if isinstance(key, str) else None, int(due or 0), now_us()))
        await message.ack()

    await target.consume(on_message)
    relay, relay_log = await start_relay(url, prefix)
    cpu = psutil.Process(relay.pid)
    samples: list[dict[str, Any]] = []
    ids = [f"rec-{n}" for n in range(schedules)]
    one_shot_count = 0
    try:
        async with hopsched.Scheduler(settings, declare=True) as scheduler:
            began = now_us()
            first = began + 2 * S
            for n, schedule_id in enumerate(ids):
                await scheduler.schedule(
                    b"occurrence",
                    every=every_s,
                    start=us_to_datetime(first + int(every_s * S * n / schedules)),
                    routing_key=target.name,
                    schedule_id=schedule_id,
                )
            scheduled_s = (now_us() - began) / S
            cpu_start = sum(cpu.cpu_times()[:2])
            delivered_start = len(received)
            started = time.monotonic()
            end = started + minutes * 60
            next_sample = started
            rng = random.Random(22)
            while (now := time.monotonic()) < end:
                if now >= next_sample:
                    row = {"t_s": round(now - started, 1), **await depths(channel, topology)}
                    row["relay_cpu_s"] = round(sum(cpu.cpu_times()[:2]) - cpu_start, 2)
                    row["delivered"] = len(received) - delivered_start
                    samples.append(row)
                    print(row, file=sys.stderr)
                    next_sample += SAMPLE_S
                if one_shots > 0:
                    await scheduler.schedule(
                        b"one-shot", delay=rng.uniform(1.0, every_s), routing_key=target.name
                    )
                    one_shot_count += 1
                    await asyncio.sleep(1 / one_shots)
                else:
                    await asyncio.sleep(0.1)
            cpu_used = sum(cpu.cpu_times()[:2]) - cpu_start
            delivered_during = len(received) - delivered_start
            stopped = now_us()
            await scheduler.cancel_many(ids)
        await asyncio.sleep(every_s + 2)  # one-shots still due, the last occurrences
    finally:
        relay.terminate()
        await relay.wait()
        await topology.teardown(connection, force=True)
        await target.delete(if_unused=False, if_empty=False)
        await connection.close()

    recurring = [(k, d, r) for k, d, r in received if k is not None]
    keys: dict[str, int] = {}
    for key, _, _ in recurring:
        keys[key] = keys.get(key, 0) + 1
    expected = {
        f"{schedule_id}@{first + int(every_s * S * n / schedules) + k * int(every_s * S)}"
        for n, schedule_id in enumerate(ids)
        for k in range(int((stopped - first) / (every_s * S)))
        if first + int(every_s * S * n / schedules) + k * int(every_s * S) < stopped - S
    }
    return {
        "setup": {
            "broker": mask_url(url),
            "hopsched": version("hopsched"),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "schedules": schedules,
            "every_s": every_s,
            "minutes": minutes,
            "one_shots_per_s": one_shots,
            "scheduling_the_schedules_s": round(scheduled_s, 1),
        },
        "recurring_lateness": percentiles([r - d for _, d, r in recurring]),
        "one_shot_lateness": percentiles([r - d for k, d, r in received if k is None]),
        "early": sum(1 for _, d, r in received if r < d),
        "occurrences_expected": len(expected),
        "occurrences_lost": len(expected - set(keys)),
        "occurrence_duplicates": sum(count - 1 for count in keys.values()),
        "one_shots_scheduled": one_shot_count,
        "one_shots_received": sum(1 for k, _, _ in received if k is None),
        "relay_cpu_us_per_delivered_message": round(cpu_used * S / max(1, delivered_during), 1),
        "depth_samples": samples,
        "relay_log_tail": relay_log[-3:],
    }


@click.command()
@click.option("--url", envvar="HOPSCHED_URL", required=True, help="The broker (a test one).")
@click.option("--schedules", default=10_000, show_default=True)
@click.option("--every", "every_s", default=10.0, show_default=True, help="Interval, s.")
@click.option("--minutes", default=10.0, show_default=True)
@click.option("--one-shots", default=100.0, show_default=True, help="One-shot messages per s.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(
    url: str,
    schedules: int,
    every_s: float,
    minutes: float,
    one_shots: float,
    json_path: Path | None,
) -> None:
    """Recurring schedules beside one-shots: lateness, relay CPU, queue depths."""
    result = asyncio.run(run(url, schedules, every_s, minutes, one_shots))
    text = json.dumps(result, indent=2)
    print(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    first, last = result["depth_samples"][1:2], result["depth_samples"][-1:]
    print(
        f"recurring {result['recurring_lateness']}, one-shot {result['one_shot_lateness']}, "
        f"lost {result['occurrences_lost']} of {result['occurrences_expected']}, relay "
        f"{result['relay_cpu_us_per_delivered_message']} µs CPU/message, depths "
        f"{first} -> {last}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
