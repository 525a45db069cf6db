"""The bounds of a Scheduler's journal backlog (``hopsched.journal.backlog``): pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hopsched.journal.backlog import FIRST_WAIT_S, LAST_WAIT_S, Backlog, next_wait
from hopsched.journal.records import SCHEDULED, Copy, JournalRecord

_serial = iter(range(10**9))


def record(size: int) -> JournalRecord:
    """A record with a copy of ``size`` bytes (0: none), of an id of its own."""
    copy = Copy(b"p" * min(size, 3), b"b" * max(size - 3, 0)) if size else None
    return JournalRecord(SCHEDULED, f"id-{next(_serial)}", 1, 1, 2, copy=copy)


def size_of(one: JournalRecord) -> int:
    return 0 if one.copy is None else len(one.copy.properties) + len(one.copy.body)


#: Each step adds records of these sizes, then takes this many (and puts half back).
steps = st.lists(st.tuples(st.lists(st.integers(0, 40), max_size=12), st.integers(0, 8)))


@given(steps, st.integers(1, 10), st.integers(0, 120))
def test_the_backlog_keeps_the_newest_within_both_bounds_and_counts_what_it_drops(
    script: list[tuple[list[int], int]], max_records: int, max_bytes: int
) -> None:
    """Against a model: what is held is the newest records in order, within both bounds;
    records taken and written back (a failed write) count as the oldest; each record is
    held, taken or dropped, and counted once."""
    backlog = Backlog(max_records, max_bytes)
    model: list[JournalRecord] = []
    added = written = 0

    def trim() -> None:
        while model and (len(model) > max_records or sum(map(size_of, model)) > max_bytes):
            model.pop(0)

    for new_sizes, count in script:
        new = [record(size) for size in new_sizes]
        added += len(new)
        backlog.add(new)
        model.extend(new)
        trim()
        out = backlog.take(count)
        assert out == model[:count]
        del model[:count]
        failed = out[: len(out) // 2]  # half of them written, half back (a failed write)
        written += len(out) - len(failed)
        backlog.put_back(failed)
        model[:0] = failed
        trim()
        assert len(backlog) == len(model) <= max_records
        assert backlog.bytes == sum(map(size_of, model)) <= max_bytes
        assert added == len(backlog) + written + backlog.dropped
    assert backlog.take(len(backlog) + 1) == model


def test_a_full_backlog_drops_its_oldest_and_says_how_many() -> None:
    backlog = Backlog(max_records=3)
    first = [record(0) for _ in range(3)]
    assert backlog.add(first) == 0
    later = [record(0) for _ in range(2)]

    assert backlog.add(later) == 2
    assert backlog.dropped == 2
    assert backlog.take(10) == first[2:] + later
    assert backlog.clear() == 0


def test_clearing_gives_up_every_record_held() -> None:
    backlog = Backlog()
    backlog.add([record(10), record(0)])

    assert backlog.clear() == 2
    assert (len(backlog), backlog.bytes, backlog.dropped) == (0, 0, 2)


def test_the_waits_double_from_the_first_to_the_last() -> None:
    waits = [FIRST_WAIT_S]
    while waits[-1] < LAST_WAIT_S:
        waits.append(next_wait(waits[-1]))

    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert next_wait(LAST_WAIT_S) == LAST_WAIT_S
