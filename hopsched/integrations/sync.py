"""``SyncScheduler``: hopsched's async ``Scheduler`` for synchronous code (task
producers, workers), on a background event-loop thread."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any, TypeVar

import aio_pika

from hopsched.client.scheduler import Cancelled, Scheduler
from hopsched.client.sending import Scheduled
from hopsched.errors import HopschedError, InvalidSettingsError
from hopsched.journal.records import ScheduleInfo
from hopsched.settings import Settings

__all__ = ["SyncScheduler", "fall_back_or_raise"]

log = logging.getLogger("hopsched.integrations")


#: An integration logs its fallbacks at most once per this many seconds, with a count.
FALLBACK_NOTE_EVERY_S = 60.0


class _Notes:
    """When an integration last logged a fallback, and how many it has not logged since."""

    __slots__ = ("last", "since")

    def __init__(self) -> None:
        self.last = -math.inf
        self.since = 0


#: Per integration object (its broker or scheduler): a new one logs its first at once.
_NOTES: weakref.WeakKeyDictionary[object, _Notes] = weakref.WeakKeyDictionary()


def fall_back_or_raise(
    error: HopschedError, *, enabled: bool, what: str, instead: str, notes: object = None
) -> None:
    """A framework integration's delay that hopsched did not take: return (after a
    WARNING) if the framework's own delay should take it, else raise ``error``.

    Args:
        error: what hopsched raised.
        enabled: the integration's ``fallback`` setting.
        what: the message, for the log (``task ID``).
        instead: where it goes instead, for the log.
        notes: the integration object whose fallbacks are logged together: its first at
            once, then at most one per ``FALLBACK_NOTE_EVERY_S`` saying how many went
            unlogged since (a broker outage would log one per message). None: each.

    Raises:
        error: ``enabled`` is False, or the error is the caller's (a ``ValueError``:
            ``InvalidScheduleError``, ...), which falling back would only hide.
    """
    if not enabled or isinstance(error, ValueError):
        raise error
    more = ""
    if notes is not None:
        kept = _NOTES.setdefault(notes, _Notes())
        now = time.monotonic()
        if now - kept.last < FALLBACK_NOTE_EVERY_S:
            kept.since += 1
            log.debug("hopsched did not take %s (%s): %s", what, error, instead)
            return
        if kept.since:
            more = f"; {kept.since} more since the last such WARNING"
        kept.last, kept.since = now, 0
    log.warning(
        "hopsched did not take %s (%s): %s, as without hopsched (a timed-out one may "
        "also be delivered by hopsched: at least once)%s",
        what,
        error,
        instead,
        more,
    )


T = TypeVar("T")

#: Every SyncScheduler of this process, to forget their threads in a forked child.
_INSTANCES: weakref.WeakSet[SyncScheduler] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for instance in list(_INSTANCES):
        instance._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SyncScheduler:
    """A ``Scheduler`` whose calls block: one event-loop thread per process owns one
    ``Scheduler`` (one connection), started on first use.

    Safe to call from any number of threads at once. Safe across ``fork()`` (Celery's
    prefork pool): a child starts its own thread and connection on its first call and
    never touches its parent's. Each call returns once the broker confirmed (as the
    async call it wraps); its errors are the async call's.

    Args:
        settings: the broker, prefix and ladder (a relay, or ``hopsched declare``, must
            have declared the prefix, unless ``declare``).
        declare: declare the prefix's topology if it does not exist.
    """

    def __init__(self, settings: Settings, *, declare: bool = False) -> None:
        self.settings = settings
        self.declare = declare
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._scheduler: Scheduler | None = None
        _INSTANCES.add(self)

    def _forget(self) -> None:
        """In a forked child: the parent's thread did not survive the fork, and its
        connection is the parent's; the next call starts afresh."""
        self._lock = threading.Lock()
        self._loop = self._thread = self._scheduler = None

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="hopsched-sync", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _call(self, work: Callable[[Scheduler], Coroutine[Any, Any, T]]) -> T:
        loop = self._started()
        if threading.current_thread() is self._thread:
            raise InvalidSettingsError(
                "SyncScheduler called from its own event-loop thread, where it would wait "
                "for ever; in async code use hopsched.Scheduler directly"
            )

        async def connected() -> T:
            if self._scheduler is None:
                self._scheduler = Scheduler(self.settings, declare=self.declare)
            await self._scheduler.__aenter__()  # connects if not connected: else at once
            return await work(self._scheduler)

        return asyncio.run_coroutine_threadsafe(connected(), loop).result()

    def schedule(self, message: aio_pika.abc.AbstractMessage | bytes, **options: Any) -> Scheduled:
        """``Scheduler.schedule(message, **options)``, blocking until confirmed.

        Raises:
            As ``Scheduler.schedule``.
        """
        return self._call(lambda scheduler: scheduler.schedule(message, **options))

    def cancel(self, schedule_id: str, *, due: datetime | None = None) -> Cancelled:
        """``Scheduler.cancel(schedule_id, due=due)``, blocking until confirmed.

        Raises:
            As ``Scheduler.cancel``.
        """
        return self._call(lambda scheduler: scheduler.cancel(schedule_id, due=due))

    def get(self, schedule_id: str) -> ScheduleInfo | None:
        """``Scheduler.get(schedule_id)``: what the journal knows of it, None if nothing.

        Raises:
            As ``Scheduler.get``.
        """
        return self._call(lambda scheduler: scheduler.get(schedule_id))

    def close(self) -> None:
        """Close the connection and end the thread; a later call starts them again."""
        with self._lock:
            loop, thread, scheduler = self._loop, self._thread, self._scheduler
            self._loop = self._thread = self._scheduler = None
        if loop is None or thread is None:
            return
        if scheduler is not None:
            asyncio.run_coroutine_threadsafe(scheduler.close(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
