"""Cancel and reschedule records, and what a relay makes of them: pure, no broker."""

from __future__ import annotations

import tracemalloc
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hopsched.cancel import (
    CANCEL,
    GRACE_US,
    RESCHEDULE,
    Cancellations,
    Record,
    decode_records,
    encode_records,
)
from hopsched.localbroker import RESTORE_STREAM_COORDINATOR

S = 1_000_000
NOW = 1_800_000_000 * S
DAY = 86_400 * S

records = st.builds(
    Record,
    op=st.sampled_from([CANCEL, RESCHEDULE]),
    schedule_id=st.text(min_size=1, max_size=40),
    at_us=st.integers(0, 2**62),
    due_us=st.integers(0, 2**62),
) | st.builds(
    Record,
    op=st.just(CANCEL),
    schedule_id=st.text(min_size=1, max_size=40),
    at_us=st.integers(0, 2**62),
    due_us=st.none(),
)


@given(batch=st.lists(records, max_size=20))
def test_records_survive_their_encoding(batch: list[Record]) -> None:
    assert list(decode_records(encode_records(batch))) == batch


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b'{"op": "cancel"}',
        b'{"op": "explode", "id": "x", "at": 1}',  # a newer hopsched's, say
        b'{"op": "reschedule", "id": "x", "at": 1}',  # a reschedule needs its due time
        b'{"op": "cancel", "id": 7, "at": 1}',
        b'{"op": "cancel", "id": "x", "at": "yesterday"}',
    ],
)
def test_a_line_that_is_no_record_is_skipped(line: bytes) -> None:
    good = encode_records([Record(CANCEL, "kept", 5)])

    assert list(decode_records(line + b"\n" + good)) == [Record(CANCEL, "kept", 5)]


def test_a_cancel_applies_to_messages_created_before_it() -> None:
    cancellations = Cancellations(retention_us=50 * DAY)
    cancellations.apply(Record(CANCEL, "order-42", at_us=NOW))

    assert (
        cancellations.verdict("order-42", created_us=NOW - 1, due_us=NOW + S, owner=None) == CANCEL
    )
    assert cancellations.verdict("order-42", created_us=NOW, due_us=NOW + S, owner=None) == CANCEL
    assert cancellations.verdict("order-42", created_us=NOW + 1, due_us=NOW + S, owner=None) is None
    assert cancellations.verdict("order-43", created_us=NOW - 1, due_us=NOW + S, owner=None) is None


def test_a_reschedule_gives_the_new_due_time_until_the_message_carries_it() -> None:
    cancellations = Cancellations(retention_us=50 * DAY)
    cancellations.apply(Record(RESCHEDULE, "order-42", at_us=NOW, due_us=NOW + 60 * S))

    assert cancellations.verdict("order-42", NOW - S, NOW + S, None) == NOW + 60 * S
    assert cancellations.verdict("order-42", NOW - S, NOW + 60 * S, None) is None


def test_of_two_records_for_one_id_the_later_stands() -> None:
    cancellations = Cancellations(retention_us=50 * DAY)
    cancellations.apply(Record(RESCHEDULE, "x", at_us=NOW, due_us=NOW + 60 * S))
    cancellations.apply(Record(CANCEL, "x", at_us=NOW + S))
    cancellations.apply(Record(RESCHEDULE, "x", at_us=NOW - S, due_us=NOW + 5 * S))  # older

    assert cancellations.verdict("x", NOW - S, NOW + S, None) == CANCEL


def test_records_are_forgotten_once_no_message_can_meet_them() -> None:
    cancellations = Cancellations(retention_us=50 * DAY)
    cancellations.apply(Record(CANCEL, "due-known", at_us=NOW, due_us=NOW + 10 * S))
    cancellations.apply(Record(CANCEL, "due-learnt", at_us=NOW))
    cancellations.apply(Record(CANCEL, "due-unknown", at_us=NOW))
    cancellations.apply(Record(RESCHEDULE, "moved", at_us=NOW, due_us=NOW + 20 * S))
    assert (
        cancellations.verdict("due-learnt", NOW - S, NOW + 30 * S, None) == CANCEL
    )  # a relay saw it

    assert cancellations.forget(NOW + 10 * S + GRACE_US) == 0
    assert cancellations.forget(NOW + 10 * S + GRACE_US + 1) == 1  # due-known
    assert cancellations.forget(NOW + 30 * S + GRACE_US + 1) == 1  # due-learnt
    assert len(cancellations) == 2
    assert cancellations.forget(NOW + 50 * DAY) == 0
    # kept for the whole retention: no relay has met "moved" (its due time is not its
    # message's), nor "due-unknown"
    assert cancellations.forget(NOW + 50 * DAY + 1) == 2


def test_an_earlier_reschedule_waits_for_its_message_however_far_in_the_past() -> None:
    """Found by a new-user trial: a reschedule to a time long past was forgotten an hour
    after that time, before its message (due in a week, on a long step) came by, which
    then left at its old due time."""
    cancellations = Cancellations(retention_us=50 * DAY)
    cancellations.apply(Record(RESCHEDULE, "x", at_us=NOW, due_us=NOW - 365 * DAY))
    cancellations.forget(NOW + 3 * DAY)  # the message's next visit: three days later

    assert cancellations.verdict("x", NOW - S, NOW + 7 * DAY, None) == NOW - 365 * DAY
    # met: kept only for crash copies, until past the later of the two due times
    assert cancellations.forget(NOW + 7 * DAY + GRACE_US) == 0
    assert cancellations.forget(NOW + 7 * DAY + GRACE_US + 1) == 1


def test_a_cancel_that_knows_the_due_time_keeps_a_rescheduled_later_one() -> None:
    cancellations = Cancellations(retention_us=50 * DAY)
    cancellations.apply(Record(RESCHEDULE, "x", at_us=NOW, due_us=NOW + 10 * DAY))
    cancellations.apply(Record(CANCEL, "x", at_us=NOW + S, due_us=NOW + 60 * S))  # stale due

    assert cancellations.forget(NOW + 9 * DAY) == 0
    assert cancellations.verdict("x", NOW - S, NOW + 10 * DAY, None) == CANCEL


def test_a_pending_cancellation_costs_at_most_200_bytes() -> None:
    """The issue's memory bound: 1,000,000 pending cancellations under 200 MB."""
    body = encode_records(Record(CANCEL, uuid.uuid4().hex, NOW + index) for index in range(100_000))
    tracemalloc.start()
    try:
        cancellations = Cancellations(retention_us=50 * DAY)
        before = tracemalloc.get_traced_memory()[0]
        for record in decode_records(body):  # as a relay reads them
            cancellations.apply(record)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    per_record = (after - before) / len(cancellations)
    print(f"\n{per_record:.0f} bytes per pending cancellation (a 32-character id)")
    assert per_record <= 200


def test_the_documented_stream_repair_is_the_one_the_tests_run() -> None:
    """docs/operations.md gives operators the command the broker tests prove works."""
    operations = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    assert f"rabbitmqctl eval '{RESTORE_STREAM_COORDINATOR}'" in operations
