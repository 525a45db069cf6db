"""The hop margin learnt from overshoot (pure, no broker)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hopsched.core.overshoot import OvershootTracker

MS = 1_000
SECOND = 1_000_000


def test_no_hops_seen_keeps_the_configured_margin() -> None:
    assert OvershootTracker().margin_ms(0, floor_ms=20, cap_ms=1000) == 20


def test_a_late_hop_widens_the_margin_to_one_and_a_half_times_its_overshoot() -> None:
    tracker = OvershootTracker()
    tracker.record(100 * MS, now_us=0)

    assert tracker.margin_ms(0, floor_ms=20, cap_ms=1000) == 150


def test_the_peak_halves_every_half_life_then_the_floor_holds() -> None:
    tracker = OvershootTracker(half_life_us=10 * SECOND)
    tracker.record(100 * MS, now_us=0)

    assert tracker.peak_us(10 * SECOND) == 50 * MS
    assert tracker.margin_ms(10 * SECOND, floor_ms=20, cap_ms=1000) == 75
    assert tracker.margin_ms(60 * SECOND, floor_ms=20, cap_ms=1000) == 20


def test_the_margin_never_exceeds_the_cap() -> None:
    tracker = OvershootTracker()
    tracker.record(3_600 * SECOND, now_us=0)  # a relay that was down for an hour

    assert tracker.margin_ms(0, floor_ms=20, cap_ms=1000) == 1000


@given(
    samples=st.lists(st.tuples(st.integers(-SECOND, 10 * SECOND), st.integers(0, 60 * SECOND))),
    floor_ms=st.integers(0, 200),
    cap_ms=st.integers(0, 60_000),
)
def test_the_margin_covers_the_latest_overshoot_within_floor_and_cap(
    samples: list[tuple[int, int]], floor_ms: int, cap_ms: int
) -> None:
    tracker = OvershootTracker()
    now_us = 0
    for overshoot_us, gap_us in samples:
        now_us += gap_us
        tracker.record(overshoot_us, now_us)
        margin_ms = tracker.margin_ms(now_us, floor_ms=floor_ms, cap_ms=cap_ms)

        assert floor_ms <= margin_ms <= max(floor_ms, cap_ms)
        assert margin_ms * MS >= min(max(0, overshoot_us), cap_ms * MS)
