"""The relay's Prometheus endpoint: ``RelayStats`` exported at scrape time.

The relay's hot path knows nothing of Prometheus: it counts into ``RelayStats``
(``hopsched.relay.stats``). ``RelayCollector`` turns a ``StatsSnapshot`` into metric families
when ``/metrics`` is scraped, and ``serve_metrics`` serves them with
``prometheus_client``'s HTTP server (a daemon thread) on a registry of its own.

The snapshot is taken on the relay's event loop thread (the HTTP thread asks the loop
for it), so a scrape never reads the relay's state while the loop changes it. A scrape
therefore waits for the loop's current callback to finish; a loop blocked for more than
``SNAPSHOT_TIMEOUT_S`` fails the scrape, which is worth knowing about.

Every metric is listed in docs/operations.md, "Metrics".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from hopsched.core.envelope import FEATURES
from hopsched.errors import MetricsEndpointError
from hopsched.relay.stats import BUCKET_BOUNDS_US, RelayStats, StatsSnapshot
from hopsched.version import __version__

__all__ = ["SNAPSHOT_TIMEOUT_S", "MetricsServer", "RelayCollector", "serve_metrics"]

#: How long a scrape waits for the relay's event loop to take the snapshot, s.
SNAPSHOT_TIMEOUT_S = 5.0

#: (metric name without ``_total``, ``StatsSnapshot.counters`` key, help text)
_COUNTERS = (
    ("hopsched_delivered", "delivered", "Final publishes to a target confirmed by the broker."),
    (
        "hopsched_overdue",
        "overdue",
        "Delivered messages that reached the relay more than 1 s past due (scheduled in "
        "the past, replayed, or waiting while no relay ran); not in hopsched_lateness_seconds.",
    ),
    (
        "hopsched_hops",
        "hops",
        "Hops published by the relay (a pass through a step queue), retries included.",
    ),
    ("hopsched_retries", "retries", "Hops waiting for a target that refused the final publish."),
    ("hopsched_cancelled", "cancelled", "Messages dropped because their schedule was cancelled."),
    (
        "hopsched_rejected",
        "rejected",
        "Messages the relay could not even park, handed back to the broker to dead-letter "
        "into the parking queue.",
    ),
    (
        "hopsched_cancel_records",
        "cancel_records",
        "Cancel and reschedule records read from the {prefix}.cancelled stream.",
    ),
    (
        "hopsched_journal_records",
        "journal_records",
        "Records (delivered, parked, refreshed) the relay wrote to the {prefix}.journal stream.",
    ),
    (
        "hopsched_journal_failures",
        "journal_failures",
        "Journal records the relay could not write; the messages were delivered or parked "
        "all the same.",
    ),
    (
        "hopsched_unsigned_envelopes",
        "unsigned_envelopes",
        "Arrivals of unsigned envelopes relayed while signing keys are set and signatures "
        "not required (each hop counts); at 0 for the longest delay, require_signatures "
        "can be turned on.",
    ),
    ("hopsched_reconnects", "reconnects", "Connections to the broker opened after the first."),
    (
        "hopsched_returned_early",
        "returned_early",
        "Hops a step returned early (a policy's length limit, a short message-ttl), which "
        "waited instead of hopping again at once.",
    ),
    (
        "hopsched_recurring_delivered",
        "recurring_delivered",
        "Of hopsched_delivered, occurrences of recurring schedules (confirmed).",
    ),
    (
        "hopsched_recurring_scheduled",
        "recurring_scheduled",
        "Next occurrences of recurring schedules the relay published into the ladder "
        "(confirmed), one per occurrence but a chain's last.",
    ),
    (
        "hopsched_recurring_lineage_claims",
        "lineage_claims",
        "Lineage claims written to the {prefix}.cancelled stream: recurring occurrences "
        "delivered to the relay again (a relay died or lost its connection holding them).",
    ),
    (
        "hopsched_recurring_superseded",
        "superseded",
        "Copies of recurring occurrences dropped because another lineage of their chain "
        "won a lineage claim (the chain goes on in that lineage).",
    ),
    (
        "hopsched_ingested",
        "ingested",
        "Messages taken from ingress exchanges (x-delay, as for the delayed-message "
        "plugin) and scheduled.",
    ),
    (
        "hopsched_ingested_relay_clock",
        "ingested_unstamped",
        "Of hopsched_ingested, those timed from the relay's receipt: the broker stamped no "
        "receipt time (RabbitMQ < 3.12, or no set_header_timestamp interceptor).",
    ),
)
#: ``hopsched_recurring_chains_ended_total``'s reasons, and the ``catch_up`` policies of
#: ``hopsched_recurring_skipped_total`` and ``hopsched_recurring_caught_up_total``, every
#: one exported (0 until it happens).
_ENDED_BY = ("count", "until", "cancelled")
_CATCH_UPS = ("latest", "all", "none")
#: ``hopsched_records_refused_total``'s reasons, every one exported (0 until it happens).
_REFUSED_REASONS = ("unsigned", "bad_signature", "relayed")

#: Bucket bounds as prometheus_client writes its own (``le`` label values: ``0.0001``,
#: ``1.0``, ``+Inf``), seconds.
_BOUNDS_S = [str(bound / 1_000_000) for bound in BUCKET_BOUNDS_US] + ["+Inf"]


class RelayCollector(Collector):
    """Yields the relay's metrics from ``stats`` at each scrape.

    Args:
        stats: the relay's counters.
        loop: the event loop that changes ``stats``; the snapshot is taken on it. None:
            read ``stats`` directly in the calling thread (tests, or a caller that owns
            ``stats`` alone).
    """

    def __init__(self, stats: RelayStats, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._stats = stats
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(
            "hopsched_build",
            "The relay's hopsched version and the envelope features it understands "
            "(comma-separated, x-hopsched-features).",
            value={"version": __version__, "features": ",".join(sorted(FEATURES))},
        )
        snapshot = self._snapshot()
        for name, key, documentation in _COUNTERS:
            yield CounterMetricFamily(name, documentation, value=snapshot.counters[key])
        parked = CounterMetricFamily(
            "hopsched_parked",
            "Messages moved to the parking queue, by cause (label kind, a ParkKind).",
            labels=["kind"],
        )
        for kind, count in snapshot.parked_by_kind.items():
            parked.add_metric([kind.value], count)
        yield parked
        refused = CounterMetricFamily(
            "hopsched_records_refused",
            "Records of the {prefix}.cancelled stream ignored, by reason: unsigned (while "
            "signatures are required), bad_signature (forged, altered or an unknown key), "
            "relayed (stream messages a relay delivered there, through a binding).",
            labels=["reason"],
        )
        for reason in _REFUSED_REASONS:
            refused.add_metric([reason], snapshot.records_refused.get(reason, 0))
        yield refused
        yield _labelled(
            "hopsched_recurring_chains_ended",
            "Recurring chains that ended at this relay, by why (label reason): count (the "
            "last of count occurrences), until (no occurrence left before until), cancelled "
            "(an occurrence dropped for a cancel).",
            "reason",
            _ENDED_BY,
            snapshot.chains_ended,
        )
        yield _labelled(
            "hopsched_recurring_skipped",
            "Recurring occurrences due but not delivered, by the schedule's catch_up (label): "
            "latest (collapsed into the latest due one), none (and the latest, when missed "
            "by more than 10 s); all never skips.",
            "catch_up",
            _CATCH_UPS,
            snapshot.skipped,
        )
        yield _labelled(
            "hopsched_recurring_caught_up",
            "Recurring occurrences delivered though the relay reached them more than 10 s "
            "past due (no relay ran, the broker was down), by the schedule's catch_up (label).",
            "catch_up",
            _CATCH_UPS,
            snapshot.caught_up,
        )
        yield _histogram(
            "hopsched_lateness_seconds",
            "Final publish confirmed - due time, seconds, of messages that were not overdue "
            "on arrival.",
            snapshot.lateness,
        )
        yield _histogram(
            "hopsched_hop_overshoot_seconds",
            "Arrival of a hop at the relay - the end of its step's TTL, seconds (hops "
            "published by a relay).",
            snapshot.overshoot,
        )
        yield GaugeMetricFamily(
            "hopsched_held_messages",
            "Messages the relay holds in memory until their due time.",
            value=snapshot.held,
        )
        yield GaugeMetricFamily(
            "hopsched_in_flight_publishes",
            "Publishes awaiting the broker's confirm (waiting ones included).",
            value=snapshot.in_flight,
        )
        risks = GaugeMetricFamily(
            "hopsched_policy_risks",
            "Findings of the policies in force on the prefix's queues, by what they risk "
            "(label risk: loss, stall, hops); the relay logs each.",
            labels=["risk"],
        )
        for risk, count in snapshot.policy_risks.items():
            risks.add_metric([risk], count)
        yield risks
        yield GaugeMetricFamily(
            "hopsched_policy_unchecked",
            "1 while the relay cannot read the policies in force (no management API).",
            value=snapshot.policy_unchecked,
        )
        offset = snapshot.relay_clock_offset_us
        yield GaugeMetricFamily(
            "hopsched_relay_clock_offset_seconds",
            "The relay's clock's estimated offset from the broker's (positive: ahead), by "
            "the x-death times the broker writes: never below the true offset, to ~1 s; NaN "
            "before the first hop. Past +2 s the relay waits it out (and logs an ERROR); past "
            "-2 s it delivers that late (a WARNING). Run NTP.",
            value=math.nan if offset is None else offset / 1_000_000,
        )

    def _snapshot(self) -> StatsSnapshot:
        loop = self._loop
        if loop is None or _runs_on(loop):
            return self._stats.snapshot()
        taken: concurrent.futures.Future[StatsSnapshot] = concurrent.futures.Future()

        def take() -> None:
            try:
                taken.set_result(self._stats.snapshot())
            except Exception as error:  # hand it to the scrape, not the loop
                taken.set_exception(error)

        loop.call_soon_threadsafe(take)
        return taken.result(timeout=SNAPSHOT_TIMEOUT_S)


def _runs_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _labelled(
    name: str,
    documentation: str,
    label: str,
    values: tuple[str, ...],
    counts: Mapping[str, int],
) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value in values:
        family.add_metric([value], counts.get(value, 0))
    return family


def _histogram(name: str, documentation: str, data: tuple[list[int], int]) -> Metric:
    cumulative, sum_us = data
    return HistogramMetricFamily(
        name,
        documentation,
        buckets=list(zip(_BOUNDS_S, cumulative, strict=True)),
        sum_value=sum_us / 1_000_000,
    )


@dataclass
class MetricsServer:
    """A running metrics endpoint; ``close()`` stops it (idempotent).

    Attributes:
        port: the TCP port it listens on (the one chosen by the system, if 0 was asked).
        registry: its own registry (the relay's collector and the process's metrics).
    """

    port: int
    registry: CollectorRegistry
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def serve_metrics(
    stats: RelayStats,
    port: int,
    address: str = "127.0.0.1",
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    process_metrics: bool = True,
) -> MetricsServer:
    """Serve ``stats`` over HTTP at ``http://address:port/metrics`` (any path answers).

    Args:
        loop: the event loop that changes ``stats`` (see ``RelayCollector``).
        process_metrics: also export the standard ``process_*`` metrics (CPU seconds,
            resident memory, open files; Linux only).

    Raises:
        MetricsEndpointError: it cannot listen there (the port in use, the address not
            this machine's, a port below 1024 without the privilege); the message names
            the port and the fix.
    """
    registry = CollectorRegistry()
    registry.register(RelayCollector(stats, loop))
    if process_metrics:
        ProcessCollector(registry=registry)
    try:
        server, thread = start_http_server(port, address, registry=registry)
    except OSError as error:
        raise MetricsEndpointError(_why_not(error, port, address)) from None
    return MetricsServer(server.server_port, registry, server, thread)


def _why_not(error: OSError, port: int, address: str) -> str:
    where = f"the metrics endpoint cannot listen on {address} port {port}"
    if error.errno == errno.EADDRINUSE:
        return (
            f"{where}: the port is in use (another relay or program on this machine); "
            "choose another with --metrics-port or HOPSCHED_METRICS_PORT, or stop what "
            f"uses it (`ss -ltnp 'sport = :{port}'` shows it)"
        )
    if error.errno == errno.EACCES:
        return f"{where}: permission denied; use a port of 1024 or more (--metrics-port)"
    return (
        f"{where}: {error.strerror or error}; check --metrics-address "
        "(HOPSCHED_METRICS_ADDRESS): an address of this machine, 0.0.0.0 or ::"
    )
