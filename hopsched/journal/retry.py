"""A Scheduler's journal records whose write failed, written again in the background:
the I/O around ``backlog.Backlog`` (which records, how long to wait), for one stream.

The writing itself is the Scheduler's (``write``: its journal connection, opened if
need be); this keeps the records, tries them again, counts and logs. Its log lines go
to ``hopsched.scheduler``: they tell of a Scheduler's schedules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from hopsched.journal.backlog import (
    FIRST_WAIT_S,
    LAST_WAIT_S,
    MAX_BACKLOG_BYTES,
    MAX_BACKLOG_RECORDS,
    Backlog,
    next_wait,
)
from hopsched.journal.records import JournalRecord
from hopsched.journal.stream import RECORDS_PER_MESSAGE

__all__ = ["JournalRetry", "Write"]

log = logging.getLogger("hopsched.scheduler")

#: ``write(records, timeout_s)``: the records not written and why ("" if all were).
#: Never raises.
Write = Callable[[Sequence[JournalRecord], float], Awaitable[tuple[list[JournalRecord], str]]]


class JournalRetry:
    """The records of a Scheduler's failed journal writes, kept (``Backlog``) and
    written again in the background: first after ``FIRST_WAIT_S``, then after each
    failed try twice as long, up to ``LAST_WAIT_S``; a write the journal takes
    meanwhile (``written``) cuts the wait short.

    Args:
        write: writes records to the journal (``Write``).
        stream: ``{prefix}.journal``, for the log lines.
        timeout_s: how long a write of the background's waits for its answer.
    """

    def __init__(self, write: Write, stream: str, timeout_s: float) -> None:
        self._write = write
        self.stream = stream
        self.timeout_s = timeout_s
        self._backlog = Backlog()
        self._rewritten = 0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None  # the writing's, in its loop
        self._since: float | None = None  # monotonic s: the backlog's first failure
        self._drops_told = 0

    @property
    def backlog(self) -> int:
        """Records waiting to be written again."""
        return len(self._backlog)

    @property
    def dropped(self) -> int:
        """Records given up: dropped from a full backlog, or left by ``close()``."""
        return self._backlog.dropped

    @property
    def rewritten(self) -> int:
        """Records written on a later try, after a write of them had failed or was cut
        short."""
        return self._rewritten

    def keep(self, records: list[JournalRecord], why: str) -> None:
        """Keep the records of a failed write, and have them written again."""
        self._backlog.add(records)
        if self._since is None:
            self._since = time.monotonic()
            log.warning(
                "the journal %s did not take %d records (%s): what they tell of (messages "
                "scheduled, cancels) stands all the same. The records are kept (at most "
                "%d, %d MiB of message copies) and written again, %g s to %g s apart; "
                "until then get() and pending() do not know those schedules",
                self.stream,
                len(records),
                why,
                MAX_BACKLOG_RECORDS,
                MAX_BACKLOG_BYTES >> 20,
                FIRST_WAIT_S,
                LAST_WAIT_S,
            )
        else:
            log.debug("the journal did not take %d records (%s)", len(records), why)
        self._try_soon(wait=True)

    def resend(self, records: list[JournalRecord]) -> None:
        """Have records written in the background whose write was cut short (a
        ``schedule()`` cancelled after the broker confirmed its message): taken or not,
        nobody knows; twice is harmless (the fold keeps one state per id). Not logged:
        the journal refused nothing."""
        self._backlog.add(records)
        self._try_soon(wait=True)

    def written(self) -> None:
        """A write was taken: the journal takes writes again, so the backlog (if any) is
        tried at once, not after the rest of its back-off."""
        if self._backlog:
            self._try_soon()

    async def stop(self) -> None:
        """End the background writing; its records in flight go back to the backlog."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    async def close(self, timeout_s: float) -> None:
        """The last try at the backlog (after ``stop``), within ``timeout_s``; what it
        cannot write is given up, and logged."""
        await self.stop()
        if not self._backlog:
            return
        kept, why = len(self._backlog), f"no answer within {timeout_s:g} s"
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                why = await self._write_backlog(timeout_s)
        self._tell_dropped()
        left = self._backlog.clear()
        self._drops_told += left
        self._since = None
        if left:
            log.warning(
                "closing: %d journal records remain unwritten to %s (%s) and are given "
                "up: get() and pending() will not know those schedules; what they tell of "
                "(messages scheduled, cancels) stands all the same",
                left,
                self.stream,
                why,
            )
        else:
            log.info("closing: the journal took the %d records kept to write again", kept)

    def _try_soon(self, *, wait: bool = False) -> None:
        """Start the background writing of the backlog, or (without ``wait``) cut its
        current wait short."""
        task = self._task
        if task is None or task.done():
            self._task = asyncio.ensure_future(self._rewrite())
            self._task.add_done_callback(_said_if_failed)
        elif not wait and self._wake is not None:
            self._wake.set()

    async def _rewrite(self) -> None:
        """Write the backlog again until it is empty, waiting between tries."""
        wait, wake = FIRST_WAIT_S, asyncio.Event()
        self._wake = wake
        while self._backlog:
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
            why = await self._write_backlog(self.timeout_s)
            self._tell_dropped()
            if why:
                wait = next_wait(wait)
                log.debug(
                    "the journal still takes no writes (%s): %d records kept, next try in %g s",
                    why,
                    len(self._backlog),
                    wait,
                )
        if self._since is not None:
            log.info(
                "the journal %s takes writes again: the records kept since %.1f s ago are "
                "written (%d written again in all, %d given up)",
                self.stream,
                time.monotonic() - self._since,
                self._rewritten,
                self.dropped,
            )
            self._since = None

    async def _write_backlog(self, timeout_s: float) -> str:
        """Write the backlog's records, oldest first, a stream message at a time, until
        none is left ("") or a write fails (why; its records go back)."""
        while self._backlog:
            records = self._backlog.take(RECORDS_PER_MESSAGE)
            try:
                failed, why = await self._write(records, timeout_s)
            except BaseException:  # cancelled (stop()): they may be written; twice is harmless
                self._backlog.put_back(records)
                raise
            self._rewritten += len(records) - len(failed)
            if failed:
                self._backlog.put_back(failed)
                return why
        return ""

    def _tell_dropped(self) -> None:
        """Log the records the full backlog dropped since last told."""
        dropped = self._backlog.dropped - self._drops_told
        if dropped:
            self._drops_told += dropped
            log.warning(
                "dropped the %d oldest journal records kept to write again (at most %d, "
                "%d MiB of message copies): get() and pending() will not know those "
                "schedules; what they tell of (messages scheduled, cancels) stands all the "
                "same",
                dropped,
                MAX_BACKLOG_RECORDS,
                MAX_BACKLOG_BYTES >> 20,
            )


def _said_if_failed(task: asyncio.Task[None]) -> None:
    """Log what ended the backlog's writing other than a cancel (the next failed write
    starts it again)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("writing the journal's backlog failed", exc_info=error)
