"""When a retried failure is logged (``hopsched.connect.RetryLog``): each of the first
few, then once per interval for as long as it lasts; never silent for longer than that,
and all of it said again after a success."""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from hopsched.connect import RetryLog

gaps = st.lists(st.floats(min_value=0.0, max_value=30.0, allow_nan=False), max_size=200)


def said_times(log: RetryLog, now: list[float], gaps_s: list[float]) -> list[tuple[float, str]]:
    said = []
    for gap in gaps_s:
        now[0] += gap
        say, more = log.say()
        if say:
            said.append((now[0], more))
    return said


@given(gaps, st.integers(min_value=1, max_value=10), st.floats(min_value=1.0, max_value=120.0))
@example([5.0, 30.0, 30.0, 1.4354070663559417], 1, 1.4354070663559417)  # float rounding
def test_the_first_are_said_then_one_per_interval_and_never_longer_silent(
    gaps_s: list[float], first: int, interval_s: float
) -> None:
    now = [0.0]
    log = RetryLog(interval_s, first=first, clock=lambda: now[0])
    times = list(itertools.accumulate(gaps_s))  # as now[0] += gap adds them
    said = said_times(log, now, gaps_s)
    said_at = [at for at, _ in said]
    assert said_at[:first] == times[:first]  # each of the first
    later = said_at[first - 1 :]
    assert all(b - a >= interval_s for a, b in itertools.pairwise(later))
    for at in times[first:]:  # every failure has one said within the interval before it
        # (1e-9: at - interval < s and at - s < interval may round differently)
        assert any(at - interval_s - 1e-9 < s <= at for s in said_at), (at, said_at)
    notes = [more for _, more in said if more]
    assert notes == (
        [f" (from now on said once every {interval_s:g} s)"] if len(times) >= first else []
    )


def test_a_success_starts_it_over() -> None:
    now = [0.0]
    log = RetryLog(60.0, first=2, clock=lambda: now[0])
    assert [log.say()[0] for _ in range(4)] == [True, True, False, False]
    log.reset()
    assert (log.failures, log.say()[0], log.say()[0], log.say()[0]) == (0, True, True, False)
