"""The throughput, burst and backlog scenarios."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import aio_pika
from bench_measure import (
    MAX_IN_FLIGHT,
    Pipeline,
    ProcessSampler,
    broker_memory,
    now_us,
    queue_depths,
    stop_process,
)
from bench_run import Progress, Run, Session, measure_strategy, run_burst, run_workload
from bench_strategies import BURST_BATCH, Hopsched, make_strategy, relay_command
from bench_workload import Workload, parse_delays

import hopsched
import hopsched.core.envelope
import hopsched.core.ladder
from hopsched.broker.objects import declare
from hopsched.core.envelope import HEADER_HOP_EXPIRES

try:
    from hopsched.core.envelope import HEADER_HOP_CLOCK, RELAY_CLOCK
except ImportError:  # a hopsched measured through --hopsched-path from before clock stamps
    HEADER_HOP_CLOCK, RELAY_CLOCK = "x-hopsched-hop-clock", "relay"

__all__ = ["relay_hops", "run_backlog", "run_bursts", "run_throughput"]

_MB = 1024 * 1024
THROUGHPUT_MESSAGES = 20_000
STEP_RATES = (50, 100, 150, 200, 250, 350, 500, 750, 1000, 1500, 2000, 3000, 4000, 5000)
STEPS_UP_TO = 3000  # every step up to this rate runs, met or missed (unless saturated)
STEP_SECONDS = 10  # each rate step schedules for this long
STEP_DELAYS = "loguniform:10ms:5s"
TARGET_P99_MS = 10.0
BURST_COUNTS = (2000, 10_000)
BURST_LEAD_S = 20.0
BURST_STRATEGIES = ("hopsched-quorum", "hopsched-classic", "delayed-exchange", "broker-floor")


async def _fill(
    channel: aio_pika.abc.AbstractChannel,
    routing_key: str,
    count: int,
    message: Any,
    progress: Progress,
    label: str,
) -> float:
    """Publish ``count`` messages ``message(i)`` to the default exchange, confirms
    pipelined; the rate achieved (msgs/s)."""
    pipeline = Pipeline(MAX_IN_FLIGHT)
    started = time.monotonic()

    async def one(index: int) -> None:
        await channel.default_exchange.publish(message(index), routing_key=routing_key)

    for index in range(count):
        await pipeline.submit(one(index))
        progress.say(f"[{label}] filled {index}/{count}")
    await pipeline.drain()
    return count / (time.monotonic() - started)


async def _raw_loop(
    url: str, prefix: str, prefetch: int, count: int, progress: Progress
) -> dict[str, Any]:
    """A plain aio-pika consume -> publish-with-confirm -> ack loop between two quorum
    queues, ``prefetch`` deliveries at once (as the relay), persistent messages."""
    source, target = f"{prefix}.raw-source", f"{prefix}.raw-target"
    connection = await aio_pika.connect(url, name="bench-raw-loop")
    try:
        channel = await connection.channel(publisher_confirms=True)
        for name in (source, target):
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        fill_rate = await _fill(
            channel,
            source,
            count,
            lambda i: aio_pika.Message(b"x" * 64, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            progress,
            "raw loop",
        )
        consumer = await connection.channel()
        await consumer.set_qos(prefetch_count=prefetch)
        publisher = await connection.channel(publisher_confirms=True)
        queue = await consumer.get_queue(source, ensure=False)
        done = asyncio.Event()
        handled = 0
        first: list[float] = []

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal handled
            if not first:
                first.append(time.monotonic())
            await publisher.default_exchange.publish(
                aio_pika.Message(message.body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=target,
            )
            await message.ack()
            handled += 1
            if handled == count:
                done.set()

        await queue.consume(on_message)
        while not done.is_set():
            progress.say(f"[raw loop] handled {handled}/{count}")
            await asyncio.sleep(0.2)
        elapsed = time.monotonic() - first[0]
        return {
            "messages": count,
            "fill_rate_per_s": round(fill_rate, 1),
            "msgs_per_s": round(count / elapsed, 1),
            "seconds": round(elapsed, 2),
            "prefetch": prefetch,
        }
    finally:
        async with connection.channel() as channel:
            for name in (source, target):
                await channel.queue_delete(name)
        await connection.close()


async def _passive_counts(
    connection: aio_pika.abc.AbstractConnection, name: str
) -> tuple[int, int]:
    async with connection.channel() as channel:
        queue = await channel.declare_queue(name, passive=True)
        result = queue.declaration_result
        return result.message_count or 0, result.consumer_count or 0


async def relay_hops(
    url: str,
    prefix: str,
    prefetch: int,
    count: int,
    progress: Progress,
    relays: int = 1,
    *,
    relay_args: tuple[str, ...] = (),
    stamped: bool = False,
    signing_key: str | None = None,
    deliver: bool = False,
    relay_url: str | None = None,
) -> dict[str, Any]:
    """Fill ``{prefix}.relay`` with ``count`` envelopes due in 1 h, start ``relays`` relay
    processes on it (competing consumers of the one relay queue; ``relay_args``: more
    relay options), and time them until every envelope sits in the step queue it hops
    to (exactly one hop each). ``stamped``: the envelopes carry a relay's hop stamp, so
    the relay measures each one's overshoot too, as it does for hops it made.
    ``signing_key`` (``KEY-ID:SECRET``): the envelopes are signed with it, and the relay
    holds it and requires signatures (``HOPSCHED_SIGNING_KEYS``,
    ``HOPSCHED_REQUIRE_SIGNATURES``). ``deliver``: the envelopes are due already and
    the relay delivers each to the queue ``{prefix}-target`` instead (the final publish,
    where a relay verifies a signature's MAC). ``relay_url``: the relays' ``--url``
    (a cluster's nodes, comma-separated: each relay starts at a random one), where
    ``url`` is the node this process fills and watches through."""
    keys = () if signing_key is None else (signing_key,)
    settings = hopsched.Settings(url=url, prefix=prefix, prefetch=prefetch, signing_keys=keys)
    relay_env = dict(os.environ)
    if signing_key is not None:
        relay_env |= {"HOPSCHED_SIGNING_KEYS": signing_key, "HOPSCHED_REQUIRE_SIGNATURES": "1"}
    body = b"x" * 64
    topology = hopsched.Topology.from_settings(settings)
    due_us = now_us() + 3600 * 1_000_000
    step = settings.ladder.plan(now_us=now_us(), due_us=due_us)
    assert isinstance(step, hopsched.core.ladder.Hop)
    step_queue = topology.step_queue(step.step_ms)
    target = f"{prefix}-x"
    if deliver:
        due_us = now_us()
        step_queue = target  # where the relay's work ends
    label = f"relay {'deliveries' if deliver else 'hops'} x{relays}"
    connection = await aio_pika.connect(url, name="bench-relay-fill")
    processes: list[asyncio.subprocess.Process] = []
    samplers: list[ProcessSampler] = []
    try:
        await declare(topology, connection)
        channel = await connection.channel(publisher_confirms=True)
        if deliver:
            await channel.declare_queue(target, durable=True)

        def envelope(index: int) -> aio_pika.Message:
            unsigned = hopsched.core.envelope.Envelope(
                schedule_id=uuid.uuid4().hex, due_us=due_us, exchange="", routing_key=target
            )
            headers = settings.signatures.sign_envelope(unsigned, body).to_headers()
            if stamped:  # the TTL of a hop ran out 2 ms ago
                headers[HEADER_HOP_EXPIRES] = now_us() - 2_000
                headers[HEADER_HOP_CLOCK] = RELAY_CLOCK
            return aio_pika.Message(
                body, headers=headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
            )

        await _fill(channel, topology.relay_queue, count, envelope, progress, label)
        for _ in range(relays):
            relay = await asyncio.create_subprocess_exec(
                *relay_command(relay_url or url, prefix, prefetch, "quorum", *relay_args),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                env=relay_env,
            )  # fmt: skip
            processes.append(relay)
            samplers.append(ProcessSampler(relay.pid, interval_s=0.2))
            samplers[-1].start()
        started = None
        all_consuming = None
        cpu_at_start = 0.0
        while True:
            ready, consumers = await _passive_counts(connection, topology.relay_queue)
            if started is None and (consumers or ready < count):
                started = time.monotonic()
                for sampler in samplers:  # the start-up so far, left out of CPU per hop
                    sampler.sample()
                cpu_at_start = sum(sampler.cpu_s for sampler in samplers)
            if all_consuming is None and consumers >= relays:
                all_consuming = time.monotonic()
            hopped, _ = await _passive_counts(connection, step_queue)
            if hopped >= count:
                break
            if any(relay.returncode is not None for relay in processes):
                raise RuntimeError("a relay exited during the throughput run")
            progress.say(f"[{label}] {hopped}/{count} in {step_queue}")
            await asyncio.sleep(0.02)
        assert started is not None
        elapsed = time.monotonic() - started
        for sampler in samplers:
            await sampler.stop()
        cpu_s = sum(sampler.cpu_s for sampler in samplers)
        return {
            "relays": relays,
            "messages": count,
            "hops_per_s": round(count / elapsed, 1),
            "relay_cpu_us_per_hop": round((cpu_s - cpu_at_start) * 1e6 / count, 1),
            "seconds": round(elapsed, 2),
            "all_consuming_after_s": (
                None if all_consuming is None else round(all_consuming - started, 2)
            ),
            "prefetch": prefetch,
            "step_ms": step.step_ms,
            "relay_cpu_s": round(cpu_s, 2),
            "relay_cpu_s_each": [round(sampler.cpu_s, 2) for sampler in samplers],
            "relay_peak_rss_mb": round(max(sampler.peak_rss for sampler in samplers) / _MB, 1),
            "timing": "from the first relay's consumer appearing (or the relay queue first "
            "shrinking) to the step queue holding every message, polled every ~20 ms; "
            "relay_cpu_s is the sum over the relay processes (start-up included), "
            "relay_cpu_us_per_hop counts their CPU from that first poll on, "
            "relay_peak_rss_mb the largest",
        }
    finally:
        for sampler in samplers:
            await sampler.stop()
        await asyncio.gather(*(stop_process(relay, 30.0) for relay in processes))
        async with connection.channel() as channel:
            for name in [*topology.queues(), target]:
                await channel.queue_delete(name)
            await channel.exchange_delete(topology.expired_exchange)
        await connection.close()


async def _schedule_bulk(
    url: str, prefix: str, count: int, progress: Progress, *, many: bool
) -> dict[str, Any]:
    """``count`` messages due in 1 h scheduled from this process as fast as it goes:
    ``Scheduler.schedule_many`` in batches of ``BURST_BATCH`` (``many``), or one
    ``schedule()`` call per message, ``MAX_IN_FLIGHT`` at once. Messages/s and this
    process's CPU per message, from the connected Scheduler's first call to the last
    confirm. No relay runs: the messages wait in a step queue until it is deleted."""
    how = (
        f"schedule_many, batches of {BURST_BATCH:,}"
        if many
        else (f"schedule(), {MAX_IN_FLIGHT} in flight")
    )
    if many and not hasattr(hopsched.Scheduler, "schedule_many"):
        return {"how": how, "available": False, "reason": "not in this hopsched"}
    settings = hopsched.Settings(url=url, prefix=prefix)
    topology = hopsched.Topology.from_settings(settings)
    body, delay, target = b"x" * 64, timedelta(hours=1), f"{prefix}-target"
    try:
        async with hopsched.Scheduler(settings, declare=True) as scheduler:
            cpu_before, started = time.process_time(), time.monotonic()
            if many:
                for start in range(0, count, BURST_BATCH):
                    size = min(BURST_BATCH, count - start)
                    await scheduler.schedule_many(
                        [hopsched.ScheduleRequest(body, target, delay=delay) for _ in range(size)]
                    )
                    progress.say(f"[{how}] {start + size}/{count}")
            else:
                pipeline = Pipeline(MAX_IN_FLIGHT)
                for index in range(count):
                    await pipeline.submit(scheduler.schedule(body, delay=delay, routing_key=target))
                    progress.say(f"[{how}] {index}/{count}")
                await pipeline.drain()
            elapsed, cpu_s = time.monotonic() - started, time.process_time() - cpu_before
    finally:
        connection = await aio_pika.connect(url, name="bench-schedule-cleanup")
        async with connection, connection.channel() as channel:
            for name in topology.queues():
                await channel.queue_delete(name)
            await channel.exchange_delete(topology.expired_exchange)
    return {
        "how": how,
        "available": True,
        "messages": count,
        "msgs_per_s": round(count / elapsed, 1),
        "seconds": round(elapsed, 2),
        "cpu_s": round(cpu_s, 2),
        "cpu_us_per_msg": round(cpu_s * 1e6 / count, 1),
    }


async def run_throughput(url: str, run_id: str, prefetch: int) -> dict[str, Any]:
    """(c) the schedule rate stepped up against hopsched-quorum, every step up to
    ``STEPS_UP_TO``/s (unless two in a row lose messages or fall below 90 % of their
    rate: saturated), then on while they keep p99 lateness <= 10 ms, the highest rate
    that met it reported; then (a) a raw aio-pika consume -> publish-with-confirm -> ack
    loop and (b) the relay's hops/s on the same broker, with one relay process and then
    with two on a fresh prefix (scale-out); then (d) the Scheduler alone, schedule() and
    schedule_many, messages/s and CPU per message."""
    progress = Progress()
    steps: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    best = None
    saturated_in_a_row = 0
    strategy = make_strategy("hopsched-quorum", url, run_id, prefetch)
    async with Session(strategy) as session:
        for rate in STEP_RATES:
            workload = Workload(
                count=rate * STEP_SECONDS,
                rate=float(rate),
                delays=parse_delays(STEP_DELAYS),
                payload_bytes=64,
                seed=rate,
            )
            run = await run_workload(session, workload, tag=f"rate{rate}", progress=progress)
            name = f"hopsched-quorum @ {rate}/s"
            run.summary["available"] = True
            steps[name], runs[name] = run.summary, run
            kept_up = run.summary["sustained_schedule_rate_per_s"] >= 0.9 * rate
            saturated = run.summary["lost"] > 0 or not kept_up
            ok = not saturated and run.summary["p99_ms"] <= TARGET_P99_MS
            progress.say(
                f"[rate {rate}/s] p99 {run.summary['p99_ms']:.1f} ms, lost {run.summary['lost']}, "
                f"scheduled at {run.summary['sustained_schedule_rate_per_s']}/s",
                force=True,
            )
            if ok:
                best = rate
            saturated_in_a_row = saturated_in_a_row + 1 if saturated else 0
            # Saturated twice (once can be a noisy moment), a higher rate measures nothing
            # new; past STEPS_UP_TO, the search goes on only while the target is met.
            if saturated_in_a_row == 2 or (rate >= STEPS_UP_TO and not ok):
                break
    # The bulk phases come last: deleting their 20,000-message quorum queues keeps the
    # broker busy for a while, which would show up as lateness in the rate steps.
    prefix = f"hopsched-bench-throughput-{run_id}"
    raw = await _raw_loop(url, prefix, prefetch, THROUGHPUT_MESSAGES, progress)
    progress.say(f"[raw loop] {raw['msgs_per_s']} msgs/s", force=True)
    relay = await relay_hops(url, f"{prefix}-relay", prefetch, THROUGHPUT_MESSAGES, progress)
    progress.say(f"[relay hops x1] {relay['hops_per_s']} hops/s", force=True)
    # Scale-out: two relays on a fresh prefix, competing for the same relay queue.
    relay_x2 = await relay_hops(
        url, f"{prefix}-relay-x2", prefetch, THROUGHPUT_MESSAGES, progress, relays=2
    )
    progress.say(f"[relay hops x2] {relay_x2['hops_per_s']} hops/s", force=True)
    scheduler = {}
    for key, many in (("schedule", False), ("schedule_many", True)):
        scheduler[key] = await _schedule_bulk(
            url, f"{prefix}-{key}", THROUGHPUT_MESSAGES, progress, many=many
        )
        progress.say(f"[{scheduler[key]['how']}] {scheduler[key].get('msgs_per_s')}/s", force=True)
    return {
        "raw_loop": raw,
        "relay": relay,
        "relay_x2": relay_x2,
        "scheduler": scheduler,
        "relay_to_raw_ratio": round(relay["hops_per_s"] / raw["msgs_per_s"], 3),
        "scale_out_ratio": round(relay_x2["hops_per_s"] / relay["hops_per_s"], 3),
        "cpu_count": os.cpu_count(),
        "rate_steps": list(steps),
        "step_delays": STEP_DELAYS,
        "step_seconds": STEP_SECONDS,
        "steps_up_to": STEPS_UP_TO,
        "max_rate_p99_within_10ms": best,
        "strategies": steps,
        "runs": runs,
    }


async def run_bursts(
    url: str,
    run_id: str,
    prefetch: int,
    names: list[str],
    counts: list[int],
    lead_s: float,
) -> dict[str, Any]:
    """For each count and strategy, on a fresh prefix: ``count`` messages all due at one
    instant ``lead_s`` after scheduling starts (``run_burst``)."""
    progress = Progress()
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    for count in counts:
        for name in names:

            async def measure(session: Session, count: int = count) -> Run:
                return await run_burst(
                    session, count, lead_s, tag=f"burst{count}", progress=progress
                )

            label = f"{name}, {count:,} at once"
            strategy = make_strategy(name, url, f"{run_id}-{count}", prefetch)
            rows[label], run = await measure_strategy(
                strategy, label, measure, progress, burst=True
            )
            if run is not None:
                runs[label] = run
    return {
        "counts": counts,
        "lead_s": lead_s,
        "batch": BURST_BATCH,
        "strategies": rows,
        "runs": runs,
    }


async def _relay_rss_mb(session: Session) -> float | None:
    if session.sampler is None:
        return None
    session.sampler.sample()
    return round(session.sampler.rss / _MB, 1)


async def _snapshot(session: Session, label: str) -> dict[str, Any]:
    depths = await queue_depths(session.strategy.prefix + ".")
    return {
        "at": label,
        "broker_memory_mb": {
            k: round(v / _MB, 1) for k, v in ((await broker_memory()) or {}).items()
        },
        "relay_rss_mb": await _relay_rss_mb(session),
        "messages_in_prefix_queues": sum(depths.values()) if depths is not None else None,
    }


_FILL_SCRIPT = Path(__file__).resolve().parent / "bench_fill.py"
FILL_PROCESSES = 2  # one Python process schedules ~1,500/s here; the broker has headroom


async def _fill_backlog(strategy: Hopsched, count: int, seed: int, progress: Progress) -> int:
    """Schedule ``count`` messages due in 1-24 h through hopsched's Scheduler, from
    ``FILL_PROCESSES`` processes (``bench_fill.py``); the number of failed schedules."""
    shares = [count // FILL_PROCESSES + (i < count % FILL_PROCESSES) for i in range(FILL_PROCESSES)]
    done = [0] * FILL_PROCESSES
    failures = 0
    started = time.monotonic()

    async def fill(index: int, share: int) -> None:
        nonlocal failures
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(_FILL_SCRIPT),
            strategy.url, strategy.prefix, strategy.queue_type, str(share),
            str(seed * 100 + index), strategy.target_queue, f"backlog{index}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None
        async for line in process.stdout:
            words = line.decode().split()
            if words[0] == "done":
                done[index], failed = int(words[1]), int(words[2])
                failures += failed
            else:
                done[index] = int(words[0])
            elapsed = time.monotonic() - started
            rate = sum(done) / elapsed if elapsed else 0.0
            eta = (count - sum(done)) / rate if rate else 0.0
            progress.say(
                f"[backlog] scheduled {sum(done)}/{count} at {rate:.0f}/s, eta ~{eta:.0f}s"
            )
        if await process.wait() != 0:
            raise RuntimeError(f"bench_fill.py exited with status {process.returncode}")

    await asyncio.gather(*(fill(i, share) for i, share in enumerate(shares)))
    return failures


async def run_backlog(
    url: str, run_id: str, prefetch: int, workload: Workload, backlog_count: int
) -> dict[str, Any]:
    """hopsched-quorum on ``workload`` with an empty broker, then again once
    ``backlog_count`` messages with delays of 1-24 h are pending in the same ladder."""
    progress = Progress()
    strategies: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    snapshots = []
    strategy = make_strategy("hopsched-quorum", url, run_id, prefetch)
    assert isinstance(strategy, Hopsched)
    async with Session(strategy) as session:
        snapshots.append(await _snapshot(session, "start"))
        run = await run_workload(session, workload, tag="empty", progress=progress)
        name = "hopsched-quorum, empty broker"
        run.summary["available"] = True
        strategies[name], runs[name] = run.summary, run
        snapshots.append(await _snapshot(session, "after the empty-broker run"))

        started = time.monotonic()
        failures = await _fill_backlog(strategy, backlog_count, workload.seed, progress)
        fill_s = time.monotonic() - started
        await asyncio.sleep(5)  # let the quorum queues settle before measuring
        snapshots.append(await _snapshot(session, f"{backlog_count} pending"))

        run = await run_workload(session, workload, tag="backlog", progress=progress)
        name = f"hopsched-quorum, {backlog_count:,} pending"
        run.summary["available"] = True
        strategies[name], runs[name] = run.summary, run
        snapshots.append(await _snapshot(session, f"after the run with {backlog_count} pending"))
        progress.say("[backlog] deleting the backlog (the queues of this prefix)", force=True)
    depths = await queue_depths("hopsched-bench-")
    leftovers = None if depths is None else sorted(q for q in depths if run_id in q)
    empty, loaded = (strategies[n]["p99_ms"] for n in strategies)
    return {
        "backlog_count": backlog_count,
        "backlog_delays": "uniform 1 h - 24 h",
        "backlog_fill_s": round(fill_s, 1),
        "backlog_fill_rate_per_s": round(backlog_count / fill_s, 1),
        "backlog_schedule_failures": failures,
        "snapshots": snapshots,
        "p99_ratio_backlog_to_empty": round(loaded / empty, 2) if empty else None,
        "leftover_bench_queues_after_cleanup": leftovers,
        "strategies": strategies,
        "runs": runs,
    }
