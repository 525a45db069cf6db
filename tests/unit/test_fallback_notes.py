"""A framework integration's fallbacks are logged as WARNINGs: the first at once, then at
most one per interval per integration, counting those in between (a broker outage would
otherwise log one per message)."""

from __future__ import annotations

import logging

import pytest

import hopsched
from hopsched.integrations import sync


class Broker:
    """Stands for an integration object (a Celery app's scheduler, a Dramatiq broker)."""


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def fall_back(broker: object, task: str) -> None:
    sync.fall_back_or_raise(
        hopsched.BrokerUnavailableError("down"),
        enabled=True,
        what=f"task {task}",
        instead="sent with its eta",
        notes=broker,
    )


def test_fallbacks_are_noted_once_per_interval_with_the_count_between(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="hopsched.integrations")
    broker, other = Broker(), Broker()
    for task in ("t1", "t2", "t3"):
        fall_back(broker, task)
    fall_back(other, "o1")  # another integration: its own first note
    assert [line.split(" (")[0] for line in warnings(caplog)] == [
        "hopsched did not take task t1",
        "hopsched did not take task o1",
    ]
    sync._NOTES[broker].last -= sync.FALLBACK_NOTE_EVERY_S  # the interval passed
    fall_back(broker, "t4")
    assert warnings(caplog)[-1].startswith("hopsched did not take task t4")
    assert warnings(caplog)[-1].endswith("; 2 more since the last such WARNING")


def test_a_caller_s_error_or_no_fallback_raises() -> None:
    with pytest.raises(hopsched.InvalidScheduleError):
        sync.fall_back_or_raise(
            hopsched.InvalidScheduleError("bad"), enabled=True, what="x", instead="y"
        )
    with pytest.raises(hopsched.BrokerUnavailableError):
        sync.fall_back_or_raise(
            hopsched.BrokerUnavailableError("down"), enabled=False, what="x", instead="y"
        )
