"""The wall-clock timer the relay holds messages with: never before its instant, and
close after it, for no CPU while it waits."""

from __future__ import annotations

import asyncio
import resource
import statistics

import pytest

from hopsched.core.clock import now_us
from hopsched.relay.holds import Holds
from hopsched.relay.timer import WallTimer

pytestmark = pytest.mark.skipif(WallTimer is None, reason="no timerfd on this platform")


async def test_the_timer_fires_never_before_its_instant() -> None:
    assert WallTimer is not None
    fired: asyncio.Queue[int] = asyncio.Queue()
    timer = WallTimer(lambda: fired.put_nowait(now_us()))
    lateness = []
    try:
        for index in range(100):
            at = now_us() + 2_000 + index * 13
            timer.arm(at)
            lateness.append(await asyncio.wait_for(fired.get(), 5) - at)
    finally:
        timer.close()
    print(f"\ntimerfd lateness µs: p50 {statistics.median(lateness):.0f} max {max(lateness)}")
    assert min(lateness) >= 0


async def test_rearming_replaces_the_instant_and_disarming_stops_it() -> None:
    assert WallTimer is not None
    fired: list[int] = []
    timer = WallTimer(lambda: fired.append(now_us()))
    try:
        timer.arm(now_us() + 50_000)
        first = now_us() + 5_000
        timer.arm(first)
        await asyncio.sleep(0.02)
        assert len(fired) == 1
        assert fired[0] >= first
        timer.arm(now_us() + 5_000)
        timer.disarm()
        await asyncio.sleep(0.02)
        assert len(fired) == 1
    finally:
        timer.close()


async def test_holds_release_in_due_order_never_early_and_idle_costs_no_cpu() -> None:
    released: list[tuple[int, int]] = []
    holds = Holds(now_us, lambda item: released.append((now_us(), item)))
    start = now_us()
    dues = [start + 30_000 + (index * 7919) % 50_000 for index in range(300)]
    for due in dues:
        holds.hold(due, due)
    before = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.sleep(0.2)
    after = resource.getrusage(resource.RUSAGE_SELF)
    holds.cancel()

    assert [item for _, item in released] == sorted(dues)
    assert all(at >= due for at, due in released)
    busy_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert busy_s < 0.1, f"{busy_s:.3f} s of CPU in 0.2 s of waiting: spinning?"
