"""The journal records a Scheduler could not write, kept to be written again: pure, no
I/O (the writing again is ``retry.JournalRetry``'s).

A record written again later, or twice (a write whose confirm was lost may have been
taken), is harmless: the fold keeps a maximum over a total order per id, whatever the
order and however often it reads a record (``records.JournalFold``; checked in
``tests/unit/test_journal.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from hopsched.journal.records import JournalRecord

__all__ = ["MAX_BACKLOG_BYTES", "MAX_BACKLOG_RECORDS", "Backlog", "next_wait"]

#: Records kept at most; beyond, the oldest are dropped (and counted).
MAX_BACKLOG_RECORDS = 100_000
#: Bytes of message copies (properties and body) kept at most: a ``scheduled`` record
#: holds its message, so the count alone could hold GiBs of large bodies.
MAX_BACKLOG_BYTES = 64 * 2**20
#: The waits between tries (s): the first after a failure, doubled after each failed
#: try up to the last.
FIRST_WAIT_S, LAST_WAIT_S = 1.0, 30.0


def _bytes(record: JournalRecord) -> int:
    copy = record.copy
    return 0 if copy is None else len(copy.properties) + len(copy.body)


def next_wait(wait_s: float) -> float:
    """The wait (s) after a failed try that followed a wait of ``wait_s``."""
    return min(2 * wait_s, LAST_WAIT_S)


class Backlog:
    """Records to write again, oldest first, at most ``max_records`` of them and
    ``max_bytes`` of message copies: adding past either drops the oldest.

    Attributes:
        dropped: records dropped so far (never written by this backlog).
    """

    def __init__(
        self, max_records: int = MAX_BACKLOG_RECORDS, max_bytes: int = MAX_BACKLOG_BYTES
    ) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.dropped = 0
        self._records: deque[JournalRecord] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        """Bytes of message copies held."""
        return self._bytes

    def add(self, records: Iterable[JournalRecord]) -> int:
        """Keep ``records`` as the newest; returns how many of the oldest were dropped."""
        for record in records:
            self._records.append(record)
            self._bytes += _bytes(record)
        return self._trim()

    def put_back(self, records: Iterable[JournalRecord]) -> int:
        """Return records ``take`` gave (a write of them failed) as the oldest; returns
        how many of the oldest were dropped."""
        for record in reversed(list(records)):
            self._records.appendleft(record)
            self._bytes += _bytes(record)
        return self._trim()

    def take(self, count: int) -> list[JournalRecord]:
        """Remove and return the ``count`` oldest records (fewer if fewer are held)."""
        taken: list[JournalRecord] = []
        while self._records and len(taken) < count:
            record = self._records.popleft()
            self._bytes -= _bytes(record)
            taken.append(record)
        return taken

    def clear(self) -> int:
        """Drop every record; returns how many."""
        count = len(self._records)
        self._records.clear()
        self._bytes = 0
        self.dropped += count
        return count

    def _trim(self) -> int:
        dropped = 0
        while self._records and (
            len(self._records) > self.max_records or self._bytes > self.max_bytes
        ):
            self._bytes -= _bytes(self._records.popleft())
            dropped += 1
        self.dropped += dropped
        return dropped
