"""When a lane's silence watch looks again (``hopsched.amqp.publisher``): a step's
silence is told at its deadline, not a second after it (asyncio may run the watch's
timer a hair early), and never by a watch that spins."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hopsched.amqp.publisher import (
    SILENCE_RECHECK_S,
    SILENCE_RESOLUTION_S,
    silence_look_after,
)

until_deadline = st.floats(min_value=-3600, max_value=3600, allow_nan=False)


@given(until_deadline)
def test_a_deadline_to_come_is_looked_at_then_and_a_past_one_now(until_s: float) -> None:
    later = silence_look_after(until_s, waiting=False)
    if until_s <= 0:
        assert later is None  # ping now
    else:
        assert later is not None
        assert later >= SILENCE_RESOLUTION_S  # no spinning
        assert later == max(until_s, SILENCE_RESOLUTION_S)  # not a second late


@given(until_deadline)
def test_while_a_ping_is_unanswered_or_the_connection_blocked_it_waits(until_s: float) -> None:
    later = silence_look_after(until_s, waiting=True)
    assert later is not None
    assert later >= SILENCE_RECHECK_S
    assert later >= until_s  # never before the deadline


def test_woken_a_hair_early_it_looks_again_at_the_deadline() -> None:
    assert silence_look_after(0.0004, waiting=False) == SILENCE_RESOLUTION_S
    assert silence_look_after(0.25, waiting=False) == 0.25
