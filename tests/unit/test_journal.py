"""The journal's records and their fold into what is known of each schedule: pure, no
broker (``hopsched.journal.records``)."""

from __future__ import annotations

import itertools
import json
import random as random_module
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hopsched.core.cancel import CANCEL, Record, reaches, record_scope, writer_scope
from hopsched.core.envelope import Envelope
from hopsched.core.ladder import US_PER_MS, Hop, Ladder, refresh_step_ms, retention_bound_us
from hopsched.journal import records as journal_module
from hopsched.journal.records import (
    CANCEL_COPY,
    CANCEL_COPY_ID,
    CANCELLED,
    COMPRESS_FROM_BYTES,
    DELIVERED,
    HELD,
    MAGIC,
    PARKED,
    PENDING,
    SCHEDULED,
    ZLIB_MAGIC,
    Copy,
    JournalFold,
    JournalRecord,
    ScheduleInfo,
    cancel_copy_record,
    cancel_owner,
    cancel_reaches,
    decode_journal,
    delivered_record,
    encode_journal,
    pack_journal,
)
from hopsched.topology import JOURNAL_RETENTION_US

HOLD_US = 4_000_000
NOW = 1_800_000_000_000_000
HOUR = 3_600_000_000


def scheduled(sid: str, created: int, due: int, **extra: object) -> JournalRecord:
    fields: dict[str, object] = {"exchange": "", "routing_key": "q", "size": 3} | extra
    return JournalRecord(SCHEDULED, sid, created, created, due, **fields)  # type: ignore[arg-type]


def outcome(
    op: str, sid: str, created: int, due: int, at: int, reason: str | None = None
) -> JournalRecord:
    return JournalRecord(op, sid, at, created, due, "", "q", 3, reason=reason)


def cancelled(sid: str, at: int) -> JournalRecord:
    return JournalRecord(CANCELLED, sid, at, at)


def fold(*records: JournalRecord, only: str | None = None) -> JournalFold:
    journal = JournalFold(only)
    for record in records:
        journal.apply(record)
    return journal


# --- encoding --------------------------------------------------------------------------

texts = st.text(st.characters(exclude_categories=()), max_size=20)  # lone surrogates too
records = st.builds(
    JournalRecord,
    op=st.sampled_from([SCHEDULED, DELIVERED, PARKED]),
    schedule_id=st.text(min_size=1, max_size=40),
    at_us=st.integers(0, 2**62),
    created_us=st.integers(0, 2**62),
    due_us=st.integers(0, 2**62),
    exchange=texts,
    routing_key=texts,
    size=st.none() | st.integers(0, 2**40),
    owner=st.none() | texts,
    reason=st.none() | texts,
    origin=st.none() | st.sampled_from(["schedule", "replace", "reschedule", "refresh"]),
    copy=st.none() | st.builds(Copy, st.binary(max_size=64), st.binary(max_size=256)),
    user=st.none() | texts,
)


@given(st.lists(records, max_size=8))
def test_records_come_back_as_they_were_written(written: list[JournalRecord]) -> None:
    body = encode_journal(written)

    assert list(decode_journal(body)) == written
    assert [r.copy for r in decode_journal(body, copies=False)] == [None] * len(written)


@given(st.lists(records, max_size=30))
def test_a_packed_body_is_no_longer_than_the_plain_one_and_reads_the_same(
    written: list[JournalRecord],
) -> None:
    plain, packed = encode_journal(written), pack_journal(written)

    assert len(packed) <= len(plain)
    assert packed.startswith(ZLIB_MAGIC) == (packed != plain)
    assert list(decode_journal(packed)) == written
    assert [r.copy for r in decode_journal(packed, copies=False)] == [None] * len(written)


def test_a_batch_is_written_compressed_and_a_lone_marker_plain() -> None:
    batch = [scheduled(f"order-{n}", NOW + n, NOW + HOUR + n) for n in range(1000)]
    plain = encode_journal(batch)
    packed = pack_journal(batch)

    assert len(plain) >= COMPRESS_FROM_BYTES
    assert packed.startswith(ZLIB_MAGIC)
    assert len(packed) < len(plain) / 3  # field names, targets, digits repeat
    marker = [JournalRecord("marker", "m", 0, 0)]
    assert pack_journal(marker) == encode_journal(marker)


def test_a_compressed_body_that_does_not_inflate_or_inflates_too_far_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(journal_module, "MAX_INFLATED_BYTES", 2**20)  # not 512 MiB in a test
    good = pack_journal([scheduled(f"order-{n}", NOW, NOW + HOUR) for n in range(100)])
    bomb = ZLIB_MAGIC + zlib.compress(MAGIC + b"\0" * 2**20, 9)

    assert len(list(decode_journal(good))) == 100
    assert list(decode_journal(good[:-10])) == []  # cut short
    assert list(decode_journal(ZLIB_MAGIC + b"noise")) == []
    assert list(decode_journal(bomb)) == []  # 1 MiB of zeros in 1 kB
    assert len(list(decode_journal(good + b"trailing"))) == 100  # as a plain body's tail


@given(st.lists(records, min_size=1, max_size=8))
def test_only_one_id_reads_its_records_with_their_copies(written: list[JournalRecord]) -> None:
    wanted = written[0].schedule_id

    read = list(decode_journal(encode_journal(written), only=wanted))

    assert read == [r for r in written if r.schedule_id == wanted]


@given(st.lists(records, max_size=8), st.lists(st.binary(max_size=300), max_size=4), st.randoms())
def test_the_cancel_streams_copies_read_back_alone_and_are_not_folded(
    written: list[JournalRecord], bodies: list[bytes], random: random_module.Random
) -> None:
    copies = [cancel_copy_record(body, NOW + i) for i, body in enumerate(bodies)]
    mixed = written + copies
    random.shuffle(mixed)
    body = pack_journal(mixed)

    read = list(decode_journal(body, only=CANCEL_COPY_ID))

    assert [r.copy.body for r in read if r.copy is not None] == [
        r.copy.body for r in mixed if r.op == CANCEL_COPY and r.copy is not None
    ]
    assert all(r.op == CANCEL_COPY for r in read)
    infos = fold(*decode_journal(body)).infos(NOW, HOLD_US)
    others = [r for r in mixed if r.op != CANCEL_COPY]
    assert list(infos) == list(fold(*others).infos(NOW, HOLD_US))


@given(st.lists(records, min_size=1, max_size=4), st.integers(1, 200))
def test_a_truncated_message_keeps_the_records_before_the_cut(
    written: list[JournalRecord], cut: int
) -> None:
    body = encode_journal(written)
    short = body[: max(len(MAGIC), len(body) - cut)]

    read = list(decode_journal(short))

    assert read == written[: len(read)]


def test_what_is_not_a_journal_record_is_skipped() -> None:
    def part(data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + data

    good = encode_journal([scheduled("a", 1, 2)])
    odd = [
        json.dumps({"op": "scheduled", "id": "b", "at": 1, "c": 1}).encode(),  # no due time
        json.dumps({"op": "nonsense", "id": "c", "at": 1, "c": 1}).encode(),
        json.dumps({"op": "delivered", "id": 7, "at": 1, "c": 1, "due": 1}).encode(),
        json.dumps(["a list"]).encode(),
        b"{not json",
    ]
    body = good + b"".join(part(meta) for meta in odd[:4])

    assert [r.schedule_id for r in decode_journal(body)] == ["a"]
    assert list(decode_journal(b'{"op":"cancel"}\n')) == []  # a cancel-stream body
    assert [r.schedule_id for r in decode_journal(good + part(odd[4]) + good)] == ["a"]


# --- the fold --------------------------------------------------------------------------


def test_each_state_and_its_instants() -> None:
    due = NOW + HOUR
    journal = fold(
        scheduled("pending", NOW - 1, due),
        scheduled("held", NOW - 1, NOW + HOLD_US),
        scheduled("delivered", NOW - 1, NOW - 10),
        outcome(DELIVERED, "delivered", NOW - 1, NOW - 10, NOW - 9),
        scheduled("cancelled", NOW - 5, due),
        cancelled("cancelled", NOW - 4),
        scheduled("parked", NOW - 5, NOW - 3),
        outcome(PARKED, "parked", NOW - 5, NOW - 3, NOW - 2, reason="unroutable"),
    )

    def info(sid: str) -> tuple[object, ...]:
        found = journal.info(sid, NOW, HOLD_US)
        assert found is not None
        return found.state, found.delivered_us, found.cancelled_us, found.parked_us

    assert info("pending") == (PENDING, None, None, None)
    assert info("held") == (HELD, None, None, None)
    assert info("delivered") == (DELIVERED, NOW - 9, None, None)
    assert info("cancelled") == (CANCELLED, None, NOW - 4, None)
    assert info("parked") == (PARKED, None, None, NOW - 2)
    parked = journal.info("parked", NOW, HOLD_US)
    assert parked is not None
    assert parked.parked_reason == "unroutable"
    assert journal.info("never", NOW, HOLD_US) is None


def test_a_cancel_alone_does_not_make_an_id_known() -> None:
    assert fold(cancelled("x", NOW)).info("x", NOW, HOLD_US) is None


def test_the_newest_copy_wins_and_an_older_copys_outcome_is_not_its_own() -> None:
    """A reschedule (or a replace) is a newer copy: the old one's delivery (a race at its
    due time) or the cancel before it say nothing of the new one."""
    journal = fold(
        scheduled("x", NOW - 10, NOW - 5),
        outcome(DELIVERED, "x", NOW - 10, NOW - 5, NOW - 4),
        cancelled("x", NOW - 2),
        scheduled("x", NOW - 1, NOW + HOUR, origin="reschedule"),
    )

    info = journal.info("x", NOW, HOLD_US)

    assert info is not None
    assert (info.state, info.due_us, info.origin) == (PENDING, NOW + HOUR, "reschedule")


def test_a_cancel_takes_the_copies_created_at_or_before_it_only() -> None:
    before = fold(scheduled("x", NOW, NOW + HOUR), cancelled("x", NOW))
    after = fold(scheduled("x", NOW + 1, NOW + HOUR), cancelled("x", NOW))

    assert before.info("x", NOW, HOLD_US).state == CANCELLED  # type: ignore[union-attr]
    assert after.info("x", NOW, HOLD_US).state == PENDING  # type: ignore[union-attr]


def test_a_cancel_shows_only_on_the_copies_its_signer_reaches() -> None:
    """As the relays apply it: a cancel signed with other keys than the copy's, or an
    unsigned one of a signed copy, leaves it pending in look-ups too (it is delivered)."""

    def state(copy_owner: str | None, canceller_keys: list[str] | None) -> str:
        owner = None if canceller_keys is None else cancel_owner(canceller_keys)
        journal = fold(
            scheduled("x", NOW, NOW + HOUR, owner=copy_owner),
            JournalRecord(CANCELLED, "x", NOW + 1, NOW + 1, owner=owner),
            only="x",
        )
        info = journal.info("x", NOW, HOLD_US)
        assert info is not None
        assert journal.pending_copies() == (info.state == PENDING)
        assert (list(journal.pending()) == ["x"]) == (info.state == PENDING)
        return info.state

    assert state("k1", ["k1"]) == CANCELLED
    assert state("k1", ["k0", "k1"]) == CANCELLED  # signed with every key it holds
    assert state("k1", ["k2"]) == PENDING
    assert state("k1", []) == PENDING  # unsigned: unsigned copies only
    assert state(None, []) == CANCELLED
    assert state(None, ["k1"]) == PENDING
    assert state("k1", None) == CANCELLED  # journaled before cancels said whose: as then


def test_F45_without_keys_a_cancel_shows_only_on_its_own_user_s_copies() -> None:
    """As the relays apply it (``hopsched.core.cancel``): the canceller's user (its journal
    message's ``user_id``) reaches copies of the same user and those of none; a trusted
    user's, every unsigned copy; one without ``user_id``, those of none only."""

    def state(copy_user: str | None, canceller: str | None, many: bool = False) -> str:
        cancel = JournalRecord(CANCELLED, "x", NOW + 1, NOW + 1, owner="", user=canceller)
        copies = [scheduled("x", NOW, NOW + HOUR, user=copy_user)]
        if many:  # a listing's fold: the copy in the columns, then the cancel
            journal = fold(*copies, cancel)
        else:
            journal = JournalFold("x", trusted={"ops"})
            for record in (*copies, cancel):
                journal.apply(record)
            info = journal.info("x", NOW, HOLD_US)
            assert info is not None
            assert journal.pending_copies() == (info.state == PENDING)
        info = journal.info("x", NOW, HOLD_US)
        assert info is not None
        return info.state

    assert state("alice", "alice") == CANCELLED
    assert state("alice", "mallory") == PENDING
    assert state(None, "mallory") == CANCELLED
    assert state("alice", None) == PENDING
    assert state(None, None) == CANCELLED
    assert state("alice", "ops") == CANCELLED  # trusted
    assert state("alice", "mallory", many=True) == PENDING  # the copy's user kept in columns
    assert state("alice", "alice", many=True) == CANCELLED


@given(
    copy_user=st.none() | st.sampled_from(["alice", "ops"]),
    cancel_user=st.none() | st.sampled_from(["alice", "ops", "mallory"]),
)
def test_F45_a_journaled_cancel_reaches_what_the_relays_apply_it_to(
    copy_user: str | None, cancel_user: str | None
) -> None:
    record = Record(CANCEL, "x", NOW, user=cancel_user)
    relays = reaches(record_scope(record, {"ops"}), None, copy_user)
    assert cancel_reaches("", None, writer_scope(cancel_user, {"ops"}), copy_user) == relays


key_ids = st.lists(st.sampled_from(["a", "b", "c", "2026-12"]), unique=True, max_size=3)


@given(copy_owner=st.none() | st.sampled_from(["a", "b", "c", "2026-12"]), keys=key_ids)
def test_a_cancel_reaches_what_its_keys_signed_and_survives_the_codec(
    copy_owner: str | None, keys: list[str]
) -> None:
    owner = cancel_owner(keys)
    (decoded,) = decode_journal(
        encode_journal([JournalRecord(CANCELLED, "x", NOW, NOW, owner=owner)])
    )
    assert decoded.owner == owner
    expected = copy_owner in keys if keys else copy_owner is None
    assert cancel_reaches(decoded.owner, copy_owner) == expected


def test_a_parked_message_replayed_and_delivered_is_delivered() -> None:
    journal = fold(
        scheduled("x", NOW - 9, NOW - 8),
        outcome(PARKED, "x", NOW - 9, NOW - 8, NOW - 7, reason="unroutable"),
        outcome(DELIVERED, "x", NOW - 9, NOW - 8, NOW - 1),
    )

    assert journal.info("x", NOW, HOLD_US).state == DELIVERED  # type: ignore[union-attr]


def test_a_relays_record_alone_is_enough_to_answer() -> None:
    """The producer's record past retention (or from before the journal): the relay's
    delivered record still says what, where and when."""
    envelope = Envelope("x", NOW - 5, "ex", "rk", created_us=NOW - 50)

    info = fold(delivered_record(envelope, 12, NOW - 4)).info("x", NOW, HOLD_US)

    assert info is not None
    assert (info.state, info.exchange, info.routing_key, info.size) == (DELIVERED, "ex", "rk", 12)
    assert info.origin is None
    assert info.copy is None


def test_a_refresh_keeps_the_producers_origin_but_not_its_copy_if_it_has_none() -> None:
    journal = fold(
        scheduled("x", NOW - 9, NOW + HOUR, origin="replace", copy=Copy(b"p", b"old")),
        JournalRecord(
            SCHEDULED,
            "x",
            NOW - 1,
            NOW - 9,
            NOW + HOUR,
            "",
            "q",
            3,
            origin="refresh",
            copy=Copy(b"p", b"refreshed"),
        ),
    )

    info = journal.info("x", NOW, HOLD_US)

    assert info is not None
    assert info.origin == "replace"
    assert info.copy == Copy(b"p", b"old")


def test_only_folds_one_id() -> None:
    journal = fold(scheduled("a", 1, 2), scheduled("b", 1, 2), only="a")

    assert len(journal) == 1
    assert journal.info("b", NOW, HOLD_US) is None


def test_two_copies_that_differ_only_in_their_origin_fold_alike_in_either_order() -> None:
    """A tie in every other rank is broken by the origin, not by the order of reading."""
    first, second = (
        scheduled("x", NOW - 5, NOW + HOUR, origin=origin, copy=Copy(b"p", b"b"))
        for origin in ("schedule", "replace")
    )

    one = fold(first, second).info("x", NOW, HOLD_US)
    other = fold(second, first).info("x", NOW, HOLD_US)

    assert one is not None
    assert other is not None
    assert one.origin == other.origin == "schedule"


ids = st.sampled_from(["a", "b", "c"])
instants = st.integers(NOW - 20, NOW + 20)
any_record = st.one_of(
    st.builds(
        lambda sid, c, due, origin: scheduled(sid, c, due, origin=origin),
        ids, instants, st.integers(NOW - 30, NOW + HOUR), st.sampled_from(["schedule", "refresh"]),
    ),
    st.builds(
        lambda op, sid, c, at: outcome(op, sid, c, NOW, at),
        st.sampled_from([DELIVERED, PARKED]), ids, instants, instants,
    ),
    st.builds(cancelled, ids, instants),
)  # fmt: skip


@given(st.lists(any_record, max_size=12), st.randoms(use_true_random=False))
def test_the_fold_does_not_depend_on_the_order_records_are_read_in(
    written: list[JournalRecord], shuffle: object
) -> None:
    """Records reach a reader in stream order, but written by many processes with their
    own clocks: the answer must be the same in any order."""
    shuffled = list(written)
    shuffle.shuffle(shuffled)  # type: ignore[attr-defined]

    def answer(journal: JournalFold) -> list[object]:
        return sorted(
            (info.schedule_id, info.state, info.created_us, info.due_us, info.delivered_us,
             info.parked_us, info.cancelled_us)
            for info in journal.infos(NOW, HOLD_US)
        )  # fmt: skip

    assert answer(fold(*written)) == answer(fold(*shuffled))


#: What a Scheduler writes: a copy of the message, and a replace's cancel of the older.
#: Two of one created instant may differ only in their origin (no writer makes two such,
#: but the fold must still not depend on which it reads first).
producer_record = st.builds(
    lambda sid, c, due, origin: scheduled(sid, c, due, origin=origin, copy=Copy(b"p", b"b")),
    ids, instants, st.integers(NOW - 30, NOW + HOUR), st.sampled_from(["replace", "schedule"]),
)  # fmt: skip


@given(
    st.lists(any_record | producer_record, min_size=1, max_size=12),
    st.lists(st.integers(0, 11), max_size=12),
    st.randoms(use_true_random=False),
)
def test_a_record_written_again_late_or_twice_changes_nothing(
    written: list[JournalRecord], again: list[int], shuffle: object
) -> None:
    """A Scheduler writes the records of a failed write again (``journal_backlog``),
    after records written since, and a write whose confirm was lost may have been taken
    after all: records read twice, anywhere, give the same answers."""
    repeated = written + [written[i % len(written)] for i in again]
    shuffle.shuffle(repeated)  # type: ignore[attr-defined]

    def answers(records: list[JournalRecord]) -> list[object]:
        journal = fold(*records)
        listed = [(i.schedule_id, i.state, i.due_us) for i in journal.pending_infos(NOW, HOLD_US)]
        infos = sorted(
            (info.schedule_id, info.state, info.created_us, info.due_us, info.delivered_us,
             info.parked_us, info.cancelled_us, info.origin, info.copy)
            for info in journal.infos(NOW, HOLD_US)
        )  # fmt: skip
        copies = [fold(*records, only=sid).pending_copies() for sid in "abc"]
        return [listed, infos, copies]

    assert answers(repeated) == answers(written)


@given(st.lists(any_record, min_size=1, max_size=12))
def test_the_newest_copy_is_the_one_described(written: list[JournalRecord]) -> None:
    journal = fold(*written)
    for info in journal.infos(NOW, HOLD_US):
        copies = [
            r.created_us for r in written if r.schedule_id == info.schedule_id and r.op != CANCELLED
        ]
        assert info.created_us == max(copies)


@given(st.lists(any_record, max_size=12), st.none() | instants, st.none() | st.just("q"))
def test_the_pending_listing_is_the_pending_and_held_infos_in_due_order(
    written: list[JournalRecord], before: int | None, routing_key: str | None
) -> None:
    journal = fold(*written)
    expected = sorted(
        (info.due_us, info.schedule_id)
        for info in journal.infos(NOW, HOLD_US)
        if info.state in (PENDING, HELD) and (before is None or info.due_us < before)
    )

    listed = journal.pending(before, routing_key)
    assert [(journal.due_us(schedule_id), schedule_id) for schedule_id in listed] == expected


many_ids = st.text("abcdefgh", min_size=1, max_size=3)
tied_dues = st.integers(NOW - 3, NOW + 3)  # several ids due at one instant
many_records = st.one_of(
    st.builds(
        lambda sid, c, due, rk, size: scheduled(sid, c, due, routing_key=rk, size=size),
        many_ids, instants, tied_dues, st.sampled_from(["q", "r"]),
        st.none() | st.integers(0, 2**70),  # a size no column carries: kept as a record
    ),
    st.builds(
        lambda sid, c, due: scheduled(sid, c, due, copy=Copy(b"p", b"b")),
        many_ids, instants, tied_dues,
    ),
    st.builds(
        lambda op, sid, c, at: outcome(op, sid, c, NOW, at),
        st.sampled_from([DELIVERED, PARKED]), many_ids, instants, instants,
    ),
    st.builds(cancelled, many_ids, instants),
)  # fmt: skip


class _SmallPasses(JournalFold):
    """A fold whose listing sorts about two rows at a time."""

    SORT_PASS = 2


@pytest.mark.parametrize("folding", [JournalFold, _SmallPasses])
@given(
    st.lists(many_records, max_size=40),
    st.none() | tied_dues,
    st.none() | st.sampled_from(["q", "r", "s"]),
    st.none() | st.integers(0, 8),
)
def test_the_pending_listing_of_many_ids_orders_ties_by_id_and_stops_at_the_limit(
    folding: type[JournalFold],
    written: list[JournalRecord],
    before: int | None,
    routing_key: str | None,
    limit: int | None,
) -> None:
    journal = folding()
    for record in written:
        journal.apply(record)
    expected = sorted(
        (info.due_us, info.schedule_id)
        for info in journal.infos(NOW, HOLD_US)
        if info.state in (PENDING, HELD)
        and (before is None or info.due_us < before)
        and routing_key in (None, info.routing_key)
    )[:limit]

    listed = journal.pending(before, routing_key, limit)
    assert [(journal.due_us(schedule_id), schedule_id) for schedule_id in listed] == expected


@given(st.lists(many_records, max_size=40))
def test_every_id_read_is_counted_and_looked_up_as_listed(
    written: list[JournalRecord],
) -> None:
    journal = fold(*written)
    known = {r.schedule_id for r in written if r.op != CANCELLED}

    assert len(journal) == len({r.schedule_id for r in written})
    assert {info.schedule_id for info in journal.infos(NOW, HOLD_US)} == known
    for info in journal.infos(NOW, HOLD_US):
        assert journal.info(info.schedule_id, NOW, HOLD_US) == info
        assert journal.due_us(info.schedule_id) == info.due_us


class _RecordsOnly(JournalFold):
    """A fold that keeps every id as objects: its columns never used."""

    def _row_values(self, record: JournalRecord) -> None:
        return None


@given(st.lists(many_records, max_size=40))
def test_the_columns_give_what_the_records_kept_as_objects_give(
    written: list[JournalRecord],
) -> None:
    """A pending id's newest record lives in the fold's columns: the answers must be the
    same as if it were kept as it is."""
    columns, objects = fold(*written), _RecordsOnly()
    for record in written:
        objects.apply(record)

    def key(info: ScheduleInfo) -> str:
        return info.schedule_id

    assert sorted(columns.infos(NOW, HOLD_US), key=key) == sorted(
        objects.infos(NOW, HOLD_US), key=key
    )
    assert list(columns.pending()) == list(objects.pending())


@given(st.lists(st.integers(-(2**63), 2**63 - 1) | tied_dues), st.integers(1, 200))
def test_the_listing_s_due_ranges_cover_every_due_time_once_in_order(
    dues: list[int], per_range: int
) -> None:
    ranges = list(journal_module._due_ranges(dues, per_range))

    assert all(low < high for low, high in ranges)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(sum(low <= due < high for low, high in ranges) == 1 for due in dues)


# --- retention -------------------------------------------------------------------------


@pytest.mark.parametrize("top_step_ms", [2**20, 2**28, 2**32])
@given(tops=st.integers(0, 50_000))
def test_a_pending_message_always_has_a_record_younger_than_the_bound(
    top_step_ms: int, tops: int
) -> None:
    """Followed hop by hop (each hop returning the instant its TTL ends), a message gets a
    record when scheduled and at each hop on a step of ``refresh_step_ms`` or more: no
    instant before its delivery is further than ``retention_bound_us`` from the last one."""
    ladder = Ladder(max_step_ms=top_step_ms)
    now, due = 0, tops * top_step_ms * US_PER_MS // 1000  # up to 50 top steps
    last_record, widest = 0, 0
    while True:
        plan = ladder.plan(now_us=now, due_us=due)
        if not isinstance(plan, Hop):
            widest = max(widest, due - last_record)
            break
        if plan.step_ms >= refresh_step_ms(top_step_ms) and now > 0:
            widest = max(widest, now - last_record)
            last_record = now
        now += plan.step_ms * US_PER_MS

    assert widest <= retention_bound_us(top_step_ms)
    assert retention_bound_us(2**32) < JOURNAL_RETENTION_US


def test_pending_copies_counts_the_messages_of_one_id_still_pending() -> None:
    first, second = scheduled("a", 10, NOW + HOUR), scheduled("a", 20, NOW + 2 * HOUR)
    replacing = scheduled("a", 30, NOW + HOUR, origin="replace")

    assert fold(first, second, only="a").pending_copies() == 2
    assert (
        fold(first, outcome(DELIVERED, "a", 10, NOW + HOUR, 40), second, only="a").pending_copies()
        == 1
    )
    assert fold(first, second, cancelled("a", 25), only="a").pending_copies() == 0
    assert fold(second, first, replacing, only="a").pending_copies() == 1  # cancels older
