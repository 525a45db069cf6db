"""Running one workload through one strategy: pace the schedule, receive at the target,
wait, and summarize."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from bench_consumer import READY, parse_line
from bench_measure import (
    MAX_IN_FLIGHT,
    BrokerCpu,
    CallCpu,
    Collector,
    Delivery,
    Pipeline,
    ProcessSampler,
    hops_by_decade,
    now_us,
    queue_depths,
    stop_process,
    summarize,
)
from bench_strategies import BrokerFloor, Hopsched, Strategy
from bench_workload import LONG_DELAY_US, Workload

from hopsched.relay.stats import LatenessStats

__all__ = [
    "Progress",
    "Run",
    "Session",
    "ingest_lag",
    "measure_strategy",
    "publish_throughput",
    "run_burst",
    "run_workload",
]

_MB = 1024 * 1024
_CONSUMER_SCRIPT = Path(__file__).resolve().parent / "bench_consumer.py"
_CONSUMER_READY_TIMEOUT_S = 30.0
_CONSUMER_STOP_TIMEOUT_S = 10.0  # after SIGTERM, then SIGKILL


class Progress:
    """One line on stderr every ``interval_s`` while a run goes, so a long one never looks hung."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = 0.0

    def say(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


class LoopLag:
    """How late the load generator's event loop wakes up (a 10 ms timer's overshoot): how
    busy pacing and publishing kept it. Lateness is timestamped elsewhere, in the consumer
    process (``bench_consumer.py``), so this no longer adds to it directly."""

    def __init__(self, tick_s: float = 0.01) -> None:
        self._tick_s = tick_s
        self.stats = LatenessStats()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self._tick_s)
            self.stats.record(int((loop.time() - before - self._tick_s) * 1_000_000))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict[str, float]:
        return {
            "bench_loop_lag_p99_ms": round(self.stats.percentile_ms(99), 2),
            "bench_loop_lag_max_ms": round(self.stats.max_ms, 2),
        }


class Session:
    """A strategy opened on the broker, a consumer process (``bench_consumer.py``) on its
    target queue whose lines feed ``self.collector``, and a sampler of the strategy's
    process; ``async with`` stops the consumer and deletes everything it declared on the
    way out (also on an error, Ctrl-C or SIGTERM)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.collector = Collector(set())  # run_workload puts each run's own here
        self.sampler: ProcessSampler | None = None
        self._consumer: asyncio.subprocess.Process | None = None
        self._consumer_log: IO[bytes] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self.cleanup_problems: list[str] = []

    async def __aenter__(self) -> Session:
        try:
            await self.strategy.open()
            await self._start_consumer()
            if self.strategy.process is not None:
                self.sampler = ProcessSampler(self.strategy.process.pid)
                self.sampler.start()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _start_consumer(self) -> None:
        self._consumer_log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in _stop_consumer
        self._consumer = await asyncio.create_subprocess_exec(
            sys.executable, str(_CONSUMER_SCRIPT),
            self.strategy.node_url, self.strategy.target_queue,
            stdout=asyncio.subprocess.PIPE, stderr=self._consumer_log,
        )  # fmt: skip
        assert self._consumer.stdout is not None
        line = b""
        with contextlib.suppress(TimeoutError):
            line = await asyncio.wait_for(
                self._consumer.stdout.readline(), _CONSUMER_READY_TIMEOUT_S
            )
        if line != READY:
            raise RuntimeError(
                f"bench_consumer.py did not start consuming {self.strategy.target_queue} "
                f"(said {line!r}):\n{self._consumer_stderr()}"
            )
        self._reader = asyncio.create_task(self._read(self._consumer.stdout))

    async def _read(self, stdout: asyncio.StreamReader) -> None:
        """Every line of the consumer into the current collector (run_workload swaps it)."""
        async for line in stdout:
            try:
                fields = parse_line(line.decode(errors="replace"))
            except ValueError:  # not a line bench_consumer.py writes: count it, keep reading
                fields = None
            if fields is None:
                self.collector.strays += 1
            else:
                self.collector.add(*fields)

    def _consumer_stderr(self, tail: int = 4000) -> str:
        if self._consumer_log is None:
            return ""
        self._consumer_log.seek(0)
        return self._consumer_log.read().decode(errors="replace")[-tail:]

    def check_consumer(self) -> None:
        """Raise if the consumer process has ended while the session runs: nothing would
        be measured any more."""
        process = self._consumer
        if not self._stopping and process is not None and process.returncode is not None:
            raise RuntimeError(
                f"bench_consumer.py exited with status {process.returncode}:\n"
                f"{self._consumer_stderr()}"
            )

    async def _stop_consumer(self) -> None:
        """SIGTERM the consumer, SIGKILL it after a timeout; read its last lines."""
        self._stopping = True
        process = self._consumer
        if process is not None:
            await stop_process(process, _CONSUMER_STOP_TIMEOUT_S)
        if self._reader is not None:  # the pipe has ended: the reader finishes at once
            done, _ = await asyncio.wait({self._reader}, timeout=5)
            if not done:
                self._reader.cancel()
                self.cleanup_problems.append("consumer reader: still reading 5 s after exit")
            elif not self._reader.cancelled() and self._reader.exception() is not None:
                self.cleanup_problems.append(f"consumer reader: {self._reader.exception()!r}")
        if self._consumer_log is not None:
            self._consumer_log.close()
            self._consumer_log = None

    async def _close(self) -> None:
        if self.sampler is not None:
            await self.sampler.stop()
        try:
            await self._stop_consumer()
        finally:
            problems = await asyncio.shield(self.strategy.close())
            self.cleanup_problems = [*self.cleanup_problems, *problems]

    def process_cpu_s(self) -> float:
        """The strategy's process's CPU seconds so far, sampled now (0 without one)."""
        if self.sampler is None:
            return 0.0
        self.sampler.sample()
        return self.sampler.cpu_s

    def process_stats(self, cpu_before: float) -> dict[str, Any]:
        """The process's CPU seconds since ``cpu_before`` (``process_cpu_s``), and RSS."""
        if self.sampler is None:
            return {"process_cpu_s": None, "process_peak_rss_mb": None, "process_rss_mb": None}
        return {
            "process_cpu_s": round(self.process_cpu_s() - cpu_before, 2),
            "process_peak_rss_mb": round(self.sampler.peak_rss / _MB, 1),
            "process_rss_mb": round(self.sampler.rss / _MB, 1),
        }


@dataclass
class Run:
    """One workload's outcome: the summary row and, for the plots, every delivery with its
    requested delay."""

    summary: dict[str, Any]
    points: list[tuple[int, Delivery]] = field(default_factory=list)


async def _await_deliveries(
    session: Session, collector: Collector, deadline: float, report: Callable[[], None]
) -> None:
    """Until every awaited message is in or the loop's clock passes ``deadline``."""
    loop = asyncio.get_running_loop()
    while not collector.done.is_set() and loop.time() < deadline:
        session.check_consumer()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(collector.done.wait(), 1.0)
        report()
    await asyncio.sleep(0.2)  # a duplicate right behind the last delivery is still counted
    session.check_consumer()


async def _outcome(
    session: Session,
    collector: Collector,
    *,
    scheduled: int,
    failures: list[str],
    pending: int,
    cpu_before: float,
    schedule_cpu: CallCpu,
    broker_cpu: BrokerCpu | None,
) -> dict[str, Any]:
    """The summary fields every workload has: counts, lateness, publishes per message,
    the strategy's process; for hopsched, CPU per relayed message and per schedule; CPU
    per delivered message of the producer, the broker (on a private node) and in all."""
    strategy = session.strategy
    delivered = list(collector.deliveries.values())
    in_broker = None
    if len(delivered) < scheduled:  # where are the others? still queued is not lost
        depths = await queue_depths(strategy.prefix + ".")
        if depths is not None:
            in_broker = sum(n for q, n in depths.items() if q != strategy.target_queue)
    # Short-delay messages still in the strategy's queues after the wait: late beyond
    # it (e.g. head-of-line blocked behind a 24 h message), not lost.
    overdue = max(0, min((in_broker or 0) - pending, scheduled - len(delivered) - pending))
    summary: dict[str, Any] = {
        "scheduled": scheduled,
        "delivered": len(delivered),
        "lost": scheduled - len(delivered) - pending - overdue,
        "pending": pending,
        "overdue": overdue,
        "pending_in_broker_queues": in_broker,
        "duplicates": collector.duplicates,
        "strays": collector.strays,
        "schedule_failures": len(failures),
        **summarize(delivered),
    }
    publishes = [strategy.client_publishes(d.hops) for d in delivered]
    dead_letters = [d.hops for d in delivered]
    n = max(1, len(delivered))
    summary["client_publishes_per_msg"] = round(sum(publishes) / n, 3)
    summary["dead_letters_per_msg"] = round(sum(dead_letters) / n, 3)
    summary["broker_publishes_per_msg"] = round((sum(publishes) + sum(dead_letters)) / n, 3)
    summary.update(session.process_stats(cpu_before))
    if isinstance(strategy, Hopsched):
        # The relay publishes every hop after the scheduler's first one, and the delivery
        # (an ingress message: also its first hop, taken from the ingress queue).
        relayed = sum(strategy.relayed(d.hops) for d in delivered)
        cpu_s = summary["process_cpu_s"]
        summary["relayed_msgs"] = relayed
        summary["relay_cpu_us_per_relayed_msg"] = (
            round(cpu_s * 1e6 / relayed, 1) if relayed else None
        )
        summary["relay_cpu_us_per_delivered_msg"] = (
            round(cpu_s * 1e6 / len(delivered), 1) if delivered else None
        )
        summary["scheduler_cpu_s"] = round(schedule_cpu.cpu_s, 3)
        summary["scheduler_cpu_us_per_msg"] = schedule_cpu.us_per_call()
    summary.update(_cpu_per_message(summary, schedule_cpu, broker_cpu, len(delivered)))
    if failures:
        summary["schedule_failure_examples"] = failures[:5]
    return summary


def _cpu_per_message(
    summary: dict[str, Any], producer: CallCpu, broker: BrokerCpu | None, delivered: int
) -> dict[str, Any]:
    """CPU µs per delivered message: the producer's calls (an upper bound: ``CallCpu``),
    the strategy's process (hopsched's relay; none for the plugin and the floor), the
    broker's (less idle) and their total. The broker's and the total only where the
    broker's CPU can be told (a private node)."""
    if not delivered:
        return {}
    fields: dict[str, Any] = {
        "producer_cpu_us_per_msg": round(producer.cpu_s * 1e6 / delivered, 1),
        "process_cpu_us_per_delivered_msg": (
            None
            if summary.get("process_cpu_s") is None
            else round(summary["process_cpu_s"] * 1e6 / delivered, 1)
        ),
    }
    if broker is not None:
        fields.update(broker.fields(delivered))
        fields["total_cpu_us_per_msg"] = round(
            fields["producer_cpu_us_per_msg"]
            + (fields["process_cpu_us_per_delivered_msg"] or 0.0)
            + (fields["broker_cpu_us_per_msg"] or 0.0),
            1,
        )
    return fields


async def run_workload(
    session: Session, workload: Workload, *, tag: str, progress: Progress
) -> Run:
    """Schedule ``workload`` through ``session``'s strategy at its rate, one call per
    message at its own instant, wait for every delivery (up to max due + 10 s + 1 % of
    the longest short delay) and summarize.

    Delays of 24 h (F01's long ones) are not waited for: they are reported as pending,
    with the number of messages still in the strategy's queues as evidence.
    """
    strategy = session.strategy
    delays = workload.delays_us()
    ids = [f"{tag}-{index}" for index in range(len(delays))]
    long_ids = {i for i, d in zip(ids, delays, strict=True) if d >= LONG_DELAY_US}
    short_delays = [d for d in delays if d < LONG_DELAY_US]
    collector = Collector(set(ids), awaited=len(short_delays))
    session.collector = collector
    body = b"x" * workload.payload_bytes
    broker_cpu = await BrokerCpu.start()
    cpu_before = session.process_cpu_s()
    loop = asyncio.get_running_loop()
    pipeline = Pipeline(MAX_IN_FLIGHT)
    schedule_cpu = CallCpu()
    failures: list[str] = []
    scheduled = 0

    async def one(schedule_id: str, delay_us: int) -> None:
        nonlocal scheduled
        schedule_cpu.begin()
        try:
            await strategy.schedule(schedule_id, delay_us, body)
            scheduled += 1
        except Exception as error:
            failures.append(f"{schedule_id}: {error!r}")
        finally:
            schedule_cpu.end()

    max_short_s = max(short_delays, default=0) / 1e6
    grace_s = 10.0 + 0.01 * max_short_s
    started = loop.time()
    expected_end = started + len(delays) / workload.rate + max_short_s

    def report(force: bool = False) -> None:
        now = loop.time()
        progress.say(
            f"[{strategy.name}] scheduled {scheduled}/{len(delays)} delivered "
            f"{len(collector.deliveries)}/{len(short_delays)} elapsed {now - started:.0f}s "
            f"eta ~{max(0.0, expected_end - now):.0f}s",
            force=force,
        )

    lag = LoopLag()
    lag.start()
    for index, (schedule_id, delay_us) in enumerate(zip(ids, delays, strict=True)):
        wait = started + index / workload.rate - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        await pipeline.submit(one(schedule_id, delay_us))
        report()
    await pipeline.drain()
    schedule_s = loop.time() - started
    scheduled_by_us = now_us()
    await _await_deliveries(session, collector, loop.time() + max_short_s + grace_s, report)
    lag.stop()
    report(force=True)
    summary = await _outcome(
        session,
        collector,
        scheduled=scheduled,
        failures=failures,
        pending=sum(1 for i in long_ids if i not in collector.deliveries),
        cpu_before=cpu_before,
        schedule_cpu=schedule_cpu,
        broker_cpu=broker_cpu,
    )
    # Messages due once publishing has ended: what a steady stream would see, without
    # the publishing burst competing for the same two cores.
    delivered = list(collector.deliveries.values())
    quiet = summarize([d for d in delivered if d.due_us > scheduled_by_us])
    summary["after_schedule_n"] = sum(1 for d in delivered if d.due_us > scheduled_by_us)
    for key in ("p50_ms", "p99_ms", "max_ms"):
        summary[f"after_schedule_{key}"] = quiet[key]
    summary["sustained_schedule_rate_per_s"] = round(len(delays) / schedule_s, 1)
    summary["wall_s"] = round(loop.time() - started, 1)
    summary.update(lag.summary())
    by_id = dict(zip(ids, delays, strict=True))
    points = [(by_id[i], d) for i, d in collector.deliveries.items()]
    if isinstance(strategy, Hopsched):  # the others' hops count x-death, not a ladder
        summary["hold_window_ms"] = strategy.settings.hold_window_ms
        # a hopsched measured through --hopsched-path may predate Ladder.description
        summary["ladder"] = getattr(strategy.settings.ladder, "description", None)
        summary["hops_by_decade"] = hops_by_decade(points, strategy.settings.hold_window_ms)
    summary.update(ingest_lag(points))
    return Run(summary, points)


def ingest_lag(points: list[tuple[int, Delivery]]) -> dict[str, Any]:
    """For deliveries whose relay stamped its own due time beside the producer's (the
    ingress row, ``Delivery.stamped_due_us``): the **ingest lag**, how long after its
    publish the relay took the message (stamped due - producer's due - the rounding of the
    delay up to whole ms in ``x-delay``), and the lateness measured from the relay's own
    due time; percentiles in ms. Empty for the other rows."""
    lag, relay_lateness = LatenessStats(), LatenessStats()
    for delay_us, delivery in points:
        if delivery.stamped_due_us is None:
            continue
        rounding_us = -(-delay_us // 1000) * 1000 - delay_us
        lag.record(delivery.stamped_due_us - delivery.due_us - rounding_us)
        relay_lateness.record(delivery.received_us - delivery.stamped_due_us)
    if not lag.count:
        return {}
    fields: dict[str, Any] = {}
    for name, stats in (("ingest_lag", lag), ("lateness_from_relay_due", relay_lateness)):
        for pct, key in ((50, "p50"), (90, "p90"), (99, "p99")):
            fields[f"{name}_{key}_ms"] = round(stats.percentile_ms(pct), 2)
        fields[f"{name}_max_ms"] = round(stats.max_ms, 2)
    return fields


async def run_burst(
    session: Session,
    count: int,
    lead_s: float,
    *,
    tag: str,
    progress: Progress,
    payload_bytes: int = 64,
    grace_s: float = 30.0,
) -> Run:
    """Schedule ``count`` messages all due at one instant, ``lead_s`` after scheduling
    starts, as fast as the strategy goes (``Strategy.schedule_burst``); wait for them
    (until that instant + ``grace_s``) and summarize, with the first delivery's lateness
    (``min_ms``), the last one's (``max_ms``) and the time between them."""
    strategy = session.strategy
    ids = [f"{tag}-{index}" for index in range(count)]
    collector = Collector(set(ids), awaited=count)
    session.collector = collector
    broker_cpu = await BrokerCpu.start()
    cpu_before = session.process_cpu_s()
    loop = asyncio.get_running_loop()
    started = loop.time()
    lead_us = round(lead_s * 1e6)
    due_us = now_us() + lead_us
    schedule_cpu = CallCpu()

    def report(force: bool = False) -> None:
        progress.say(
            f"[{strategy.name}] {count} due at once: delivered {len(collector.deliveries)}"
            f"/{count} elapsed {loop.time() - started:.0f}s (due at {lead_s:g}s)",
            force=force,
        )

    schedule_cpu.begin()
    how, failures = await strategy.schedule_burst(ids, due_us, b"x" * payload_bytes)
    schedule_cpu.end(count)
    schedule_s = loop.time() - started
    ahead_s = (due_us - now_us()) / 1e6
    floor = isinstance(strategy, BrokerFloor)  # it publishes at the due instant, not ahead
    if ahead_s < 0 and not floor:
        progress.say(
            f"[{strategy.name}] scheduling outlasted the lead by {-ahead_s:.1f}s", force=True
        )
    report(force=True)
    await _await_deliveries(session, collector, started + lead_s + grace_s, report)
    report(force=True)
    summary = await _outcome(
        session,
        collector,
        scheduled=count - len(failures),
        failures=failures,
        pending=0,
        cpu_before=cpu_before,
        schedule_cpu=schedule_cpu,
        broker_cpu=broker_cpu,
    )
    received = [d.received_us for d in collector.deliveries.values()]
    spread_s = (max(received) - min(received)) / 1e6 if received else 0.0
    summary.update(
        {
            "count": count,
            "scheduled_with": how,
            "lead_s": lead_s,
            "schedule_s": None if floor else round(schedule_s, 2),
            # below 0: scheduling outlasted the lead, and the last ones were due already
            "scheduled_ahead_of_due_s": None if floor else round(ahead_s, 2),
            "sustained_schedule_rate_per_s": None if floor else round(count / schedule_s, 1),
            "first_to_last_delivery_s": round(spread_s, 3),
            "delivered_per_s": round(len(received) / spread_s, 1) if spread_s else None,
            "wall_s": round(loop.time() - started, 1),
        }
    )
    return Run(summary, [(lead_us, d) for d in collector.deliveries.values()])


async def measure_strategy(
    strategy: Strategy,
    label: str,
    measure: Callable[[Session], Awaitable[Run]],
    progress: Progress,
    *,
    burst: bool = False,
) -> tuple[dict[str, Any], Run | None]:
    """``measure`` in a session of ``strategy``: its summary, annotated (available, what
    its publishes count, cleanup problems, its process's warnings), and the run; for a
    strategy this broker (or this hopsched) cannot run, why, and no run."""
    reason = await strategy.unavailable(burst=burst)
    if reason is not None:
        progress.say(f"[{label}] {reason}", force=True)
        return {"available": False, "reason": reason}, None
    progress.say(f"[{label}] starting on prefix {strategy.prefix}", force=True)
    async with Session(strategy) as session:
        run = await measure(session)
    run.summary["available"] = True
    run.summary["counting"] = strategy.counting
    if session.cleanup_problems:
        run.summary["cleanup_problems"] = session.cleanup_problems
    if strategy.log_warnings:
        run.summary["process_log_warnings"] = strategy.log_warnings[:20]
    return run.summary, run


#: The publish-throughput phase: how long a message waits (nothing comes due during it).
THROUGHPUT_DELAY_US = 3600 * 1_000_000
#: How long the phase waits for the strategy's process to take what was confirmed.
_INGEST_TIMEOUT_S = 300.0


async def publish_throughput(
    session: Session,
    count: int,
    producers: int,
    in_flight: int,
    *,
    tag: str,
    progress: Progress,
    payload_bytes: int = 64,
) -> dict[str, Any] | None:
    """Confirmed publish throughput into ``session``'s strategy: ``producers`` producers,
    each on its own connection (``Strategy.open_producer``), publish ``count`` messages
    between them (an equal share each), every one due in 1 h, each producer with up to
    ``in_flight`` publishes awaiting their confirm; msgs/s from the first publish to the
    last confirm. A strategy whose process takes the messages after the confirm (the
    ingress: the relay schedules them from ``{prefix}.ingress``) is then waited for until
    all are where they wait (``ingested_per_s``, from the same first publish), and its
    process's CPU over the whole phase is divided by ``count``. None: the strategy has no
    producers for this phase."""
    strategy = session.strategy
    opened = [await strategy.open_producer(index) for index in range(producers)]
    made = [producer for producer in opened if producer is not None]
    if not made:
        return None
    loop = asyncio.get_running_loop()
    failures: list[str] = []
    body = b"x" * payload_bytes
    try:
        ingested_before = await strategy.ingested_count()
        cpu_before = session.process_cpu_s()
        confirmed = 0

        async def one(producer: Any, schedule_id: str) -> None:
            nonlocal confirmed
            try:
                await producer.publish(schedule_id, THROUGHPUT_DELAY_US, body)
                confirmed += 1
            except Exception as error:
                failures.append(f"{schedule_id}: {error!r}")

        async def produce(index: int, producer: Any) -> None:
            pipeline = Pipeline(in_flight)
            for n in range(index, count, len(made)):
                await pipeline.submit(one(producer, f"{tag}-tp-{n}"))
            await pipeline.drain()

        async def report() -> None:
            while True:
                await asyncio.sleep(5)
                progress.say(f"[{strategy.name}] publish throughput: confirmed {confirmed}/{count}")

        reporter = asyncio.create_task(report())
        started = loop.time()
        try:
            await asyncio.gather(*(produce(i, p) for i, p in enumerate(made)))
        finally:
            reporter.cancel()
        confirmed_s = loop.time() - started
        result: dict[str, Any] = {
            "producers": len(made),
            "in_flight_per_producer": in_flight,
            "messages": count,
            "confirmed": confirmed,
            "failures": len(failures),
            "delay_s": THROUGHPUT_DELAY_US / 1e6,
            "confirmed_s": round(confirmed_s, 2),
            "confirmed_per_s": round(confirmed / confirmed_s, 1),
            "ingested_per_s": None,
            "process_cpu_us_per_msg": None,
        }
        if ingested_before is not None:
            deadline = started + _INGEST_TIMEOUT_S
            ingested = 0
            while loop.time() < deadline:
                ingested = (await strategy.ingested_count() or 0) - ingested_before
                if ingested >= confirmed:
                    break
                progress.say(
                    f"[{strategy.name}] publish throughput: ingested {ingested}/{confirmed}"
                )
                await asyncio.sleep(0.1)
            ingested_s = loop.time() - started
            result["ingested"] = ingested
            result["ingested_s"] = round(ingested_s, 2)
            result["ingested_per_s"] = round(ingested / ingested_s, 1)
        if session.sampler is not None:
            cpu_s = session.process_cpu_s() - cpu_before
            result["process_cpu_s"] = round(cpu_s, 2)
            result["process_cpu_us_per_msg"] = round(cpu_s * 1e6 / max(1, confirmed), 1)
        if failures:
            result["failure_examples"] = failures[:5]
        progress.say(
            f"[{strategy.name}] publish throughput: {result['confirmed_per_s']:,} msgs/s "
            f"confirmed ({len(made)} producers)",
            force=True,
        )
        return result
    finally:
        for producer in made:
            with contextlib.suppress(Exception):
                await producer.close()
