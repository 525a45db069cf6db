"""The ladder's planner: never early, always terminates, bounded hops (pure, no broker).

Times are integer microseconds; step TTLs are milliseconds. ``follow_plan`` plays the
relay: it asks ``plan()`` what to do, and each hop comes back after the step's TTL plus
an overshoot (TTL expiry and dead-lettering take 2.5-3 ms past the TTL, DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import pytest
from hypothesis import assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from hopsched.core.ladder import (
    BROKER_MAX_TTL_MS,
    STEP_RATIOS,
    AvoidedSteps,
    Hold,
    Hop,
    Ladder,
    describe_steps,
    ladder_of,
)
from hopsched.errors import InvalidSettingsError
from hopsched.topology import ladder_mismatch

US_PER_MS = 1_000
MS = US_PER_MS
SECOND = 1_000_000
DAY = 86_400 * SECOND

DEFAULT = Ladder()  # min 16 ms, max 2**32 ms, hold window 50 ms, margin 20 ms


@dataclass
class Run:
    """What happened to one message whose relay followed the plan."""

    hops: list[tuple[int, int]]  # (instant the hop was published, step ms)
    arrival_us: int  # when the message reached the relay for the last time
    hold: Hold

    @property
    def steps(self) -> list[int]:
        return [step for _, step in self.hops]

    @property
    def delivered_us(self) -> int:
        """The relay waits ``hold.wait_us`` in-process, then delivers."""
        return self.arrival_us + self.hold.wait_us


def follow_plan(
    ladder: Ladder,
    due_us: int,
    overshoot_us: Callable[[], int],
    *,
    start_us: int = 0,
    avoid: frozenset[int] = frozenset(),
) -> Run:
    """Play the relay for a message due at ``due_us``, starting at ``start_us``, the
    steps in ``avoid`` routed around."""
    limit = ladder.max_hops(max(0, due_us - start_us), avoid) + 1
    now, hops = start_us, []
    while isinstance(action := ladder.plan(now_us=now, due_us=due_us, avoid=avoid), Hop):
        hops.append((now, action.step_ms))
        assert len(hops) <= limit, f"no Hold after {len(hops)} hops: {hops[-5:]}"
        now += action.step_ms * US_PER_MS + overshoot_us()
    return Run(hops=hops, arrival_us=now, hold=action)


def ceil_log2_ratio(numerator: int, denominator: int) -> int:
    """ceil(log2(numerator / denominator)) for a ratio above 1, in exact integers."""
    quotient = -(-numerator // denominator)
    return (quotient - 1).bit_length()


@st.composite
def ladders(
    draw: st.DrawFn, *, min_margin_ms: int = 0, ratios: tuple[int, ...] = STEP_RATIOS
) -> Ladder:
    """Any valid ladder: every step ratio, smallest steps from 1 ms to 32 s (a coarse
    ``min_step_ms=1024`` among them), top steps up to 2**32 ms."""
    ratio = draw(st.sampled_from(ratios))
    shift = ratio.bit_length() - 1
    low = draw(st.integers(0, 15 // shift)) * shift  # min step + margin within MAX_HOLD_MS
    high = low + draw(st.integers(0, (32 - low) // shift)) * shift
    return Ladder(
        min_step_ms=2**low,
        max_step_ms=2**high,
        hold_window_ms=draw(st.integers(0, 5_000)),
        hop_margin_ms=draw(st.integers(min_margin_ms, 200)),
        step_ratio=ratio,
    )


@st.composite
def ladder_and_delay(
    draw: st.DrawFn, *, min_margin_ms: int = 0, ratios: tuple[int, ...] = STEP_RATIOS
) -> tuple[Ladder, int]:
    """A ladder and a delay (µs) of up to 40 laps of its top step, sometimes negative."""
    ladder = draw(ladders(min_margin_ms=min_margin_ms, ratios=ratios))
    top_us = ladder.max_step_ms * US_PER_MS
    laps = draw(st.integers(0, 40))
    rest = draw(st.integers(-10 * SECOND, top_us))
    return ladder, laps * top_us + rest


# --- properties -------------------------------------------------------------------------


@given(case=ladder_and_delay(min_margin_ms=1), start_us=st.integers(0, 2**60), data=st.data())
def test_following_the_plan_with_overshoot_below_margin_is_never_early(
    case: tuple[Ladder, int], start_us: int, data: st.DataObject
) -> None:
    ladder, delay_us = case
    margin_us = ladder.hop_margin_ms * US_PER_MS
    due_us = start_us + delay_us

    run = follow_plan(
        ladder, due_us, lambda: data.draw(st.integers(0, margin_us - 1)), start_us=start_us
    )

    for published_us, step_ms in run.hops:
        assert step_ms * US_PER_MS <= due_us - published_us - margin_us
    remaining_us = due_us - run.arrival_us
    if delay_us >= 0:
        assert remaining_us >= 0
        assert run.hold.wait_us == remaining_us
    else:
        assert run.hops == []
        assert run.hold == Hold(0)
    assert run.delivered_us == max(run.arrival_us, due_us)


@hypothesis_settings(deadline=None)  # a hop drawn per hop: up to 40 laps and 3 per step
@given(case=ladder_and_delay(), data=st.data())
def test_delivery_is_never_early_even_when_hops_overshoot_the_margin(
    case: tuple[Ladder, int], data: st.DataObject
) -> None:
    ladder, delay_us = case
    largest_us = ladder.hop_margin_ms * US_PER_MS + 10 * SECOND

    run = follow_plan(ladder, delay_us, lambda: data.draw(st.integers(0, largest_us)))

    assert run.hold.wait_us >= 0
    assert run.delivered_us == max(run.arrival_us, delay_us)
    assert run.delivered_us >= delay_us


@given(
    ladder=ladders(),
    now_us=st.integers(-(2**62), 2**62),
    remaining_us=st.integers(-(2**40), 2**45),
)
def test_plan_always_returns_a_hop_or_a_hold(
    ladder: Ladder, now_us: int, remaining_us: int
) -> None:
    action = ladder.plan(now_us=now_us, due_us=now_us + remaining_us)

    assert isinstance(action, Hop | Hold)


@given(case=ladder_and_delay(), overshoot_us=st.integers(0, 60 * SECOND))
def test_route_terminates_for_any_constant_overshoot(
    case: tuple[Ladder, int], overshoot_us: int
) -> None:
    ladder, delay_us = case

    steps = ladder.route(delay_us, overshoot_us)

    assert len(steps) <= ladder.max_hops(max(0, delay_us))


@given(case=ladder_and_delay(min_margin_ms=1), data=st.data())
def test_hops_stay_within_max_hops_for_overshoot_below_margin(
    case: tuple[Ladder, int], data: st.DataObject
) -> None:
    ladder, delay_us = case
    margin_us = ladder.hop_margin_ms * US_PER_MS
    overshoot_us = data.draw(st.integers(0, margin_us - 1))

    route = ladder.route(delay_us, overshoot_us)
    run = follow_plan(ladder, delay_us, lambda: data.draw(st.integers(0, margin_us - 1)))

    assert len(route) <= ladder.max_hops(max(0, delay_us))
    assert len(run.hops) <= ladder.max_hops(max(0, delay_us))


@given(ladder=ladders(min_margin_ms=1, ratios=(2,)), data=st.data())
def test_hops_within_the_ladder_are_logarithmic_in_the_delay(
    ladder: Ladder, data: st.DataObject
) -> None:
    min_us = ladder.min_step_ms * US_PER_MS
    delay_us = data.draw(st.integers(1, ladder.max_step_ms * US_PER_MS))
    overshoot_us = data.draw(st.integers(0, ladder.hop_margin_ms * US_PER_MS - 1))

    steps = ladder.route(delay_us, overshoot_us)

    if delay_us <= min_us:
        assert steps == []
    else:
        assert len(steps) <= ceil_log2_ratio(delay_us, min_us) + 2
    below_top = [step for step in steps if step != ladder.max_step_ms]
    assert len(below_top) == len(set(below_top)), f"a step below the top reused: {steps}"


@given(
    ladder=ladders(),
    now_us=st.integers(0, 2**60),
    remaining_us=st.integers(-(2**40), 2**45),
)
def test_a_hop_is_the_largest_ladder_step_that_fits(
    ladder: Ladder, now_us: int, remaining_us: int
) -> None:
    # a hop lands in the hold window's second half at least (Ladder.plan)
    margin_us = max(ladder.hop_margin_ms, ladder.hold_window_ms // 2) * US_PER_MS

    action = ladder.plan(now_us=now_us, due_us=now_us + remaining_us)

    if isinstance(action, Hop):
        step = action.step_ms
        assert step & (step - 1) == 0
        assert ladder.min_step_ms <= step <= ladder.max_step_ms
        assert step in ladder.steps
        assert remaining_us > ladder.hold_window_ms * US_PER_MS
        assert step * US_PER_MS + margin_us <= remaining_us
        next_us = step * ladder.step_ratio * US_PER_MS
        assert step == ladder.max_step_ms or next_us + margin_us > remaining_us
    else:
        assert action.wait_us == max(0, remaining_us)
        smallest_fits = ladder.min_step_ms * US_PER_MS + margin_us <= remaining_us
        assert remaining_us <= ladder.hold_window_ms * US_PER_MS or not smallest_fits


@given(ladder=ladders(min_margin_ms=1, ratios=(2,)), data=st.data())
def test_hops_are_at_most_log2_of_delay_over_hold_window_plus_2(
    ladder: Ladder, data: st.DataObject
) -> None:
    """Issue 5's bound: hops <= ceil(log2(delay / hold window)) + 2 within the ladder."""
    window_us = max(ladder.hold_window_ms, ladder.min_step_ms) * US_PER_MS
    assume(window_us < ladder.max_step_ms * US_PER_MS)
    delay_us = data.draw(st.integers(window_us + 1, ladder.max_step_ms * US_PER_MS))
    run = follow_plan(
        ladder, delay_us, lambda: data.draw(st.integers(0, ladder.hop_margin_ms * US_PER_MS - 1))
    )

    assert len(run.hops) <= ceil_log2_ratio(delay_us, window_us) + 2


@given(ladder=ladders(), remaining_us=st.integers(-(2**40), 2**45), window_ms=st.integers(0, 5000))
def test_a_hold_window_override_replaces_the_ladders_own(
    ladder: Ladder, remaining_us: int, window_ms: int
) -> None:
    overridden = ladder.plan(now_us=0, due_us=remaining_us, hold_window_ms=window_ms)
    rebuilt = replace(ladder, hold_window_ms=window_ms)

    assert overridden == rebuilt.plan(now_us=0, due_us=remaining_us)


@given(
    ladder=ladders(),
    now_us=st.integers(0, 2**60),
    shorter_us=st.integers(-(2**40), 2**45),
    extra_us=st.integers(0, 2**45),
)
def test_more_remaining_time_never_picks_a_smaller_step(
    ladder: Ladder, now_us: int, shorter_us: int, extra_us: int
) -> None:
    def step_for(remaining_us: int) -> int:
        action = ladder.plan(now_us=now_us, due_us=now_us + remaining_us)
        return action.step_ms if isinstance(action, Hop) else 0

    assert step_for(shorter_us) <= step_for(shorter_us + extra_us)


@given(
    ladder=ladders(),
    remaining_us=st.integers(-(2**40), 2**45),
    now_us=st.integers(-(2**62), 2**62),
)
def test_plan_depends_only_on_the_remaining_time(
    ladder: Ladder, remaining_us: int, now_us: int
) -> None:
    at_epoch = ladder.plan(now_us=0, due_us=remaining_us)

    assert ladder.plan(now_us=now_us, due_us=now_us + remaining_us) == at_epoch


# --- tables ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remaining_us", "expected"),
    [
        pytest.param(0, Hold(0), id="due-now"),
        pytest.param(-1, Hold(0), id="1us-past"),
        pytest.param(-5 * SECOND, Hold(0), id="5s-past"),
        pytest.param(-3_600 * SECOND, Hold(0), id="1h-past"),
        pytest.param(400, Hold(400), id="0.4ms"),
        pytest.param(1_500, Hold(1_500), id="1.5ms"),
        pytest.param(36 * MS, Hold(36 * MS), id="min-step-plus-margin-inside-hold-window"),
        pytest.param(52 * MS, Hold(52 * MS), id="52ms"),
        pytest.param(SECOND, Hold(SECOND), id="1s-inside-hold-window"),
        pytest.param(4 * SECOND, Hold(4 * SECOND), id="hold-window-edge"),
        # a hop lands at least half the hold window (2 s) before the due time
        pytest.param(4 * SECOND + 1, Hop(1024), id="just-past-hold-window"),
        pytest.param(4100 * MS, Hop(2048), id="4.1s"),
        pytest.param(6 * SECOND, Hop(2048), id="6s-would-land-under-2s-with-4096"),
        pytest.param(6100 * MS, Hop(4096), id="6.1s"),
        pytest.param(2**32 * MS - MS, Hop(2**31), id="2**32-1ms"),
        pytest.param(2**32 * MS, Hop(2**31), id="2**32ms-top-step-needs-2s-in-hand"),
        pytest.param(2**32 * MS + 2000 * MS, Hop(2**32), id="top-step-plus-2s"),
        pytest.param(3 * 2**32 * MS, Hop(2**32), id="top-step-reused"),
    ],
)
def test_default_ladder_plan(remaining_us: int, expected: Hop | Hold) -> None:
    now_us = 1_700_000_000 * SECOND

    assert DEFAULT.plan(now_us=now_us, due_us=now_us + remaining_us) == expected


@pytest.mark.parametrize(
    ("ladder", "remaining_us", "expected"),
    [
        pytest.param(Ladder(hold_window_ms=0), 36 * MS, Hop(16), id="exactly-min-plus-margin"),
        pytest.param(
            Ladder(hold_window_ms=0), 36 * MS - 1, Hold(36 * MS - 1), id="1us-short-of-min"
        ),
        pytest.param(Ladder(hold_window_ms=0, hop_margin_ms=0), 16 * MS, Hop(16), id="no-margin"),
        pytest.param(
            Ladder(hold_window_ms=0, hop_margin_ms=0), 16 * MS - 1, Hold(16 * MS - 1), id="no-fit"
        ),
        pytest.param(Ladder(hold_window_ms=0), 1, Hold(1), id="no-window-1us"),
        pytest.param(Ladder(hold_window_ms=0), 0, Hold(0), id="no-window-due-now"),
        pytest.param(
            Ladder(min_step_ms=1, hold_window_ms=0, hop_margin_ms=0),
            1_500,
            Hop(1),
            id="1ms-step-for-1.5ms",
        ),
    ],
)
def test_plan_at_the_smallest_step(ladder: Ladder, remaining_us: int, expected: Hop | Hold) -> None:
    assert ladder.plan(now_us=0, due_us=remaining_us) == expected


@pytest.mark.parametrize(
    ("ladder", "delay_us", "expected"),
    [
        pytest.param(DEFAULT, 0, [], id="zero"),
        pytest.param(DEFAULT, -5 * SECOND, [], id="negative"),
        pytest.param(DEFAULT, 400, [], id="0.4ms"),
        pytest.param(DEFAULT, 1_500, [], id="1.5ms"),
        pytest.param(DEFAULT, 4 * SECOND, [], id="4s-is-held"),
        pytest.param(DEFAULT, 10 * SECOND, [4096, 2048], id="10s"),
        pytest.param(
            Ladder(max_step_ms=1024),
            10 * SECOND,
            [1024] * 6,
            id="top-step-reused",
        ),
    ],
)
def test_route(ladder: Ladder, delay_us: int, expected: list[int]) -> None:
    assert ladder.route(delay_us) == expected


def test_route_with_overshoot_ends_inside_the_hold_window() -> None:
    steps = DEFAULT.route(60 * SECOND, overshoot_us=3 * MS)

    assert steps == [32768, 16384, 8192]
    assert 60 * SECOND - sum(steps) * MS - len(steps) * 3 * MS <= DEFAULT.hold_window_ms * MS


def test_default_steps_are_every_power_of_two_from_16ms_to_2_pow_32ms() -> None:
    assert DEFAULT.steps == tuple(2**k for k in range(4, 33))


@pytest.mark.parametrize(
    ("delay_us", "expected"),
    [(0, 28), (1, 29), (2**32 * MS, 29), (2**32 * MS + 1, 30), (10 * 2**32 * MS, 38)],
)
def test_max_hops_counts_top_laps_plus_each_smaller_step(delay_us: int, expected: int) -> None:
    assert DEFAULT.max_hops(delay_us) == expected


# --- F04: delays beyond 2**32 - 1 ms -------------------------------------------------------

F04_DELAYS = [
    pytest.param((2**32 - 1) * MS, id="2**32-1ms"),
    pytest.param(2**32 * MS, id="2**32ms"),
    pytest.param(timedelta(days=180) // timedelta(microseconds=1), id="180days"),
    pytest.param(timedelta(days=3650) // timedelta(microseconds=1), id="10years"),
]
F04_OVERSHOOTS = [0, 3 * MS, DEFAULT.hop_margin_ms * MS - 1]


@pytest.mark.parametrize("delay_us", F04_DELAYS)
@pytest.mark.parametrize("overshoot_us", F04_OVERSHOOTS)
def test_F04_route_never_outlasts_the_delay(delay_us: int, overshoot_us: int) -> None:
    steps = DEFAULT.route(delay_us, overshoot_us)

    assert steps, "a long delay must hop, not be delivered at once"
    assert (sum(steps) + DEFAULT.hop_margin_ms) * MS <= delay_us
    remaining_us = delay_us - sum(steps) * MS - len(steps) * overshoot_us
    assert 0 <= remaining_us <= DEFAULT.hold_window_ms * MS


@pytest.mark.parametrize("delay_us", F04_DELAYS)
def test_F04_top_step_is_reused_as_often_as_needed(delay_us: int) -> None:
    steps = DEFAULT.route(delay_us)
    top_ms = DEFAULT.max_step_ms

    laps = steps.count(top_ms)

    assert laps == (delay_us - DEFAULT.hop_margin_ms * MS) // (top_ms * MS)
    assert delay_us // (top_ms * MS) - 1 <= laps <= delay_us // (top_ms * MS)
    assert steps[:laps] == [top_ms] * laps, "the top step comes first, then smaller ones"
    assert all(step < top_ms for step in steps[laps:])


@pytest.mark.parametrize("delay_us", F04_DELAYS)
@pytest.mark.parametrize("overshoot_us", F04_OVERSHOOTS)
def test_F04_hops_are_bounded(delay_us: int, overshoot_us: int) -> None:
    steps = DEFAULT.route(delay_us, overshoot_us)

    assert len(steps) <= DEFAULT.max_hops(delay_us)
    below_top = [step for step in steps if step != DEFAULT.max_step_ms]
    assert len(below_top) == len(set(below_top))


def test_F04_ten_years_is_73_laps_of_the_top_step() -> None:
    ten_years_us = BROKER_MAX_TTL_MS * MS

    steps = DEFAULT.route(ten_years_us)

    assert steps.count(2**32) == 73
    assert len(steps) <= 73 + 28


@pytest.mark.parametrize("delay_us", F04_DELAYS)
def test_F04_relay_delivers_at_the_due_time_not_before(delay_us: int) -> None:
    run = follow_plan(DEFAULT, delay_us, lambda: 3 * MS)

    assert run.delivered_us == delay_us
    assert run.hold.wait_us <= DEFAULT.hold_window_ms * MS


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        pytest.param({"min_step_ms": 15}, "min_step_ms", id="min-not-power-of-two"),
        pytest.param({"min_step_ms": 0}, "min_step_ms", id="min-zero"),
        pytest.param({"min_step_ms": -16}, "min_step_ms", id="min-negative"),
        pytest.param({"min_step_ms": 16.0}, "min_step_ms", id="min-float"),
        pytest.param({"min_step_ms": True}, "min_step_ms", id="min-bool"),
        pytest.param({"max_step_ms": 3 * 2**30}, "max_step_ms", id="max-not-power-of-two"),
        pytest.param({"max_step_ms": "4096"}, "max_step_ms", id="max-str"),
        pytest.param({"max_step_ms": True}, "max_step_ms", id="max-bool"),
        pytest.param({"min_step_ms": 1024, "max_step_ms": 16}, "min_step_ms", id="min-above-max"),
        pytest.param({"max_step_ms": 2**39}, "max_step_ms", id="above-broker-ttl-cap"),
        pytest.param({"hold_window_ms": -1}, "hold_window_ms", id="hold-window-negative"),
        pytest.param({"hold_window_ms": 1.5}, "hold_window_ms", id="hold-window-float"),
        pytest.param({"hold_window_ms": False}, "hold_window_ms", id="hold-window-bool"),
        pytest.param({"hop_margin_ms": -1}, "hop_margin_ms", id="margin-negative"),
        pytest.param({"hop_margin_ms": True}, "hop_margin_ms", id="margin-bool"),
    ],
)
def test_invalid_ladder_is_rejected_naming_the_field(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidSettingsError, match=named) as caught:
        Ladder(**kwargs)  # type: ignore[arg-type]

    assert isinstance(caught.value, ValueError)


def test_min_above_max_names_both_fields() -> None:
    with pytest.raises(InvalidSettingsError) as caught:
        Ladder(min_step_ms=1024, max_step_ms=16)

    assert "min_step_ms=1024" in str(caught.value)
    assert "max_step_ms=16" in str(caught.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"hold_window_ms": 60_001}, id="hold-window"),
        pytest.param({"min_step_ms": 2**16, "max_step_ms": 2**20}, id="min-step-plus-margin"),
    ],
)
def test_a_hold_longer_than_a_minute_is_rejected(kwargs: dict[str, int]) -> None:
    """An unacked hold near RabbitMQ's consumer_timeout would close the relay's channel."""
    with pytest.raises(InvalidSettingsError, match="consumer_timeout"):
        Ladder(**kwargs)


def test_a_top_step_over_2_pow_32_is_refused_naming_the_cap() -> None:
    with pytest.raises(InvalidSettingsError, match=str(2**32)):
        Ladder(max_step_ms=2**33)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"min_step_ms": 1, "max_step_ms": 1}, id="single-1ms-step"),
        pytest.param({"max_step_ms": 2**32}, id="largest-top-step"),
        pytest.param({"hold_window_ms": 0, "hop_margin_ms": 0}, id="zero-windows"),
    ],
)
def test_valid_edge_ladders_are_accepted(kwargs: dict[str, int]) -> None:
    ladder = Ladder(**kwargs)

    assert ladder.steps[0] == ladder.min_step_ms
    assert ladder.steps[-1] == ladder.max_step_ms


# --- routing around steps (a step queue electing a leader nacks) -------------------------


@st.composite
def avoided_steps(draw: st.DrawFn, ladder: Ladder) -> frozenset[int]:
    """Some of the ladder's steps, the top one and runs of neighbours included."""
    return frozenset(draw(st.sets(st.sampled_from(ladder.steps), max_size=6)))


@given(
    ladder=ladders(),
    now_us=st.integers(0, 2**60),
    remaining_us=st.integers(-(2**40), 2**45),
    data=st.data(),
)
def test_a_plan_around_avoided_steps_takes_the_largest_other_step_never_a_larger_one(
    ladder: Ladder, now_us: int, remaining_us: int, data: st.DataObject
) -> None:
    avoid = data.draw(avoided_steps(ladder))

    planned = ladder.plan(now_us=now_us, due_us=now_us + remaining_us)
    around = ladder.plan(now_us=now_us, due_us=now_us + remaining_us, avoid=avoid)

    if isinstance(planned, Hold):
        assert around == planned  # holds and deliveries are never moved
        return
    assert isinstance(around, Hop)
    assert around.step_ms in ladder.steps
    assert around.step_ms <= planned.step_ms  # ends no later: never early
    shorter = [step for step in ladder.steps if step <= planned.step_ms and step not in avoid]
    if shorter:
        assert around.step_ms == max(shorter)
    else:  # nothing shorter to go by: the planned step, tried again
        assert around == planned


@hypothesis_settings(deadline=None)  # ratio 4 around avoided steps: thousands of hops
@given(case=ladder_and_delay(min_margin_ms=1), start_us=st.integers(0, 2**60), data=st.data())
def test_following_a_plan_around_avoided_steps_is_never_early_and_bounded(
    case: tuple[Ladder, int], start_us: int, data: st.DataObject
) -> None:
    ladder, delay_us = case
    avoid = data.draw(avoided_steps(ladder))
    assume(ladder.max_hops(max(0, delay_us), avoid) <= 20_000)  # a simulation to run here
    margin_us = ladder.hop_margin_ms * US_PER_MS
    due_us = start_us + delay_us

    run = follow_plan(
        ladder,
        due_us,
        lambda: data.draw(st.integers(0, margin_us - 1)),
        start_us=start_us,
        avoid=avoid,
    )

    for published_us, step_ms in run.hops:
        assert step_ms * US_PER_MS <= due_us - published_us - margin_us
    assert len(run.hops) <= ladder.max_hops(max(0, delay_us), avoid)
    assert run.hold.wait_us == max(0, due_us - run.arrival_us)
    assert run.delivered_us >= due_us


@given(case=ladder_and_delay(), overshoot_us=st.integers(0, 60 * SECOND), data=st.data())
def test_a_route_around_avoided_steps_terminates_for_any_constant_overshoot(
    case: tuple[Ladder, int], overshoot_us: int, data: st.DataObject
) -> None:
    ladder, delay_us = case
    avoid = data.draw(avoided_steps(ladder))
    assume(ladder.max_hops(max(0, delay_us), avoid) <= 20_000)

    steps = ladder.route(delay_us, overshoot_us, avoid)

    assert len(steps) <= ladder.max_hops(max(0, delay_us), avoid)
    assert sum(steps) * US_PER_MS <= max(0, delay_us)


@given(case=ladder_and_delay())
def test_max_hops_without_avoided_steps_is_the_plain_bound(case: tuple[Ladder, int]) -> None:
    ladder, delay_us = case
    delay_us = max(0, delay_us)
    top_laps = -(-delay_us // (ladder.max_step_ms * US_PER_MS))

    below_top = (ladder.step_ratio - 1) * (len(ladder.steps) - 1)
    assert ladder.max_hops(delay_us) == top_laps + below_top
    assert ladder.max_hops(delay_us, frozenset()) == ladder.max_hops(delay_us)


def test_a_route_around_one_step_takes_the_next_smaller_one_twice() -> None:
    ladder = Ladder(min_step_ms=16, max_step_ms=2**20, hold_window_ms=4000, hop_margin_ms=20)
    plain = [524_288, 65_536, 4096, 2048, 1024]

    assert ladder.route(600 * SECOND) == plain
    assert ladder.route(600 * SECOND, avoid={524_288}) == [262_144, 262_144, *plain[1:]]
    assert ladder.route(600 * SECOND, avoid={16, 1024}) == [*plain[:-1], 512]


@given(
    nacks=st.lists(st.tuples(st.sampled_from([16, 1024, 524_288]), st.integers(0, 60 * SECOND))),
    later_us=st.integers(0, 120 * SECOND),
    for_us=st.integers(1, 30 * SECOND),
)
def test_a_nacked_step_is_avoided_for_a_while_after_its_last_nack(
    nacks: list[tuple[int, int]], later_us: int, for_us: int
) -> None:
    memory = AvoidedSteps(for_us)
    nacks.sort(key=lambda nack: nack[1])  # the clock goes forward
    for step_ms, at_us in nacks:
        memory.nacked(step_ms, at_us)
    now_us = (nacks[-1][1] if nacks else 0) + later_us

    last = {step_ms: at_us for step_ms, at_us in nacks}
    assert memory.avoided(now_us) == {s for s, at_us in last.items() if now_us < at_us + for_us}


# --- fewer steps: step_ratio 4 and a coarse min_step_ms (issue 23, item 4) --------------

RATIO_4 = Ladder(step_ratio=4)
COARSE = Ladder(min_step_ms=1024)


def test_the_ratio_4_and_coarse_ladders_have_fewer_steps_of_the_same_range() -> None:
    assert len(DEFAULT.steps) == 29
    assert RATIO_4.steps == tuple(4**k for k in range(2, 17))  # 16 ms .. 2**32 ms, 15 steps
    assert COARSE.steps == tuple(2**k for k in range(10, 33))  # 1024 ms .. 2**32 ms, 23
    assert set(RATIO_4.steps) < set(DEFAULT.steps)
    assert set(COARSE.steps) < set(DEFAULT.steps)
    assert RATIO_4.description == "step_ratio=4, min_step_ms=16, max_step_ms=2**32 (15 steps)"


@given(ladder=ladders(min_margin_ms=1, ratios=(4,)), data=st.data())
def test_a_ratio_4_ladder_uses_each_step_below_the_top_at_most_three_times(
    ladder: Ladder, data: st.DataObject
) -> None:
    """Below the top a hop takes at least a quarter of what remains, so a step is taken at
    most ``ratio - 1`` times, in a row, and the steps never grow."""
    delay_us = data.draw(st.integers(1, 3 * ladder.max_step_ms * US_PER_MS))
    run = follow_plan(
        ladder, delay_us, lambda: data.draw(st.integers(0, ladder.hop_margin_ms * US_PER_MS - 1))
    )

    below_top = [step for step in run.steps if step != ladder.max_step_ms]
    assert all(below_top.count(step) <= 3 for step in below_top), run.steps
    assert run.steps == sorted(run.steps, reverse=True), run.steps
    assert all(step in ladder.steps for step in run.steps)
    assert len(run.hops) <= ladder.max_hops(delay_us)
    assert run.delivered_us >= delay_us


@given(
    ratio=st.sampled_from(STEP_RATIOS),
    delay_us=st.integers(0, 2**45),
    overshoot_us=st.integers(0, 19_999),
)
def test_fewer_steps_cost_hops_never_earliness(
    ratio: int, delay_us: int, overshoot_us: int
) -> None:
    """The lighter ladders (ratio 4; a 1024 ms smallest step) take at least the default's
    hops, at most ``3 x`` its steps, and deliver as the default does: held to the due
    time, never before it."""
    lighter = Ladder(step_ratio=ratio, min_step_ms=16 if ratio == 4 else 1024)

    default_route = DEFAULT.route(delay_us, overshoot_us)
    lighter_route = lighter.route(delay_us, overshoot_us)

    assert len(lighter_route) <= lighter.max_hops(delay_us)
    assert len(lighter_route) <= 3 * max(1, len(default_route)) + 1
    arrival_us = sum(step * US_PER_MS + overshoot_us for step in lighter_route)
    assert arrival_us <= delay_us or lighter_route == []


@given(ladder=ladders(), data=st.data())
def test_after_refusal_and_detours_stay_on_the_ladder(ladder: Ladder, data: st.DataObject) -> None:
    ms = data.draw(st.integers(0, 2**33))
    step = ladder.step_at_most(ms)
    assert step in ladder.steps
    assert step <= max(ms, ladder.min_step_ms)
    assert step == ladder.max_step_ms or step * ladder.step_ratio > ms
    avoid = frozenset(data.draw(st.sets(st.sampled_from(ladder.steps))))
    assert ladder.detour(step, avoid) in ladder.steps


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        pytest.param({"step_ratio": 3}, ["step_ratio=3", "2", "4"], id="ratio-3"),
        pytest.param({"step_ratio": True}, ["step_ratio=True"], id="ratio-bool"),
        pytest.param({"step_ratio": 4, "min_step_ms": 32}, ["min_step_ms=32", "16 or 64"],
                     id="ratio-4-min-not-power-of-4"),
        pytest.param({"step_ratio": 4, "max_step_ms": 2**31}, ["max_step_ms=2147483648",
                     "powers of four", "step_ratio=2"], id="ratio-4-top-not-a-step"),
    ],
)  # fmt: skip
def test_a_ladder_of_another_ratio_is_refused_naming_the_option_and_the_fix(
    fields: dict[str, int], words: list[str]
) -> None:
    with pytest.raises(InvalidSettingsError) as refused:
        Ladder(**fields)
    for word in words:
        assert word in str(refused.value)


@given(ladder=ladders())
def test_the_steps_on_the_broker_tell_their_ladder(ladder: Ladder) -> None:
    found = ladder_of(ladder.steps)
    assert found is not None
    assert found.steps == ladder.steps
    assert ladder.description.startswith(f"step_ratio={ladder.step_ratio}, ")
    assert ladder_of([16, 32, 128]) is None
    assert "no ladder" in describe_steps([16, 32, 128])


@pytest.mark.parametrize(
    ("mine", "broker", "refused"),
    [
        pytest.param(DEFAULT, RATIO_4, True, id="default-on-a-ratio-4-prefix"),
        pytest.param(DEFAULT, COARSE, True, id="default-on-a-coarse-prefix"),
        pytest.param(COARSE, RATIO_4, True, id="coarse-on-a-ratio-4-prefix"),
        pytest.param(RATIO_4, DEFAULT, False, id="ratio-4-on-a-default-prefix: a subset"),
        pytest.param(COARSE, DEFAULT, False, id="coarse-on-a-default-prefix: a subset"),
        pytest.param(DEFAULT, Ladder(max_step_ms=2**31), False, id="one-step-missing (F27)"),
        pytest.param(RATIO_4, RATIO_4, False, id="same"),
    ],
)
def test_a_ladder_missing_steps_on_the_broker_is_refused_naming_both(
    mine: Ladder, broker: Ladder, refused: bool
) -> None:
    error = ladder_mismatch("p", mine, broker.steps)
    assert ladder_mismatch("p", mine, ()) is None  # no step at all: nothing to conflict with
    holes = set(mine.steps) - {mine.steps[2], mine.steps[-3]}  # two queues deleted
    assert ladder_mismatch("p", mine, holes) is None  # declared again (F27), not refused

    assert (error is not None) == refused
    if error is not None:
        text = str(error)
        assert mine.description in text
        assert broker.description in text
        assert "HOPSCHED_STEP_RATIO" in text
        assert "hopsched teardown --prefix p" in text
        assert error.queue == f"p.step.{min(set(mine.steps) - set(broker.steps))}"
