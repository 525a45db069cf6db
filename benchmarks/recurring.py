"""Recurring schedules at scale: lateness per occurrence beside one-shot messages in the
same run, the relay's CPU per delivered message, and the broker's queue depths over time.

One hopsched (quorum ladder, relay as its own process) on a fresh prefix of the broker at
``--url``: ``--schedules`` recurring schedules every ``--every`` seconds (their starts
spread over the first interval), and one-shot messages paced at ``--one-shots`` per
second (delays uniform in 1 s .. ``--every``), for ``--minutes``. Every occurrence and
one-shot is received by a consumer of one target queue: lateness = receive instant - due
time (``x-hopsched-due``). Every 5 s it samples the relay process's CPU time (psutil) and
the depth of the relay queue and of all step queues (passive declares): stable depths say
the chains do not grow (the first third of the samples against the last: a verdict).

Every schedule ends by itself: its ``until`` is the end of the run, so its last
occurrence is due inside it, and nothing is cancelled in flight. The run then waits for
the last occurrences (up to ``--grace`` seconds past the last due time) and counts per
occurrence key (``x-hopsched-key``) against the occurrences each rule gives between its
start and ``until``: delivered once, duplicated, missing (expected, never arrived),
unexpected (arrived, not expected), early (before ``x-hopsched-due``: must be 0). A
schedule whose last occurrence did not arrive in the wait is cancelled then, as clean-up
only, and counted. It tears the prefix down at the end.

    python benchmarks/recurring.py --url amqp://… --json benchmarks/results/recurring/r.json
    # the issue's run: --schedules 10000 --every 10 --minutes 10 (a quiet machine)
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import subprocess
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
from hopsched.broker.objects import teardown
from hopsched.core.clock import now_us, us_to_datetime
from hopsched.core.envelope import HEADER_DUE, HEADER_KEY
from hopsched.topology import Topology
from hopsched.urls import mask_url

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


def expected_occurrences(starts_us: list[int], every_us: int, until_us: int) -> set[str]:
    """Every occurrence key (``ID@DUE``) the schedules' rules give: ``start + k * every``
    for k = 0, 1, ... while not after ``until`` (the rule's bounds, included)."""
    return {
        f"rec-{n}@{due}"
        for n, start in enumerate(starts_us)
        for due in range(start, until_us + 1, every_us)
    }


def depth_verdict(samples: list[dict[str, Any]], live_until_s: float) -> dict[str, Any]:
    """Ready messages in the steps and the relay queue, mean of the first third of the
    samples taken while every chain runs (``t_s`` up to ``live_until_s``: not in the
    chains' last interval, when they end) against the last third: grew if the last is
    above 1.25 x the first + 10."""
    live = [row for row in samples if row["t_s"] <= live_until_s]
    third = len(live) // 3
    if third < 1:
        return {"verdict": "too few samples", "first_third": None, "last_third": None}

    def mean(rows: list[dict[str, Any]]) -> float:
        return round(float(sum(row["steps"] + row["relay"] for row in rows)) / len(rows), 1)

    first, last = mean(live[:third]), mean(live[-third:])
    return {
        "verdict": "grew" if last > 1.25 * first + 10 else "flat",
        "samples": len(live),
        "first_third": first,
        "last_third": last,
    }


def checkout() -> dict[str, Any]:
    """The commit this run measures and whether the checkout has uncommitted changes."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True
            )
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
    }


async def run(
    url: str,
    schedules: int,
    every_s: float,
    minutes: float,
    one_shots: float,
    catch_up: str,
    grace_s: float,
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
    every_us = int(every_s * S)
    starts: list[int] = []
    one_shot_count = 0
    cleaned_up = 0
    try:
        async with hopsched.Scheduler(settings, declare=True) as scheduler:
            began = now_us()
            first = began + 2 * S
            # every chain ends by itself: its last occurrence is the last one on its rule
            # at or before `until`, inside the run (nothing cancelled in flight)
            until = first + int(minutes * 60 * S)
            for n, schedule_id in enumerate(ids):
                start = first + every_us * n // schedules
                if start < now_us() + S // 2:  # scheduling took long: keep the phase
                    start += -(-(now_us() + S // 2 - start) // every_us) * every_us
                starts.append(start)
                await scheduler.schedule(
                    b"occurrence",
                    every=every_s,
                    start=us_to_datetime(start),
                    until=us_to_datetime(until),
                    catch_up=catch_up,
                    routing_key=target.name,
                    schedule_id=schedule_id,
                )
            expected = expected_occurrences(starts, every_us, until)
            scheduled_s = (now_us() - began) / S
            cpu_start = sum(cpu.cpu_times()[:2])
            delivered_start = len(received)
            started, started_us = time.monotonic(), now_us()
            next_sample = started
            rng = random.Random(22)
            while now_us() < until:
                now = time.monotonic()
                if now >= next_sample:
                    row = {"t_s": round(now - started, 1), **await depths(channel, topology)}
                    row["relay_cpu_s"] = round(sum(cpu.cpu_times()[:2]) - cpu_start, 2)
                    row["delivered"] = len(received) - delivered_start
                    samples.append(row)
                    print(row, file=sys.stderr)
                    next_sample += SAMPLE_S
                # one-shots only while every one of them is due before the last occurrence
                if one_shots > 0 and now_us() + every_us < until:
                    await scheduler.schedule(
                        b"one-shot", delay=rng.uniform(1.0, every_s), routing_key=target.name
                    )
                    one_shot_count += 1
                    await asyncio.sleep(1 / one_shots)
                else:
                    await asyncio.sleep(0.1)
            # the last occurrences (due at `until` at the latest) and a grace period
            deadline = until + int(grace_s * S)
            while now_us() < deadline:
                arrived = {k for k, _, _ in received if k is not None}
                shots = sum(1 for k, _, _ in received if k is None)
                if expected <= arrived and shots >= one_shot_count:
                    break
                await asyncio.sleep(0.5)
            waited_s = round((now_us() - until) / S, 1)
            cpu_used = sum(cpu.cpu_times()[:2]) - cpu_start
            delivered_during = len(received) - delivered_start
            # clean-up only: chains whose last occurrence did not arrive in the wait
            arrived = {k for k, _, _ in received if k is not None}
            last_keys = {
                f"rec-{n}@{start + (until - start) // every_us * every_us}"
                for n, start in enumerate(starts)
            }
            pending = [key.split("@")[0] for key in last_keys - arrived]
            if pending:
                await scheduler.cancel_many(pending)
                cleaned_up = len(pending)
        await asyncio.sleep(1)  # anything straggling is counted, not cancelled
    finally:
        relay.terminate()
        await relay.wait()
        await teardown(topology, connection, force=True)
        await target.delete(if_unused=False, if_empty=False)
        await connection.close()

    recurring = [(k, d, r) for k, d, r in received if k is not None]
    one_shot = [(d, r) for k, d, r in received if k is None]
    keys: dict[str, int] = {}
    for key, _, _ in recurring:
        keys[key] = keys.get(key, 0) + 1
    return {
        "setup": {
            "broker": mask_url(url),
            "hopsched": version("hopsched"),
            **checkout(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "schedules": schedules,
            "every_s": every_s,
            "minutes": minutes,
            "catch_up": catch_up,
            "grace_s": grace_s,
            "one_shots_per_s": one_shots,
            "scheduling_the_schedules_s": round(scheduled_s, 1),
            "starts_moved_by_whole_intervals": sum(
                1 for n, start in enumerate(starts) if start != first + every_us * n // schedules
            ),
        },
        "recurring_lateness": percentiles([r - d for _, d, r in recurring]),
        "one_shot_lateness": percentiles([r - d for d, r in one_shot]),
        "occurrences": {
            "expected": len(expected),
            "delivered_once": sum(1 for key in expected if keys.get(key) == 1),
            "duplicated": sum(1 for key in expected if keys.get(key, 0) > 1),
            "duplicate_copies": sum(count - 1 for count in keys.values() if count > 1),
            "missing": len(expected - set(keys)),
            "unexpected": len(set(keys) - expected),
            "early": sum(1 for _, d, r in recurring if r < d),
        },
        "one_shots": {
            "scheduled": one_shot_count,
            "received": len(one_shot),
            "early": sum(1 for d, r in one_shot if r < d),
        },
        "waited_after_the_last_due_s": waited_s,
        "schedules_cancelled_at_cleanup": cleaned_up,
        "relay_cpu_us_per_delivered_message": round(cpu_used * S / max(1, delivered_during), 1),
        "depths": depth_verdict(samples, (until - every_us - started_us) / S),
        "depth_samples": samples,
        "relay_log_tail": relay_log[-3:],
    }


@click.command()
@click.option("--url", envvar="HOPSCHED_URL", required=True, help="The broker (a test one).")
@click.option("--schedules", default=10_000, show_default=True)
@click.option("--every", "every_s", default=10.0, show_default=True, help="Interval, s.")
@click.option("--minutes", default=10.0, show_default=True)
@click.option("--one-shots", default=100.0, show_default=True, help="One-shot messages per s.")
@click.option(
    "--catch-up",
    type=click.Choice(["latest", "all", "none"]),
    default="latest",
    show_default=True,
    help="The schedules' catch_up (latest, none: an occurrence reached after the next is "
    "due is not delivered, and counts as missing).",
)
@click.option(
    "--grace",
    "grace_s",
    default=30.0,
    show_default=True,
    help="How long to wait past the last due time for what is still to arrive, s.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def main(
    url: str,
    schedules: int,
    every_s: float,
    minutes: float,
    one_shots: float,
    catch_up: str,
    grace_s: float,
    json_path: Path | None,
) -> None:
    """Recurring schedules beside one-shots: lateness, relay CPU, queue depths."""
    result = asyncio.run(run(url, schedules, every_s, minutes, one_shots, catch_up, grace_s))
    text = json.dumps(result, indent=2)
    print(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    o, d = result["occurrences"], result["depths"]
    print(
        f"occurrences: expected {o['expected']}, delivered once {o['delivered_once']}, "
        f"duplicated {o['duplicated']}, missing {o['missing']}, unexpected "
        f"{o['unexpected']}, early {o['early']}; schedules cancelled at clean-up "
        f"{result['schedules_cancelled_at_cleanup']}\n"
        f"lateness recurring {result['recurring_lateness']}, one-shot "
        f"{result['one_shot_lateness']}; relay "
        f"{result['relay_cpu_us_per_delivered_message']} µs CPU per delivered message\n"
        f"depths (ready in steps + relay queue, mean of {d.get('samples')} samples): first third "
        f"{d['first_third']}, "
        f"last third {d['last_third']}: {d['verdict']}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
