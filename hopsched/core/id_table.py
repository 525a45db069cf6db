"""A compact set of schedule ids, each numbered by the order it was first added (its
row: 0, 1, 2 ...). Pure, no I/O; ``JournalFold`` keeps its columns by these rows.

Why not a ``dict[str, int]``: listing a million pending schedules held a million id
strings (81 bytes each for a 32-character id), their dict slots (30 MiB, and 44 MiB for
a moment while the dict doubled) and an int object per row above 256 (28 bytes). Here
an id is its UTF-8 bytes in one shared buffer, an 8-byte end offset and an 8-byte hash,
and the table an ``array('i')`` of rows kept at most half full (4 to 16 bytes an id):
56 to 64 bytes for a 32-character id.
"""

from __future__ import annotations

from array import array

__all__ = ["IdTable"]

_EMPTY = -1
_FIRST_SLOTS = 8


def _utf8(schedule_id: str) -> bytes:
    # surrogatepass: an id read from JSON may hold lone surrogates; it must read back as it was
    return schedule_id.encode("utf-8", "surrogatepass")


class IdTable:
    """Schedule ids and their rows: ``add`` numbers a new id, ``find`` looks one up,
    ``id_at`` gives a row's id back. Ids are never removed."""

    def __init__(self) -> None:
        self._bytes = bytearray()  # every id's UTF-8, one after the other
        self._ends = array("Q")  # row r's id is _bytes[_ends[r - 1] : _ends[r]]
        self._hashes = array("q")  # row r's id's hash(), to probe and to grow without decoding
        self._slots = array("i", [_EMPTY]) * _FIRST_SLOTS  # open addressing, linear probing

    def __len__(self) -> int:
        return len(self._ends)

    def find(self, schedule_id: str) -> int:
        """``schedule_id``'s row, or -1 if it was never added."""
        return self._probe(schedule_id, hash(schedule_id))[0]

    def add(self, schedule_id: str) -> tuple[int, bool]:
        """``schedule_id``'s row, and whether it was added just now (a new id gets the
        next row, ``len(self)`` before the call)."""
        hashed = hash(schedule_id)
        row, slot = self._probe(schedule_id, hashed)
        if row != _EMPTY:
            return row, False
        row = len(self._ends)
        if 2 * (row + 1) > len(self._slots):
            self._grow()
            slot = self._probe(schedule_id, hashed)[1]
        self._bytes += _utf8(schedule_id)
        self._ends.append(len(self._bytes))
        self._hashes.append(hashed)
        self._slots[slot] = row
        return row, True

    def id_at(self, row: int) -> str:
        """The id of ``row`` (0 <= row < len(self))."""
        start = self._ends[row - 1] if row else 0
        return self._bytes[start : self._ends[row]].decode("utf-8", "surrogatepass")

    def _probe(self, schedule_id: str, hashed: int) -> tuple[int, int]:
        """(the id's row or -1, the slot it is in or would go in)."""
        slots, hashes = self._slots, self._hashes
        mask = len(slots) - 1
        slot = hashed & mask
        encoded = None
        while (row := slots[slot]) != _EMPTY:
            if hashes[row] == hashed:  # then, almost surely, the id: compare to be sure
                if encoded is None:
                    encoded = _utf8(schedule_id)
                start = self._ends[row - 1] if row else 0
                if self._bytes[start : self._ends[row]] == encoded:
                    return row, slot
            slot = (slot + 1) & mask
        return _EMPTY, slot

    def _grow(self) -> None:
        slots = array("i", [_EMPTY]) * (2 * len(self._slots))
        mask = len(slots) - 1
        for row, hashed in enumerate(self._hashes):
            slot = hashed & mask
            while slots[slot] != _EMPTY:
                slot = (slot + 1) & mask
            slots[slot] = row
        self._slots = slots
