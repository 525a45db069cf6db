"""What the relay counts and measures, and the lines it logs about it.

``LatenessStats`` is an HDR histogram of microseconds reported in milliseconds;
``Buckets`` counts values per fixed bucket (what ``hopsched.relay.metrics`` exports as a
Prometheus histogram); ``RelayStats`` holds a relay's counters since it started, the
current log interval's, the producers' clock offsets, and the problems it met per
target, so that its log says each problem once per interval with a count instead of
once per message. ``StatsSnapshot`` is a copy of the totals at one instant.

Pure: no I/O, no metrics library; recording costs a few list and integer operations.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hdrh.histogram import HdrHistogram

from hopsched.core.cancel import RecordTally
from hopsched.core.decide import ParkKind

__all__ = [
    "BUCKET_BOUNDS_US",
    "CLOCK_OFFSET_WARN_US",
    "OVERDUE_AFTER_US",
    "Buckets",
    "LatenessStats",
    "RelayStats",
    "StatsSnapshot",
]

_RISKS = ("loss", "stall", "hops")  # hopsched.broker.policies.Risk, without importing it
#: ``RelayStats.chains_ended``'s reasons and the ``catch_up`` policies
#: (``hopsched.core.recurring.CatchUp`` values), every one exported.
_ENDED_BY = ("count", "until", "cancelled")
_CATCH_UPS = ("latest", "all", "none")
_HIGHEST_US = 7 * 24 * 3600 * 1_000_000  # a week; larger values are clamped to it

#: A message reaching the relay more than this after its due time (µs) was overdue on
#: arrival (scheduled in the past, replayed from the parking queue, or waiting while no
#: relay ran): it is counted as ``overdue``, apart from the relay's own lateness.
OVERDUE_AFTER_US = 1_000_000

#: A producer whose clock seems this far (µs) from the relay's, either way, is warned
#: about: its due times are read by the relay's clock, so they shift by its offset.
CLOCK_OFFSET_WARN_US = 1_000_000


#: Upper bounds (inclusive, µs) of the buckets of ``Buckets``: 100 µs to 60 s, about
#: 1-2.5-5 per decade; larger values count only in the implicit +Inf bucket.
BUCKET_BOUNDS_US: tuple[int, ...] = (
    *(100, 250, 500),
    *(1_000, 2_500, 5_000),
    *(10_000, 25_000, 50_000),
    *(100_000, 250_000, 500_000),
    *(1_000_000, 2_500_000, 5_000_000),
    *(10_000_000, 30_000_000, 60_000_000),
)


class Buckets:
    """Counts of values (µs) per fixed bucket, and their sum: a Prometheus histogram's
    data, recorded without a metrics library.

    ``counts[i]`` counts values ``<= BUCKET_BOUNDS_US[i]`` and above the bound before
    it; ``counts[-1]`` those above the last bound. A negative value is recorded as 0.
    """

    __slots__ = ("counts", "sum_us")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKET_BOUNDS_US) + 1)
        self.sum_us = 0

    def record(self, value_us: int) -> None:
        value_us = max(value_us, 0)
        self.counts[bisect_left(BUCKET_BOUNDS_US, value_us)] += 1
        self.sum_us += value_us

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Values ``<=`` each bound, then the total (Prometheus's ``le`` buckets, +Inf last)."""
        total, running = 0, []
        for count in self.counts:
            total += count
            running.append(total)
        return running


class LatenessStats:
    """Lateness (receive or publish instant - due time) of many messages.

    Values are recorded in µs with 3 significant digits (HdrHistogram); an early
    value (negative lateness) is counted in ``early`` and recorded as 0.
    """

    def __init__(self) -> None:
        self._histogram = HdrHistogram(1, _HIGHEST_US, 3)
        self.early = 0

    def record(self, lateness_us: int) -> None:
        if lateness_us < 0:
            self.early += 1
        self._histogram.record_value(min(max(lateness_us, 0), _HIGHEST_US))

    @property
    def count(self) -> int:
        return int(self._histogram.get_total_count())

    def percentile_ms(self, percentile: float) -> float:
        """The lateness at ``percentile`` (0-100) in ms; 0.0 when nothing was recorded."""
        return float(self._histogram.get_value_at_percentile(percentile)) / 1000

    @property
    def max_ms(self) -> float:
        return float(self._histogram.get_max_value()) / 1000

    @property
    def mean_ms(self) -> float:
        return float(self._histogram.get_mean_value()) / 1000

    def reset(self) -> None:
        self._histogram.reset()
        self.early = 0

    def summary(self) -> str:
        """``p50=… p99=… max=… ms`` for log lines."""
        if not self.count:
            return "n/a"
        return (
            f"p50={self.percentile_ms(50):.1f} p99={self.percentile_ms(99):.1f} "
            f"max={self.max_ms:.1f} ms"
        )


@dataclass
class _Counts:
    delivered: int = 0
    overdue: int = 0
    hops: int = 0
    retries: int = 0
    parked: int = 0
    rejected: int = 0
    cancelled: int = 0
    lateness: LatenessStats = field(default_factory=LatenessStats)
    overshoot: LatenessStats = field(default_factory=LatenessStats)


@dataclass
class RelayStats:
    """A relay's counters and measurements.

    Attributes:
        delivered: final publishes confirmed; ``overdue`` of them arrived more than
            ``OVERDUE_AFTER_US`` past due and are not in ``lateness``.
        hops: hops published (passes through a step queue started by this relay).
        retries: hops that wait for a target that refused the final publish.
        parked: messages moved to the parking queue; ``parked_by_kind`` by cause.
        rejected: deliveries handed back to the broker to dead-letter into the parking
            queue because not even parking worked (``basic.nack``, requeue=false).
        cancelled: messages dropped because their schedule was cancelled.
        records: cancel and reschedule records read from ``{prefix}.cancelled``.
        journal_records: records this relay's journal writes carried to
            ``{prefix}.journal`` (delivered, parked, refreshed), confirmed.
        journal_failures: journal records not written (the stream refused them, or the
            connection went): the messages they told of were delivered or parked all the
            same; ``get()`` does not see that.
        record_tally: those records by signature, and the ones ignored for theirs.
        unsigned: envelopes that reached the relay unsigned and were relayed (it holds
            signing keys but does not require signatures); each hop counts.
        reconnects: connections opened after the first.
        hop_nacks: hops the broker nacked (a quorum leader election, a node down) and
            the relay tried again after a back-off.
        hop_silences: hops a step queue left unanswered for ``STEP_SILENCE_S`` while the
            broker answered others (a frozen quorum leader), routed around by a smaller
            step: each may deliver a second copy if that queue wakes.
        returned_early: hops a step returned early enough to come straight back if
            hopped again (``hopsched.core.decide.returned_early``), which waited instead.
        recurring_delivered: of ``delivered``, occurrences of recurring schedules.
        links: next occurrences of recurring schedules scheduled (confirmed).
        missed: recurring occurrences not delivered, missed under ``catch_up="none"``.
        chains_ended: recurring chains that ended at this relay, by why: ``count`` (its
            last occurrence due: ``count`` delivered), ``until`` (no occurrence left
            before ``until``), ``cancelled`` (an occurrence dropped for a cancel).
        caught_up: recurring occurrences delivered though the relay reached them more
            than ``recurring.MISSED_AFTER_US`` past due, per ``catch_up`` policy.
        skipped: recurring occurrences due but not delivered (collapsed into the latest,
            or missed), per ``catch_up`` policy (``recurring.Link.skipped``).
        lineages: lineage claims written for recurring occurrences delivered again.
        superseded: copies of recurring occurrences dropped: a lineage claim replaced them.
        policy_risks: findings of the policies in force, per ``hopsched.broker.policies.Risk``
            value (``loss``, ``stall``, ``hops``), now (set by ``PolicyWatch``).
        policy_unchecked: 1 while the relay cannot read the policies in force (no
            management API), else 0.
        lateness: final publish confirmed - due time, µs, for messages on time.
        overshoot: arrival of a hop - the instant its step's TTL ran out, µs (hops
            stamped by a relay only).
        lateness_buckets, overshoot_buckets: the same values as ``lateness`` and
            ``overshoot``, per fixed bucket (``Buckets``; for metrics).
        clock_offsets: each producer's estimated clock offset from the relay's, µs
            (positive: the producer's clock is ahead).
        ingested: messages taken from ingress exchanges (``hopsched.core.ingress``) and
            scheduled; ``ingested_unstamped`` of them timed from the relay's receipt (the
            broker stamped no receipt time: RabbitMQ < 3.12, or no message interceptor).
        relay_clock_offset_us: the relay's own clock's estimated offset from the broker's,
            µs (positive: ahead; ``hopsched.relay.broker_clock``), None before the first hop
            the broker dead-lettered.
        held_now, in_flight_now: how many messages wait for their due time, and how
            many publishes await their confirm, now (set by the relay; 0 by default).
    """

    delivered: int = 0
    overdue: int = 0
    hops: int = 0
    retries: int = 0
    parked: int = 0
    rejected: int = 0
    cancelled: int = 0
    records: int = 0
    journal_records: int = 0
    journal_failures: int = 0
    record_tally: RecordTally = field(default_factory=RecordTally)
    unsigned: int = 0
    reconnects: int = 0
    hop_nacks: int = 0
    hop_silences: int = 0
    returned_early: int = 0
    recurring_delivered: int = 0
    links: int = 0
    missed: int = 0
    chains_ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_ENDED_BY, 0))
    caught_up: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_CATCH_UPS, 0))
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_CATCH_UPS, 0))
    lineages: int = 0
    superseded: int = 0
    ingested: int = 0
    ingested_unstamped: int = 0
    policy_risks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_RISKS, 0))
    policy_unchecked: int = 0
    parked_by_kind: dict[ParkKind, int] = field(default_factory=lambda: dict.fromkeys(ParkKind, 0))
    lateness: LatenessStats = field(default_factory=LatenessStats)
    overshoot: LatenessStats = field(default_factory=LatenessStats)
    lateness_buckets: Buckets = field(default_factory=Buckets)
    overshoot_buckets: Buckets = field(default_factory=Buckets)
    clock_offsets: dict[str, int] = field(default_factory=dict)
    relay_clock_offset_us: int | None = None
    held_now: Callable[[], int] = field(default=lambda: 0)
    in_flight_now: Callable[[], int] = field(default=lambda: 0)
    _interval: _Counts = field(default_factory=_Counts)
    _problems: Counter[tuple[str, str]] = field(default_factory=Counter)
    _offset_samples: dict[str, int] = field(default_factory=dict)
    _warned_offsets: set[str] = field(default_factory=set)
    _refused_reported: int = 0

    def record_delivery(self, lateness_us: int, arrived_late_us: int) -> None:
        """A final publish confirmed ``lateness_us`` after the due time, of a message
        that reached the relay ``arrived_late_us`` after it (negative: before)."""
        self.delivered += 1
        self._interval.delivered += 1
        if arrived_late_us > OVERDUE_AFTER_US:
            self.overdue += 1
            self._interval.overdue += 1
            return
        self.lateness.record(lateness_us)
        self.lateness_buckets.record(lateness_us)
        self._interval.lateness.record(lateness_us)

    def record_ingested(self, exchange: str, *, stamped: bool) -> None:
        """A message taken from ingress ``exchange``; ``stamped``: timed from the broker's
        receipt stamp."""
        self.ingested += 1
        if not stamped:
            self.ingested_unstamped += 1

    def record_hop(self, *, retry: bool = False) -> None:
        self.hops += 1
        self._interval.hops += 1
        if retry:
            self.retries += 1
            self._interval.retries += 1

    def record_overshoot(self, overshoot_us: int) -> None:
        self.overshoot.record(overshoot_us)
        self.overshoot_buckets.record(overshoot_us)
        self._interval.overshoot.record(overshoot_us)

    def record_parked(self, kind: ParkKind) -> None:
        self.parked += 1
        self._interval.parked += 1
        self.parked_by_kind[kind] += 1

    def record_journal(self, records: int, ok: bool) -> None:
        """A journal write of ``records`` records was confirmed (``ok``) or failed."""
        if ok:
            self.journal_records += records
        else:
            self.journal_failures += records

    def record_returned_early(self) -> None:
        self.returned_early += 1

    def record_cancelled(self) -> None:
        self.cancelled += 1
        self._interval.cancelled += 1

    def record_rejected(self) -> None:
        self.rejected += 1
        self._interval.rejected += 1

    def first_problem(self, target: str, problem: str) -> bool:
        """Count a problem with ``target``; True the first time in this log interval
        (the caller logs it then; the interval's report gives the count)."""
        key = (target, problem)
        self._problems[key] += 1
        return self._problems[key] == 1

    def record_clock_sample(
        self, producer: str, sample_us: int, *, waited_up_to_us: int = 0, resolution_us: int = 0
    ) -> int | None:
        """A first hop from ``producer`` reached the relay ``sample_us`` after the hop's
        expiry by the producer's clock (its overshoot plus the clocks' offset, plus what
        it may have waited in the relay queue: up to ``waited_up_to_us``).

        The smallest sample of an interval estimates the offset (the overshoot is a few
        ms at least). Returns the estimate (µs, positive: the producer is ahead) when it
        first passes ``CLOCK_OFFSET_WARN_US`` in this interval, else None; a producer
        that seems behind, only past ``CLOCK_OFFSET_WARN_US + waited_up_to_us`` (hops that
        waited for a restarting relay look like that: a trial saw "-1.2 s off");
        ``resolution_us``: how far off the sample itself may be either way (the relay's
        own offset from the broker, to the second, when it was taken out), added to both.
        """
        smallest = min(sample_us, self._offset_samples.get(producer, sample_us))
        self._offset_samples[producer] = smallest
        offset_us = -smallest
        self.clock_offsets[producer] = offset_us
        bound = CLOCK_OFFSET_WARN_US + resolution_us + (waited_up_to_us if offset_us < 0 else 0)
        if abs(offset_us) > bound and producer not in self._warned_offsets:
            self._warned_offsets.add(producer)
            return offset_us
        return None

    def report(self, interval_s: float) -> list[str]:
        """The interval's log lines (totals, then each repeated problem), and a new interval."""
        now, totals = self._interval, self
        lines = [
            f"last {interval_s:.0f} s: delivered={now.delivered} (overdue on arrival "
            f"{now.overdue}) hops={now.hops} (retries {now.retries}) parked={now.parked} "
            f"rejected={now.rejected} cancelled={now.cancelled} held={self.held_now()} "
            f"in_flight={self.in_flight_now()}; "
            f"lateness {now.lateness.summary()}, hop overshoot {now.overshoot.summary()}; "
            f"since start: delivered={totals.delivered} hops={totals.hops} "
            f"parked={totals.parked} reconnects={totals.reconnects} "
            f"hop_nacks={totals.hop_nacks} returned_early={totals.returned_early}"
            + (f" hop_silences={totals.hop_silences}" if totals.hop_silences else "")
            + (
                f" recurring occurrences={totals.recurring_delivered} links={totals.links} "
                f"missed={totals.missed} ended={sum(totals.chains_ended.values())} "
                f"lineages={totals.lineages} superseded={totals.superseded}"
                if totals.links
                else ""
            )
            + (
                f" ingested={totals.ingested} (by the relay's clock {totals.ingested_unstamped})"
                if totals.ingested
                else ""
            )
        ]
        lines += [
            f"{count} messages for {target}: {problem}"
            for (target, problem), count in sorted(self._problems.items())
            if count > 1
        ]
        self._interval = _Counts()
        self._problems.clear()
        self._offset_samples.clear()
        self._warned_offsets.clear()
        return lines

    def refused_report(self) -> str | None:
        """The interval's line on records of the cancel stream ignored (forged, altered,
        unsigned where signatures are required, delivered there by a relay): their counts
        since start if any came since the last report, else None. A relay logs it as a
        WARNING (docs/security.md, "Watching it")."""
        refused = self.record_tally.refused
        if (total := sum(refused.values())) <= self._refused_reported:
            return None
        self._refused_reported = total
        counts = ", ".join(f"{reason} {count}" for reason, count in sorted(refused.items()))
        return f"records of the cancel stream ignored since start: {counts}"

    def snapshot(self) -> StatsSnapshot:
        """A copy of the totals since start and the gauges, now (for metrics)."""
        return StatsSnapshot(
            counters={
                "delivered": self.delivered,
                "overdue": self.overdue,
                "hops": self.hops,
                "retries": self.retries,
                "cancelled": self.cancelled,
                "rejected": self.rejected,
                "cancel_records": self.records,
                "journal_records": self.journal_records,
                "journal_failures": self.journal_failures,
                "unsigned_envelopes": self.unsigned,
                "reconnects": self.reconnects,
                "returned_early": self.returned_early,
                "recurring_delivered": self.recurring_delivered,
                "recurring_scheduled": self.links,
                "lineage_claims": self.lineages,
                "superseded": self.superseded,
                "ingested": self.ingested,
                "ingested_unstamped": self.ingested_unstamped,
            },
            chains_ended=dict(self.chains_ended),
            caught_up=dict(self.caught_up),
            skipped=dict(self.skipped),
            parked_by_kind=dict(self.parked_by_kind),
            records_refused=dict(self.record_tally.refused),
            lateness=(self.lateness_buckets.cumulative(), self.lateness_buckets.sum_us),
            overshoot=(self.overshoot_buckets.cumulative(), self.overshoot_buckets.sum_us),
            held=self.held_now(),
            in_flight=self.in_flight_now(),
            policy_risks=dict(self.policy_risks),
            policy_unchecked=self.policy_unchecked,
            relay_clock_offset_us=self.relay_clock_offset_us,
        )


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """``RelayStats``'s totals at one instant.

    Attributes:
        counters: name -> count since the relay started (``delivered``, ``overdue``,
            ``hops``, ``retries``, ``cancelled``, ``rejected``, ``cancel_records``,
            ``journal_records``, ``journal_failures``,
            ``unsigned_envelopes``, ``reconnects``, ``returned_early``,
            ``recurring_delivered``, ``recurring_scheduled`` (``RelayStats.links``),
            ``lineage_claims`` (``RelayStats.lineages``), ``superseded``; see
            ``RelayStats``).
        chains_ended, caught_up, skipped: as ``RelayStats``'s, every key present.
        parked_by_kind: messages parked per ``ParkKind``, every kind present.
        records_refused: records ignored per reason (``RecordTally.refused``).
        lateness, overshoot: cumulative counts per ``BUCKET_BOUNDS_US`` bound then the
            total (``Buckets.cumulative``), and the sum of the values, µs.
        held, in_flight: messages held until due, and publishes awaiting their confirm.
        policy_risks, policy_unchecked, relay_clock_offset_us: as ``RelayStats``'s.
    """

    counters: Mapping[str, int]
    parked_by_kind: Mapping[ParkKind, int]
    records_refused: Mapping[str, int]
    lateness: tuple[list[int], int]
    overshoot: tuple[list[int], int]
    held: int
    in_flight: int
    policy_risks: Mapping[str, int] = field(default_factory=dict)
    policy_unchecked: int = 0
    chains_ended: Mapping[str, int] = field(default_factory=dict)
    caught_up: Mapping[str, int] = field(default_factory=dict)
    skipped: Mapping[str, int] = field(default_factory=dict)
    relay_clock_offset_us: int | None = None
