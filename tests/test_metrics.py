"""The relay's Prometheus endpoint: its families from RelayStats, scraped over HTTP from
a real relay process on the real broker, and a port in use."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import aio_pika
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import HEADER_HOPS, Targets, hopsched_cli

import hopsched
from hopsched.decide import ParkKind
from hopsched.metrics import RelayCollector, serve_metrics
from hopsched.stats import BUCKET_BOUNDS_US, RelayStats

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
