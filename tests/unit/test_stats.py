"""RelayStats's fixed buckets, per-kind parking counts and snapshot (no broker)."""

from __future__ import annotations

from hopsched.core.decide import ParkKind
from hopsched.relay.stats import BUCKET_BOUNDS_US, OVERDUE_AFTER_US, Buckets, RelayStats


def test_bucket_bounds_go_from_100_us_to_60_s() -> None:
    assert BUCKET_BOUNDS_US[0] == 100
    assert BUCKET_BOUNDS_US[-1] == 60_000_000
    assert list(BUCKET_BOUNDS_US) == sorted(set(BUCKET_BOUNDS_US))


def test_a_value_on_a_bound_counts_in_that_bucket() -> None:
    buckets = Buckets()
    for value in (0, 100, 101, 250, 60_000_000, 60_000_001, -5):
        buckets.record(value)
    cumulative = buckets.cumulative()
    assert len(cumulative) == len(BUCKET_BOUNDS_US) + 1
    assert cumulative[0] == 3  # 0, 100 and the negative value recorded as 0
    assert cumulative[1] == 5  # and 101, 250
    assert cumulative[-2] == 6  # all but the one above 60 s
    assert cumulative[-1] == buckets.count == 7
    assert buckets.sum_us == 100 + 101 + 250 + 60_000_000 + 60_000_001


def test_snapshot_copies_the_totals_and_reads_the_gauges() -> None:
    held = [3]
    stats = RelayStats(held_now=lambda: held[0], in_flight_now=lambda: 2)
    stats.record_delivery(1_500, arrived_late_us=-2_000_000)
    stats.record_delivery(0, arrived_late_us=OVERDUE_AFTER_US + 1)  # overdue: no lateness
    stats.record_hop()
    stats.record_hop(retry=True)
    stats.record_overshoot(4_000)
    stats.record_parked(ParkKind.UNROUTABLE)
    stats.record_cancelled()
    stats.record_returned_early()
    stats.records += 5
    stats.policy_risks["loss"] = 2
    stats.policy_unchecked = 1
    snapshot = stats.snapshot()
    stats.record_parked(ParkKind.UNROUTABLE)  # later changes do not reach the copy
    stats.record_delivery(1_500, arrived_late_us=0)
    held[0] = 0

    assert snapshot.counters == {
        "delivered": 2,
        "overdue": 1,
        "hops": 2,
        "retries": 1,
        "cancelled": 1,
        "rejected": 0,
        "cancel_records": 5,
        "journal_records": 0,
        "journal_failures": 0,
        "unsigned_envelopes": 0,
        "reconnects": 0,
        "returned_early": 1,
        "recurring_delivered": 0,
        "recurring_scheduled": 0,
        "lineage_claims": 0,
        "superseded": 0,
        "ingested": 0,
        "ingested_unstamped": 0,
    }
    assert snapshot.chains_ended == {"count": 0, "until": 0, "cancelled": 0}
    assert snapshot.skipped == snapshot.caught_up == {"latest": 0, "all": 0, "none": 0}
    assert snapshot.policy_risks == {"loss": 2, "stall": 0, "hops": 0}
    assert snapshot.policy_unchecked == 1
    assert snapshot.parked_by_kind == {kind: int(kind is ParkKind.UNROUTABLE) for kind in ParkKind}
    lateness, lateness_sum = snapshot.lateness
    assert (lateness[-1], lateness_sum) == (1, 1_500)
    assert lateness[BUCKET_BOUNDS_US.index(1_000)] == 0
    assert lateness[BUCKET_BOUNDS_US.index(2_500)] == 1
    assert snapshot.overshoot == (stats.overshoot_buckets.cumulative(), 4_000)
    assert (snapshot.held, snapshot.in_flight) == (3, 2)


def test_the_log_line_shows_the_gauges() -> None:
    stats = RelayStats(held_now=lambda: 7, in_flight_now=lambda: 4)
    assert "held=7 in_flight=4" in stats.report(60.0)[0]


def test_a_producer_behind_is_warned_about_only_past_what_a_hop_may_have_waited() -> None:
    """Found by a new-user trial: after a relay's kill -9 and restart, first hops that
    had waited ~1.2 s in the relay queue (x-death's whole seconds let up to 2 s pass)
    read as "producer's clock -1.2 s off". Late samples are a wait or a clock behind;
    early ones (a producer ahead) cannot be a wait."""
    stats = RelayStats()
    waited = 2_000_000

    assert stats.record_clock_sample("p", 1_200_000, waited_up_to_us=waited) is None
    assert stats.record_clock_sample("p", 2_900_000, waited_up_to_us=waited) is None
    assert stats.clock_offsets["p"] == -1_200_000  # the smallest sample, still shown
    assert stats.record_clock_sample("q", 3_500_000, waited_up_to_us=waited) == -3_500_000
    assert stats.record_clock_sample("r", -1_200_000, waited_up_to_us=waited) == 1_200_000


def test_ignored_records_get_their_own_line_once_per_new_count() -> None:
    """docs/security.md says ignored records are logged as a WARNING: the relay logs
    ``refused_report`` at that level, apart from the interval's INFO lines, and only
    when records were ignored since the last report."""
    stats = RelayStats()
    assert stats.refused_report() is None
    stats.record_tally.refused["bad_signature"] += 2
    stats.record_tally.refused["relayed"] += 1
    line = stats.refused_report()
    assert line == "records of the cancel stream ignored since start: bad_signature 2, relayed 1"
    assert not any("ignored" in text for text in stats.report(60.0))
    assert stats.refused_report() is None  # nothing new
    stats.record_tally.refused["unsigned"] += 1
    assert stats.refused_report() == (
        "records of the cancel stream ignored since start: bad_signature 2, relayed 1, unsigned 1"
    )
