"""A one-shot wall-clock timer with microsecond precision for the event loop (Linux).

asyncio's timers wake up to a millisecond late: the loop's ``epoll_wait`` takes its
timeout in whole milliseconds, rounded up (CPython's ``select.epoll.poll``). Waiting
out that last millisecond by yielding to the loop costs CPU the broker needs: measured
with ``benchmarks/accuracy.py`` at 500 messages/s held by the relay, the spinning took
the relay to 770 µs of CPU per message. A Linux ``timerfd`` armed for an absolute
``CLOCK_REALTIME`` instant wakes the loop within the kernel's timer slack (50 µs by
default) and costs one read when it fires; it follows the wall clock, as due times do,
so it never fires before the instant by that clock.

Python 3.13 has ``os.timerfd_create``; before it the same calls go through ctypes.
Where neither works (not Linux), ``WallTimer`` is None and callers fall back to
asyncio's timers.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Callable

__all__ = ["WallTimer"]

_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


def _libc_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    """``(create, arm)`` through libc, or None where there is no timerfd."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create_fd, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None

    def create() -> int:
        fd: int = create_fd(time.CLOCK_REALTIME, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        return fd

    def arm(fd: int, at_ns: int) -> None:
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(*divmod(at_ns, 1_000_000_000)))
        if settime(fd, _TFD_TIMER_ABSTIME if at_ns else 0, ctypes.byref(spec), None) < 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    return create, arm


def _os_timerfd() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    """``(create, arm)`` through ``os`` (Python >= 3.13), or None."""
    create_fd = getattr(os, "timerfd_create", None)
    settime = getattr(os, "timerfd_settime_ns", None)
    if create_fd is None or settime is None:
        return None

    def create() -> int:
        fd: int = create_fd(time.CLOCK_REALTIME, flags=_TFD_NONBLOCK | _TFD_CLOEXEC)
        return fd

    def arm(fd: int, at_ns: int) -> None:
        settime(fd, flags=_TFD_TIMER_ABSTIME if at_ns else 0, initial=at_ns)

    return create, arm


_TIMERFD = _os_timerfd() or _libc_timerfd()


class _WallTimer:
    """Calls ``callback()`` once the wall clock reads the instant it is armed for.

    ``arm(at_us)`` (µs since the epoch, UTC) replaces any earlier instant; ``disarm()``
    stops it; ``close()`` releases it. An instant already past fires at once.
    """

    def __init__(self, callback: Callable[[], None]) -> None:
        assert _TIMERFD is not None
        self._create, self._arm = _TIMERFD
        self._loop = asyncio.get_running_loop()
        self._callback = callback
        self._fd = self._create()
        self._loop.add_reader(self._fd, self._fired)

    def arm(self, at_us: int) -> None:
        self._arm(self._fd, max(at_us, 1) * 1000)  # 0 would disarm

    def disarm(self) -> None:
        self._arm(self._fd, 0)

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)  # the count of expirations: one, or none if disarmed since
        except BlockingIOError:
            return
        self._callback()

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        os.close(self._fd)


def _usable() -> bool:
    if _TIMERFD is None:
        return False
    try:
        os.close(_TIMERFD[0]())
    except OSError:
        return False
    return True


#: The timer class, or None where the platform has no timerfd.
WallTimer: type[_WallTimer] | None = _WallTimer if _usable() else None
