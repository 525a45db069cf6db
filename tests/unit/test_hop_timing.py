"""HopTiming's reading of the broker's clock from x-death times (F41; no broker)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import pytest

from hopsched.core.envelope import HEADER_HOP_CLOCK, HEADER_HOP_EXPIRES, RELAY_CLOCK
from hopsched.core.overshoot import OvershootTracker
from hopsched.relay.broker_clock import BrokerClock
from hopsched.relay.hop_timing import HopTiming
from hopsched.relay.stats import RelayStats

S = 1_000_000
T0 = 1_800_000_000 * S


def _hop(died_us: int, expires_us: int, clock: str = RELAY_CLOCK) -> dict[str, Any]:
    died = datetime.fromtimestamp(died_us // S, UTC)
    return {
        "x-death": [{"time": died, "reason": "expired", "queue": "p.step.16", "count": 1}],
        HEADER_HOP_EXPIRES: expires_us,
        HEADER_HOP_CLOCK: clock,
    }


def _timing(raw: list[int]) -> HopTiming:
    return HopTiming(RelayStats(), OvershootTracker(), 5 * S, BrokerClock(lambda: raw[0]))


def test_a_relay_ahead_is_corrected_and_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = [T0 + 30 * S + 5_000]  # 30 s ahead; the hop died at T0 (a whole second)
    timing = _timing(raw)
    with caplog.at_level(logging.WARNING, "hopsched.relay"):
        timing.observe_broker(_hop(T0, T0 + 30 * S))
        timing.observe_broker(_hop(T0, T0 + 30 * S))
    assert timing.broker_clock.correction_us == 30 * S + 5_000
    assert timing.broker_clock() == T0  # never ahead of the broker
    assert timing.stats.relay_clock_offset_us == 30 * S + 5_000
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "+30.0 s off the broker's" in errors[0].getMessage()
    assert "run NTP" in errors[0].getMessage()
    timing.new_interval()
    timing.observe_broker(_hop(T0, T0 + 30 * S))
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2


def test_a_relay_behind_is_warned_about_and_producers_are_not_blamed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = [T0 - 30 * S + 500_000]  # 30 s behind; the hop died at T0 + 0.5 s
    timing = _timing(raw)
    producer_hop = _hop(T0, T0, clock="host/1")  # the producer's stamp: true time
    with caplog.at_level(logging.WARNING, "hopsched.relay"):
        timing.observe_broker(producer_hop)
        timing.measure(producer_hop, timing.broker_clock())
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "the relay's clock is -29.5 s off the broker's" in messages[0]
    assert timing.broker_clock.correction_us == 0


def test_a_hop_the_relay_stamped_that_waited_in_the_relay_queue_is_no_sample() -> None:
    raw = [T0 + 600 * S]  # a healthy clock, ten minutes after the hop's TTL ended
    timing = _timing(raw)
    timing.observe_broker(_hop(T0, T0))
    assert timing.broker_clock.offset_us is None
    assert timing.broker_clock.correction_us == 0
    raw[0] = T0 + 1_000  # a prompt one counts
    timing.observe_broker(_hop(T0, T0))
    assert timing.broker_clock.offset_us == 1_000


def test_a_producers_hop_is_no_sample_once_the_relay_has_its_own_or_when_crowded() -> None:
    raw = [T0 + 3 * S]  # a healthy clock; the producer's hop waited 3 s in the relay queue
    timing = _timing(raw)
    timing.observe_broker(_hop(T0, T0, clock="host/1"), crowded=True)
    timing.observe_broker(_hop(T0, T0, clock="host/1"), backlog=True)
    assert timing.broker_clock.offset_us is None
    raw[0] = T0 + 10 * S + 2_000  # the relay's own hop, prompt
    timing.observe_broker(_hop(T0 + 10 * S, T0 + 10 * S))
    assert timing.broker_clock.offset_us == 2_000
    raw[0] = T0 + 23 * S  # a producer's, 3 s after its x-death: waited, or a clock?
    timing.observe_broker(_hop(T0 + 20 * S, T0 + 20 * S, clock="host/1"))
    assert timing.broker_clock.offset_us == 2_000
    assert timing.broker_clock.correction_us == 0
