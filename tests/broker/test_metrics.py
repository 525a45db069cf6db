"""The relay's Prometheus endpoint: its families from RelayStats, scraped over HTTP from
a real relay process on the real broker, and a port in use."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import HEADER_HOPS, Targets, hopsched_cli

import hopsched
from hopsched.core.decide import ParkKind
from hopsched.relay.metrics import RelayCollector, serve_metrics
from hopsched.relay.stats import BUCKET_BOUNDS_US, RelayStats

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: str) -> Samples:
    """``(sample name, labels) -> value`` of a text exposition."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return _samples(response.read().decode())


# --- families from the stats (no broker) -----------------------------------------------------


def test_the_collector_exports_every_counter_histogram_and_gauge() -> None:
    stats = RelayStats(held_now=lambda: 4, in_flight_now=lambda: 2)
    stats.record_delivery(300, arrived_late_us=0)  # 0.3 ms late
    stats.record_delivery(2_000_000, arrived_late_us=2_000_000)  # overdue
    stats.record_hop()
    stats.record_overshoot(70_000_000)  # above the last bucket
    stats.record_parked(ParkKind.NOT_ALLOWED)
    stats.record_cancelled()
    stats.records += 3
    stats.reconnects += 1
    registry = CollectorRegistry()
    registry.register(RelayCollector(stats))

    samples = _samples(generate_latest(registry).decode())

    for name, value in {
        "delivered": 2,
        "overdue": 1,
        "hops": 1,
        "retries": 0,
        "cancelled": 1,
        "rejected": 0,
        "cancel_records": 3,
        "reconnects": 1,
    }.items():
        assert _value(samples, f"hopsched_{name}_total") == value, name
    for kind in ParkKind:
        expected = 1 if kind is ParkKind.NOT_ALLOWED else 0
        assert _value(samples, "hopsched_parked_total", kind=kind.value) == expected
    assert _value(samples, "hopsched_lateness_seconds_count") == 1
    assert _value(samples, "hopsched_lateness_seconds_sum") == 0.0003
    assert _value(samples, "hopsched_lateness_seconds_bucket", le="0.0001") == 0
    assert _value(samples, "hopsched_lateness_seconds_bucket", le="0.0005") == 1
    assert _value(samples, "hopsched_hop_overshoot_seconds_bucket", le="60.0") == 0
    assert _value(samples, "hopsched_hop_overshoot_seconds_bucket", le="+Inf") == 1
    assert _value(samples, "hopsched_hop_overshoot_seconds_sum") == 70.0
    buckets = [name for name, _ in samples if name == "hopsched_lateness_seconds_bucket"]
    assert len(buckets) == len(BUCKET_BOUNDS_US) + 1
    assert _value(samples, "hopsched_held_messages") == 4
    assert _value(samples, "hopsched_in_flight_publishes") == 2
    assert not [name for name, _ in samples if "target" in name]  # no per-target labels
    build = {"version": hopsched.__version__, "features": "recurring"}
    assert _value(samples, "hopsched_build_info", **build) == 1


def test_the_collector_exports_the_recurring_counters_every_label_present() -> None:
    stats = RelayStats()
    stats.recurring_delivered += 4
    stats.links += 3
    stats.chains_ended["until"] += 1
    stats.skipped["latest"] += 7
    stats.caught_up["all"] += 2
    stats.lineages += 1
    stats.superseded += 1
    registry = CollectorRegistry()
    registry.register(RelayCollector(stats))

    samples = _samples(generate_latest(registry).decode())

    assert _value(samples, "hopsched_recurring_delivered_total") == 4
    assert _value(samples, "hopsched_recurring_scheduled_total") == 3
    assert _value(samples, "hopsched_recurring_lineage_claims_total") == 1
    assert _value(samples, "hopsched_recurring_superseded_total") == 1
    ended = {"count": 0, "until": 1, "cancelled": 0}
    for reason, value in ended.items():
        assert _value(samples, "hopsched_recurring_chains_ended_total", reason=reason) == value
    for policy in ("latest", "all", "none"):
        skipped = _value(samples, "hopsched_recurring_skipped_total", catch_up=policy)
        caught_up = _value(samples, "hopsched_recurring_caught_up_total", catch_up=policy)
        assert (skipped, caught_up) == ({"latest": 7}.get(policy, 0), {"all": 2}.get(policy, 0))


async def test_a_scrape_takes_the_snapshot_on_the_event_loop() -> None:
    loop = asyncio.get_running_loop()
    threads: list[bool] = []

    def held() -> int:  # the relay's held count: read on the loop, never the HTTP thread
        threads.append(asyncio.get_running_loop() is loop)
        return 1

    server = serve_metrics(RelayStats(held_now=held), 0, loop=loop)
    try:
        samples = await asyncio.to_thread(_scrape, server.port)
    finally:
        await asyncio.to_thread(server.close)

    assert _value(samples, "hopsched_held_messages") == 1
    assert threads == [True]
    assert any(name.startswith("process_") for name, _ in samples)


# --- the real relay on the real broker ------------------------------------------------------


async def test_a_scrape_of_a_running_relay_counts_what_happened(
    make_settings: Callable[..., hopsched.Settings],
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """Four delivered on time (one after relay hops), one overdue, one parked
    (unroutable), one cancelled; a hold window of 200 ms so that a 1.5 s delay hops
    through the relay."""
    settings = make_settings(hold_window_ms=200)
    port = _free_port()
    env = dict(os.environ) | {
        "HOPSCHED_URL": settings.url,
        "HOPSCHED_PREFIX": settings.prefix,
        "HOPSCHED_QUEUE_TYPE": settings.queue_type,
        "HOPSCHED_HOLD_WINDOW_MS": "200",
    }
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hopsched", "relay", "--metrics-port", str(port)),
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    started = b""
    try:
        while b"relay consuming" not in (
            line := await asyncio.wait_for(process.stderr.readline(), 30)
        ):
            assert line, "the relay exited before consuming"
            started += line
        target = await targets.queue()
        parked = await targets.consume(settings.prefix + ".parked")
        before = await asyncio.to_thread(_scrape, port)
        assert _value(before, "hopsched_delivered_total") == 0

        async with hopsched.Scheduler(settings) as scheduler:

            async def schedule(
                routing_key: str, delay: timedelta | None = None, at: datetime | None = None
            ) -> hopsched.Scheduled:
                message = aio_pika.Message(b"m")
                return await scheduler.schedule(
                    message, routing_key=routing_key, delay=delay, at=at
                )

            doomed = await schedule(target.name, delay=timedelta(seconds=2))
            await scheduler.cancel(doomed)
            for _ in range(3):
                await schedule(target.name, delay=timedelta(milliseconds=300))
            hopping = await schedule(target.name, delay=timedelta(milliseconds=1500))
            await schedule(target.name, at=datetime.now(UTC) - timedelta(seconds=5))
            await schedule(f"{target.name}.nobody-bound", delay=timedelta(milliseconds=100))

        received = await target.wait_for(5, within=30)
        await parked.wait_for(1, within=30)
        # The relay counts a delivery on its confirm, which may come after the consumer's.
        for _ in range(300):
            samples = await asyncio.to_thread(_scrape, port)
            if (
                _value(samples, "hopsched_delivered_total") == 5
                and _value(samples, "hopsched_cancelled_total") == 1
            ):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # nothing more comes
        samples = await asyncio.to_thread(_scrape, port)
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()

    [hopped] = [r for r in received if r.schedule_id == hopping.schedule_id]
    relay_hops = hopped.headers[HEADER_HOPS] - 1  # the scheduler placed it in its first step
    assert relay_hops >= 1
    assert _value(samples, "hopsched_delivered_total") == 5
    assert _value(samples, "hopsched_overdue_total") == 1
    assert _value(samples, "hopsched_lateness_seconds_count") == 4
    assert _value(samples, "hopsched_lateness_seconds_bucket", le="+Inf") == 4
    assert 0 < _value(samples, "hopsched_lateness_seconds_sum") < 4 * 1.0
    assert _value(samples, "hopsched_hops_total") == relay_hops
    assert _value(samples, "hopsched_hop_overshoot_seconds_count") == relay_hops
    assert _value(samples, "hopsched_retries_total") == 0
    assert _value(samples, "hopsched_cancelled_total") == 1
    assert _value(samples, "hopsched_cancel_records_total") == 1
    assert _value(samples, "hopsched_reconnects_total") == 0
    assert _value(samples, "hopsched_rejected_total") == 0
    for kind in ParkKind:
        expected = 1 if kind is ParkKind.UNROUTABLE else 0
        assert _value(samples, "hopsched_parked_total", kind=kind.value) == expected, kind
    assert _value(samples, "hopsched_held_messages") == 0
    assert _value(samples, "hopsched_in_flight_publishes") == 0
    assert f"metrics at http://127.0.0.1:{port}/metrics".encode() in started


@contextlib.asynccontextmanager
async def _relay_with_metrics(settings: hopsched.Settings) -> AsyncIterator[int]:
    """A relay process on ``settings``' prefix with its metrics endpoint: yields its port
    once it consumes; stopped with SIGTERM after, and it must exit 0."""
    port = _free_port()
    env = dict(os.environ) | {
        "HOPSCHED_URL": settings.url,
        "HOPSCHED_PREFIX": settings.prefix,
        "HOPSCHED_QUEUE_TYPE": settings.queue_type,
    }
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hopsched", "relay", "--metrics-port", str(port)),
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        while b"relay consuming" not in (
            line := await asyncio.wait_for(process.stderr.readline(), 30)
        ):
            assert line, "the relay exited before consuming"
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()


async def _scrape_until(port: int, done: Callable[[Samples], bool]) -> Samples:
    """Scrape until ``done`` (the relay counts on a confirm, maybe after the consumer got
    the message), at most 30 s, then once more after 1.5 s: nothing more may come."""
    for _ in range(300):
        if done(await asyncio.to_thread(_scrape, port)):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.5)
    return await asyncio.to_thread(_scrape, port)


async def test_a_scrape_of_a_running_relay_counts_recurring_chains(
    make_settings: Callable[..., hopsched.Settings], targets: Targets
) -> None:
    """Three recurring schedules every 1 s: one with count=3 (3 delivered, 2 next
    occurrences scheduled, ended by count), one with until 1.5 s after its start (2
    delivered, 1 scheduled, ended by until), one cancelled before its first occurrence
    (ended by the cancel). Nothing late: nothing skipped or caught up, no lineage claim."""
    settings = make_settings()
    async with _relay_with_metrics(settings) as port:
        target = await targets.queue()
        before = await asyncio.to_thread(_scrape, port)
        assert _value(before, "hopsched_recurring_delivered_total") == 0
        assert _value(before, "hopsched_recurring_chains_ended_total", reason="count") == 0

        async with hopsched.Scheduler(settings) as scheduler:
            start = datetime.now(UTC) + timedelta(seconds=1)
            counted = await scheduler.schedule(
                b"c", every=1, count=3, start=start, routing_key=target.name
            )
            bounded = await scheduler.schedule(
                b"u",
                every=1,
                start=start,
                until=start + timedelta(seconds=1.5),
                routing_key=target.name,
            )
            doomed = await scheduler.schedule(
                b"x", every=1, start=start + timedelta(seconds=2), routing_key=target.name
            )
            await scheduler.cancel(doomed)

        await target.wait_for(5, within=30)

        def ended(samples: Samples) -> bool:
            return _value(samples, "hopsched_delivered_total") == 5 and all(
                _value(samples, "hopsched_recurring_chains_ended_total", reason=reason) == 1
                for reason in ("count", "until", "cancelled")
            )

        samples = await _scrape_until(port, ended)  # a 4th of `counted` would be due
        received = await target.settle()

    occurrences = {
        schedule.schedule_id: sorted(
            r.headers["x-hopsched-occurrence"]
            for r in received
            if r.schedule_id == schedule.schedule_id
        )
        for schedule in (counted, bounded, doomed)
    }
    assert occurrences == {
        counted.schedule_id: [1, 2, 3],
        bounded.schedule_id: [1, 2],
        doomed.schedule_id: [],
    }
    assert _value(samples, "hopsched_delivered_total") == 5
    assert _value(samples, "hopsched_recurring_delivered_total") == 5
    assert _value(samples, "hopsched_recurring_scheduled_total") == 2 + 1
    for reason in ("count", "until", "cancelled"):
        value = _value(samples, "hopsched_recurring_chains_ended_total", reason=reason)
        assert value == 1, reason
    assert _value(samples, "hopsched_cancelled_total") == 1
    for policy in ("latest", "all", "none"):
        assert _value(samples, "hopsched_recurring_skipped_total", catch_up=policy) == 0
        assert _value(samples, "hopsched_recurring_caught_up_total", catch_up=policy) == 0
    assert _value(samples, "hopsched_recurring_lineage_claims_total") == 0
    assert _value(samples, "hopsched_recurring_superseded_total") == 0


async def test_a_scrape_of_a_running_relay_counts_catch_ups(
    make_settings: Callable[..., hopsched.Settings], targets: Targets
) -> None:
    """Schedules whose start is in the past, as after an outage: every 4 s from 10 s ago
    (latest: the occurrences due 10 and 6 s ago collapse into the one 2 s ago), and every
    60 s from 15 s ago (15 s late, past the 10 s limit: latest and all deliver it, caught
    up; none skips it). Each ends there (count=1, or none's until before its next)."""
    settings = make_settings()
    async with _relay_with_metrics(settings) as port:
        target = await targets.queue()
        async with hopsched.Scheduler(settings) as scheduler:
            now = datetime.now(UTC)

            async def schedule(every: float, ago_s: float, catch_up: str, **bounds: Any) -> str:
                scheduled = await scheduler.schedule(
                    catch_up.encode(),
                    every=every,
                    start=now - timedelta(seconds=ago_s),
                    catch_up=catch_up,
                    routing_key=target.name,
                    **bounds,
                )
                return scheduled.schedule_id

            collapsed = await schedule(4, 10, "latest", count=1)
            late_latest = await schedule(60, 15, "latest", count=1)
            late_all = await schedule(60, 15, "all", count=1)
            missed = await schedule(60, 15, "none", until=now + timedelta(seconds=1))

        await target.wait_for(3, within=30)

        def ended(samples: Samples) -> bool:
            counted = _value(samples, "hopsched_recurring_chains_ended_total", reason="count")
            until = _value(samples, "hopsched_recurring_chains_ended_total", reason="until")
            return (counted, until) == (3, 1)

        samples = await _scrape_until(port, ended)
        received = await target.settle()

    assert sorted(r.schedule_id for r in received) == sorted([collapsed, late_latest, late_all])
    [first] = [r for r in received if r.schedule_id == collapsed]
    due = datetime.fromtimestamp(first.headers["x-hopsched-due"] / 1e6, UTC)
    assert abs((due - (now - timedelta(seconds=2))).total_seconds()) < 0.01
    assert missed not in {r.schedule_id for r in received}
    assert _value(samples, "hopsched_recurring_delivered_total") == 3
    assert _value(samples, "hopsched_recurring_scheduled_total") == 0
    skipped = {"latest": 2, "all": 0, "none": 1}
    caught_up = {"latest": 1, "all": 1, "none": 0}
    for policy in ("latest", "all", "none"):
        value = _value(samples, "hopsched_recurring_skipped_total", catch_up=policy)
        assert value == skipped[policy], policy
        value = _value(samples, "hopsched_recurring_caught_up_total", catch_up=policy)
        assert value == caught_up[policy], policy
    assert _value(samples, "hopsched_recurring_chains_ended_total", reason="cancelled") == 0


async def test_a_metrics_port_in_use_exits_1_naming_it(settings: hopsched.Settings) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, _, err = await hopsched_cli(
            "relay", "--metrics-port", str(port), settings=settings, within=30
        )

    assert status == 1
    assert f"port {port}: the port is in use" in err
    assert "--metrics-port" in err
    assert "Traceback" not in err
