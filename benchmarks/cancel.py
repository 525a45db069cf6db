"""Cancel benchmark: what cancelling costs and how close to the due time it still works.

One hopsched (quorum ladder, relay as its own process) on the broker at ``--url``:

1. **throughput**: ``cancel()`` one at a time (each awaiting its confirm), ``cancel()``
   with many in flight, and ``cancel_many()`` in batches: records confirmed per second.
2. **lead sweep** (cancel-to-effect): messages due 2 s ahead, each cancelled at its due
   time minus a lead (0 to 50 ms, the call's start); how many were delivered anyway, and
   what ``Cancelled.in_time`` said. The smallest lead with no delivery at it and above
   is the cancel-to-effect time measured here.
3. **pending cancellations**: a lateness workload with none pending, then
   ``cancel_many()`` of ``--pending`` unknown ids (as many cancels of messages that are
   never seen again), the relay restarted (time to read them all before it consumes,
   its RSS), the sweep again and the same workload again: side by side.

    python benchmarks/cancel.py --json benchmarks/results/cancel/cancel.json
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench_* helper modules

from bench_measure import MAX_IN_FLIGHT, Collector, Pipeline, ProcessSampler, now_us
from bench_run import Progress, Session, run_workload
from bench_strategies import HopschedQuorum, at_datetime
from bench_workload import Workload, parse_delays

import hopsched
from hopsched.urls import mask_url

_MB = 2**20
#: Leads (ms before the due time) at which the sweep starts each cancel() call.
LEADS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200)
#: How far ahead the sweep's messages are due: held by the relay (4 s hold window).
SWEEP_AHEAD_S = 2.0
#: Spacing of the sweep's due times, so that each cancel runs alone.
SWEEP_SPACING_S = 0.02
#: Records per ``cancel_many`` call.
BATCH = 1000


async def throughput(scheduler: hopsched.Scheduler, progress: Progress) -> dict[str, Any]:
    """Cancels of unknown ids, confirmed per second, three ways."""
    rows: dict[str, Any] = {}
    latencies = []
    started = time.perf_counter()
    for _ in range(500):
        began = time.perf_counter()
        await scheduler.cancel(uuid.uuid4().hex)
        latencies.append((time.perf_counter() - began) * 1000)
    rows["cancel_sequential"] = {
        "n": 500,
        "per_s": round(500 / (time.perf_counter() - started)),
        "confirm_p50_ms": round(statistics.median(latencies), 2),
        "confirm_p99_ms": round(statistics.quantiles(latencies, n=100)[98], 2),
    }
    progress.say(f"cancel() one at a time: {rows['cancel_sequential']}", force=True)

    count = 20_000
    pipeline = Pipeline(MAX_IN_FLIGHT)

    async def one() -> None:
        await scheduler.cancel(uuid.uuid4().hex)

    started = time.perf_counter()
    for _ in range(count):
        await pipeline.submit(one())
    await pipeline.drain()
    rows["cancel_concurrent"] = {
        "n": count,
        "in_flight": MAX_IN_FLIGHT,
        "per_s": round(count / (time.perf_counter() - started)),
    }
    progress.say(f"cancel() {MAX_IN_FLIGHT} in flight: {rows['cancel_concurrent']}", force=True)

    count = 100_000
    started = time.perf_counter()
    for _ in range(count // BATCH):
        await scheduler.cancel_many([uuid.uuid4().hex for _ in range(BATCH)])
    rows["cancel_many"] = {
        "n": count,
        "batch": BATCH,
        "per_s": round(count / (time.perf_counter() - started)),
    }
    progress.say(f"cancel_many(): {rows['cancel_many']}", force=True)
    return rows


async def sweep(
    session: Session, trials: int, tag: str, progress: Progress
) -> list[dict[str, Any]]:
    """Per lead: ``trials`` messages cancelled that long before their due time."""
    strategy = session.strategy
    assert isinstance(strategy, HopschedQuorum)
    scheduler = strategy.scheduler
    assert scheduler is not None
    plan = [(lead, trial) for lead in LEADS_MS for trial in range(trials)]
    ids = [f"{tag}-{lead}ms-{trial}" for lead, trial in plan]
    first_due = now_us() + int((SWEEP_AHEAD_S + 1.0) * 1e6)
    dues = [first_due + int(index * SWEEP_SPACING_S * 1e6) for index in range(len(plan))]
    collector = Collector(set(ids))
    session.collector = collector
    results_or_errors = await scheduler.schedule_many(
        [
            hopsched.ScheduleRequest(
                b"sweep", strategy.target_queue, at=at_datetime(due), schedule_id=schedule_id
            )
            for schedule_id, due in zip(ids, dues, strict=True)
        ]
    )
    scheduled = [r for r in results_or_errors if isinstance(r, hopsched.Scheduled)]
    assert len(scheduled) == len(plan)  # without return_exceptions, a failure raises
    results: dict[int, list[tuple[bool | None, float]]] = {lead: [] for lead in LEADS_MS}

    async def cancel(index: int) -> None:
        lead = plan[index][0]
        wait_s = (scheduled[index].due_us - lead * 1000 - now_us()) / 1e6
        await asyncio.sleep(max(0.0, wait_s))
        began = time.perf_counter()
        outcome = await scheduler.cancel(scheduled[index])
        results[lead].append((outcome.in_time, (time.perf_counter() - began) * 1000))

    await asyncio.gather(*(cancel(index) for index in range(len(plan))))
    await asyncio.sleep(2.0)  # a delivery racing the last cancel is still counted
    rows = []
    for lead in LEADS_MS:
        delivered = sum(
            1
            for (planned, _), schedule_id in zip(plan, ids, strict=True)
            if planned == lead and schedule_id in collector.deliveries
        )
        confirms = [ms for _, ms in results[lead]]
        rows.append(
            {
                "lead_ms": lead,
                "trials": trials,
                "delivered": delivered,
                "in_time_true": sum(1 for in_time, _ in results[lead] if in_time),
                "confirm_p50_ms": round(statistics.median(confirms), 2),
                "confirm_max_ms": round(max(confirms), 2),
            }
        )
        progress.say(f"lead {lead} ms: {rows[-1]}", force=True)
    return rows


def cancel_to_effect_ms(rows: list[dict[str, Any]]) -> int | None:
    """The smallest lead at which, and above which, no cancelled message was delivered."""
    effective = None
    for row in sorted(rows, key=lambda r: r["lead_ms"], reverse=True):
        if row["delivered"]:
            break
        effective = row["lead_ms"]
    return effective


async def pend(scheduler: hopsched.Scheduler, count: int, progress: Progress) -> dict[str, Any]:
    """``count`` cancels of unknown ids, in batches; how fast they were confirmed."""
    started = time.perf_counter()
    for start in range(0, count, BATCH):
        await scheduler.cancel_many([uuid.uuid4().hex for _ in range(min(BATCH, count - start))])
        if start % 100_000 == 0:
            progress.say(f"pending cancels written: {start:,}/{count:,}")
    seconds = time.perf_counter() - started
    return {"pending": count, "write_s": round(seconds, 1), "per_s": round(count / seconds)}


async def restart_relay(session: Session) -> dict[str, Any]:
    """Stop the relay, start a new one, time until it consumes (it reads every record
    first), and sample its RSS a few seconds later."""
    strategy = session.strategy
    if session.sampler is not None:
        await session.sampler.stop()
    catch_up_s = await strategy.restart_process()
    assert strategy.process is not None
    session.sampler = ProcessSampler(strategy.process.pid)
    session.sampler.start()
    await asyncio.sleep(5.0)
    session.sampler.sample()
    return {
        "catch_up_s": round(catch_up_s, 2),
        "relay_rss_mb": round(session.sampler.rss / _MB, 1),
    }


async def run(url: str, pending: int, trials: int, workload: Workload) -> dict[str, Any]:
    progress = Progress()
    strategy = HopschedQuorum(url, uuid.uuid4().hex[:8], hopsched.Settings().prefetch)
    result: dict[str, Any] = {
        "hopsched": version("hopsched"),
        "python": platform.python_version(),
        "url": mask_url(url),
        "workload": workload.describe(),
    }
    async with Session(strategy) as session:
        scheduler = strategy.scheduler
        assert scheduler is not None
        result["throughput"] = await throughput(scheduler, progress)
        result["pending_0"] = {
            "sweep": await sweep(session, trials, "sweep0", progress),
            "lateness": (
                await run_workload(session, workload, tag="w0", progress=progress)
            ).summary,
        }
        result["pending_0"]["relay_rss_mb"] = (
            round(session.sampler.rss / _MB, 1) if session.sampler else None
        )
        written = await pend(scheduler, pending, progress)
        restarted = await restart_relay(session)
        result[f"pending_{pending}"] = {
            **written,
            **restarted,
            "sweep": await sweep(session, trials, "sweep1", progress),
            "lateness": (
                await run_workload(session, workload, tag="w1", progress=progress)
            ).summary,
        }
    for key in ("pending_0", f"pending_{pending}"):
        result[key]["cancel_to_effect_ms"] = cancel_to_effect_ms(result[key]["sweep"])
    return result


def table(result: dict[str, Any], pending: int) -> str:
    """The figures side by side, as markdown."""
    none, many = result["pending_0"], result[f"pending_{pending}"]
    lines = [
        f"| | 0 pending | {pending:,} pending |",
        "| --- | --- | --- |",
        "| cancel-to-effect (smallest lead never delivered) "
        f"| {none['cancel_to_effect_ms']} ms | {many['cancel_to_effect_ms']} ms |",
    ]
    for key in ("p50_ms", "p99_ms", "max_ms", "lost", "early"):
        lines.append(f"| lateness {key} | {none['lateness'][key]} | {many['lateness'][key]} |")
    lines.append(f"| relay RSS | {none['relay_rss_mb']} MB | {many['relay_rss_mb']} MB |")
    lines.append(f"| restarted relay reads all records | | {many['catch_up_s']} s |")
    rows = result["throughput"]
    sequential = rows["cancel_sequential"]
    lines += [
        "",
        "| cancel throughput | records/s |",
        "| --- | --- |",
        f"| cancel(), one at a time | {sequential['per_s']:,} "
        f"(confirm p50 {sequential['confirm_p50_ms']} ms) |",
        f"| cancel(), {MAX_IN_FLIGHT} in flight | {rows['cancel_concurrent']['per_s']:,} |",
        f"| cancel_many(), batches of {BATCH:,} | {rows['cancel_many']['per_s']:,} |",
        f"| writing {pending:,} pending | {many['per_s']:,} |",
    ]
    return "\n".join(lines)


@click.command()
@click.option("--url", envvar="HOPSCHED_URL", default="amqp://guest:guest@localhost:5672/")
@click.option("--pending", default=1_000_000, show_default=True, help="cancellations pending")
@click.option("--trials", default=100, show_default=True, help="messages per lead in the sweep")
@click.option("--count", default=2000, show_default=True, help="messages of the lateness workload")
@click.option("--rate", default=200.0, show_default=True, help="their scheduling rate, per s")
@click.option("--delays", default="loguniform:10ms:10s", show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(
    url: str,
    pending: int,
    trials: int,
    count: int,
    rate: float,
    delays: str,
    json_path: Path | None,
) -> None:
    workload = Workload(
        count=count, rate=rate, delays=parse_delays(delays), payload_bytes=64, seed=1
    )
    result = asyncio.run(run(url, pending, trials, workload))
    text = table(result, pending)
    print(text)
    result["table"] = text
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
