"""Messages held in-process until their due time, released never early, in batches.

One timer serves every held message: it is armed for the earliest due time and, when
it fires, releases everything due by then in one go (a burst due at one instant is
one batch). The timer is a ``timerfd`` on the wall clock where Linux has one
(``hopsched.relay.timer``): it wakes the loop within ~50 µs of the due time for no CPU.
Elsewhere asyncio's timers, which wake up to a millisecond late, are armed ``SPIN_US``
early and the rest is waited by yielding to the event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any

from hopsched.relay.timer import WallTimer

__all__ = ["SPIN_US", "Holds"]

#: The last stretch before a due time waited by yielding to the loop, µs.
SPIN_US = 1_000
#: Most messages released per loop iteration: a large burst is released in slices so
#: the connection writes and reads between them.
_BATCH = 100


class Holds:
    """A due-time queue: ``hold(due_us, item)``; ``release(item)`` runs for each, in due
    order, once ``clock()`` (µs since the epoch) reads its due time or later.

    Args:
        clock: the wall clock, integer µs since the epoch.
        release: called with each item once due.
        wall_timer: use the ``timerfd`` timer where there is one (it reads the real
            wall clock: a test's fake ``clock`` needs asyncio's timers).
        wall_lag: how far ``clock`` is behind the wall clock now, µs (the relay's
            correction for a clock ahead of the broker's, ``hopsched.relay.broker_clock``): the
            ``timerfd`` timer is armed that much later.
    """

    def __init__(
        self,
        clock: Callable[[], int],
        release: Callable[[Any], None],
        *,
        wall_timer: bool = True,
        wall_lag: Callable[[], int] = lambda: 0,
    ) -> None:
        self._clock = clock
        self._wall_lag = wall_lag
        self._release = release
        self._loop = asyncio.get_running_loop()
        self._heap: list[tuple[int, int, Any]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._wall = WallTimer(self._fire) if wall_timer and WallTimer is not None else None
        self._armed_for: int | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, due_us: int, item: Any) -> None:
        heapq.heappush(self._heap, (due_us, next(self._order), item))
        if self._armed_for is None or due_us < self._armed_for:
            self._arm(due_us)

    def _arm(self, due_us: int) -> None:
        self._armed_for = due_us
        if self._wall is not None:  # an instant already past fires at the next poll
            self._wall.arm(due_us + self._wall_lag())
            return
        if self._timer is not None:
            self._timer.cancel()
        wait_us = due_us - SPIN_US - self._clock()
        if wait_us > 0:
            self._timer = self._loop.call_later(wait_us / 1_000_000, self._fire)
        else:
            self._timer = self._loop.call_soon(self._fire)

    def rearm(self) -> None:
        """Arm the timer again for the earliest item: ``wall_lag`` changed."""
        if self._heap:
            self._arm(self._heap[0][0])

    def _fire(self) -> None:
        self._timer = None
        self._armed_for = None
        heap = self._heap
        now = self._clock()
        released = 0
        while heap and heap[0][0] <= now and released < _BATCH:
            item = heapq.heappop(heap)[2]
            released += 1
            self._release(item)
        if heap:
            self._arm(heap[0][0])

    def cancel(self) -> list[Any]:
        """Stop the timer for good and return what was still held."""
        if self._timer is not None:
            self._timer.cancel()
        if self._wall is not None:
            self._wall.close()
            self._wall = None
        self._timer, self._armed_for = None, None
        items = [entry[2] for entry in sorted(self._heap)]
        self._heap.clear()
        return items
