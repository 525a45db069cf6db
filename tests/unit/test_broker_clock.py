"""The relay's offset from the broker's clock, from x-death times (F41; no broker)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hopsched.relay.broker_clock import (
    CLOCK_SKEW_THRESHOLD_US,
    SAMPLE_WINDOW_US,
    BrokerClock,
    OffsetEstimator,
    correction_us,
)

S = 1_000_000
T0 = 1_800_000_000 * S  # a true instant, whole seconds


def _died(true_us: int) -> int:
    """The x-death time the broker writes for a hop dead-lettered at ``true_us``: whole
    seconds, the fraction dropped."""
    return true_us // S * S


@pytest.mark.parametrize(
    ("offset_us", "deaths", "expected_us"),
    [
        # (relay's offset, [(true dead-lettering instant - T0, queueing delay)], estimate)
        (0, [(0, 2_000)], 2_000),
        (0, [(999_000, 2_000), (1_000, 2_000)], 3_000),  # the smallest fraction wins
        (30 * S, [(400_000, 5_000), (1_100_000, 1_000)], 30 * S + 101_000),
        (30 * S, [(0, 20 * S), (10 * S, 1_000)], 30 * S + 1_000),  # a backlog, then prompt
        (-30 * S, [(500_000, 1_000)], -30 * S + 501_000),
    ],
)
def test_the_estimate_is_the_smallest_receipt_minus_x_death(
    offset_us: int, deaths: list[tuple[int, int]], expected_us: int
) -> None:
    estimator = OffsetEstimator()
    for died_after_us, queued_us in deaths:
        true_died = T0 + died_after_us
        estimator.record(true_died + queued_us + offset_us, _died(true_died))
    assert estimator.estimate_us == expected_us


def test_no_estimate_before_a_sample() -> None:
    assert OffsetEstimator().estimate_us is None
    clock = BrokerClock(lambda: T0)
    assert clock.offset_us is None
    assert clock() == T0
    assert clock.skew is None


def test_older_samples_leave_the_window_after_a_newer_one() -> None:
    estimator = OffsetEstimator()
    estimator.record(T0 + 30 * S, T0)  # 30 s ahead
    estimator.record(T0 + SAMPLE_WINDOW_US, T0 + SAMPLE_WINDOW_US)  # NTP set it right
    assert estimator.estimate_us == 0
    # and with no newer sample, the last estimate stays, however old
    alone = OffsetEstimator()
    alone.record(T0 + 30 * S, T0)
    assert alone.estimate_us == 30 * S


def test_a_larger_sample_replaces_a_smaller_only_once_that_left_the_window() -> None:
    estimator = OffsetEstimator(window_us=10 * S)
    estimator.record(T0 + 3 * S, T0)  # 3 s
    estimator.record(T0 + 9 * S, T0 + 4 * S)  # 5 s
    assert estimator.estimate_us == 3 * S
    estimator.record(T0 + 14 * S, T0 + 10 * S)  # 4 s, the 3 s one is 11 s older
    assert estimator.estimate_us == 4 * S


@pytest.mark.parametrize(
    ("estimate_us", "expected_us"),
    [
        (None, 0),
        (0, 0),
        (CLOCK_SKEW_THRESHOLD_US, 0),
        (CLOCK_SKEW_THRESHOLD_US + 1, CLOCK_SKEW_THRESHOLD_US + 1),
        (30 * S, 30 * S),
        (-30 * S, 0),  # behind: nothing to wait out
    ],
)
def test_only_a_clock_ahead_past_the_threshold_is_corrected(
    estimate_us: int | None, expected_us: int
) -> None:
    assert correction_us(estimate_us) == expected_us


def test_the_broker_clock_reads_the_raw_clock_less_the_correction() -> None:
    raw = [T0 + 30 * S]
    clock = BrokerClock(lambda: raw[0])
    clock.record(_died(T0 - 2_000))
    assert clock.offset_us == 30 * S + 2_000 + (T0 - 2_000) % S
    assert clock.skew == "ahead"
    assert clock() <= T0  # never ahead of the broker
    behind = BrokerClock(lambda: T0 - 30 * S)
    behind.record(_died(T0))
    assert behind.skew == "behind"
    assert behind() == T0 - 30 * S  # not corrected


@given(
    offset_us=st.integers(-3600 * S, 3600 * S),
    deaths=st.lists(
        st.tuples(st.integers(0, 600 * S), st.integers(0, 30 * S)), min_size=1, max_size=40
    ),
    elapsed_us=st.integers(0, 10 * S),
)
def test_never_under_corrects_a_clock_ahead(
    offset_us: int, deaths: list[tuple[int, int]], elapsed_us: int
) -> None:
    """Whatever the queueing delays (never negative) and fractions dropped, the corrected
    clock is never ahead of the broker's: a message released by it is never early."""
    raw = [0]
    clock = BrokerClock(lambda: raw[0])
    for died_after_us, queued_us in sorted(deaths, key=lambda death: sum(death)):
        true_died = T0 + died_after_us
        raw[0] = true_died + queued_us + offset_us
        clock.record(_died(true_died))
        assert clock.offset_us is not None
        assert clock.offset_us >= offset_us
        if offset_us > CLOCK_SKEW_THRESHOLD_US:
            true_now = raw[0] - offset_us
            assert clock() <= true_now
    true_now = raw[0] - offset_us + elapsed_us
    raw[0] = true_now + offset_us
    if offset_us > CLOCK_SKEW_THRESHOLD_US:
        assert clock() <= true_now
    else:  # not corrected: off by the offset only, at most the threshold ahead
        assert clock() - true_now <= CLOCK_SKEW_THRESHOLD_US


def test_the_correction_falls_at_once_and_rises_only_past_the_resolution() -> None:
    raw = [0]
    clock = BrokerClock(lambda: raw[0])
    clock.estimator.window_us = 10 * S

    def sample(received_us: int, died_us: int) -> None:
        raw[0] = received_us
        clock.record(died_us)

    sample(T0 + 30 * S + 100_000, T0)
    assert clock.correction_us == 30 * S + 100_000
    sample(T0 + 40 * S + 900_000, T0 + 10 * S)  # the first left the window: +30.9 s
    assert clock.correction_us == 30 * S + 100_000  # a fraction more: not followed
    sample(T0 + 50 * S + 50_000, T0 + 20 * S)
    assert clock.correction_us == 30 * S + 50_000  # less: followed
    sample(T0 + 65 * S, T0 + 30 * S)  # stepped 5 s further ahead
    sample(T0 + 75 * S, T0 + 40 * S)
    assert clock.correction_us == 35 * S
