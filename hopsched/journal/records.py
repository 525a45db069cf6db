"""The journal: what happened to each schedule, as records in the prefix's stream
``{prefix}.journal``, and the fold of those records into a ``ScheduleInfo`` per schedule
id. Pure: no I/O; the clock comes in as arguments (``journal_io`` reads and writes).

Who writes what (docs/design.md, "The journal"):

* ``schedule()`` and ``schedule_many()``, once the ladder confirmed the message: a
  ``scheduled`` record per message (``schedule_many``: the whole batch in one stream
  message) with the due time, target, size, signer and a *copy* of the message (its
  first hop's encoded properties and its body), from which ``reschedule()`` issues the
  message anew;
* ``reschedule()`` and ``schedule(replace=True)``: the new copy's ``scheduled`` record
  (``origin`` says which), written after the new copy is confirmed and before the cancel
  record that takes the older copies;
* ``cancel()``: a ``cancelled`` record, after the cancel stream confirmed its record;
* every write to the cancel stream (cancel, reschedule, replace), once confirmed: a
  ``cancel_copy`` record holding that stream message as it was written, so that the
  stream's records outlive its deletion (a relay restores them: ``journal.cancels``);
* relays, after the broker confirmed a final delivery or a parked copy: ``delivered`` and
  ``parked`` records, batched (one stream write per batch); and ``scheduled`` records
  anew (``origin="refresh"``) for a message they hop on a step of ``ladder.refresh_step_ms`` or
  more, so that a message due in years keeps a record younger than the stream's
  retention (``ladder.retention_bound_us``).

A copy of a schedule is identified by its id and its ``created_us`` (the instant the
producer scheduled it, header ``x-hopsched-created``). The fold keeps, per id, the newest
copy (the largest ``created_us``) and what happened to *that* copy; a cancel applies to
the copies created at or before it (as in ``hopsched.core.cancel``). The result does not
depend on the order the records are read in: every choice is a maximum over a total
order (``tests/unit/test_journal.py`` checks it with hypothesis).

Body layout of one stream message (version 1): ``b"HJ1\\n"``, then per record a 4-byte
big-endian length and that many bytes of JSON (ASCII; the record's fields), and when
the JSON says ``"copy": true`` two more length-prefixed parts: the encoded properties
and the body. Or, written by ``pack_journal`` when it is shorter so: ``b"HJZ\\n"`` and
the rest of that layout (after its magic) compressed by zlib. A reader skips records it
cannot read (a newer hopsched's, noise).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import struct
import sys
import zlib
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hopsched.core.cancel import reaches, user_scope, writer_scope
from hopsched.core.clock import us_to_datetime
from hopsched.core.envelope import Envelope
from hopsched.core.id_table import IdTable

__all__ = [
    "CANCELLED",
    "CANCEL_COPY",
    "CANCEL_COPY_ID",
    "DELIVERED",
    "HELD",
    "MAGIC",
    "MARKER",
    "PARKED",
    "PENDING",
    "SCHEDULED",
    "STATES",
    "WRITER_OWNED",
    "Copy",
    "JournalFold",
    "JournalRecord",
    "ScheduleInfo",
    "cancel_copy_record",
    "cancel_owner",
    "cancel_reaches",
    "decode_journal",
    "delivered_record",
    "encode_journal",
    "next_occurrence_record",
    "pack_journal",
    "parked_record",
    "refreshed_record",
]

SCHEDULED, DELIVERED, PARKED, CANCELLED = "scheduled", "delivered", "parked", "cancelled"
#: A reader's own record, written and read back to know it has read every record before.
MARKER = "marker"
#: A copy of one stream message of ``{prefix}.cancelled`` (its cancels and reschedules,
#: signed as they were), written once the stream confirmed it: a relay restores the
#: stream from these if it is deleted (``cancel_copy_record``). Not folded.
CANCEL_COPY = "cancel_copy"
#: The schedule id of every ``CANCEL_COPY`` record (no schedule's: ids are never empty),
#: so that a reading with ``only=CANCEL_COPY_ID`` decodes nothing else.
CANCEL_COPY_ID = ""
_OPS = frozenset({SCHEDULED, DELIVERED, PARKED, CANCELLED, MARKER, CANCEL_COPY})
_OP_NAMES = {op: op for op in _OPS}
_NOT_FOLDED = frozenset({MARKER, CANCEL_COPY})
#: Records whose ``user`` is their stream message's writer (``user_id``, which the broker
#: checked), set by the reader; the others' is the copy's owner (field ``usr``).
WRITER_OWNED = frozenset({CANCELLED, CANCEL_COPY})
#: The records about one copy of a message: they say its due time and target.
_COPY_OPS = frozenset({SCHEDULED, DELIVERED, PARKED})
#: ``ScheduleInfo.state`` values. ``held``: pending, and due within the hold window (a
#: relay holds it in-process, or will once its last hop returns).
PENDING, HELD = "pending", "held"
STATES = (PENDING, HELD, DELIVERED, CANCELLED, PARKED)
MAGIC = b"HJ1\n"
#: The magic of a body written compressed (``pack_journal``).
ZLIB_MAGIC = b"HJZ\n"
#: A body this long or longer is compressed (a marker, a lone record: not worth it).
COMPRESS_FROM_BYTES = 512
#: A compressed body that inflates beyond this is skipped (no record is that large: a
#: stream message is at most the broker's max message size, records per message 1,000).
MAX_INFLATED_BYTES = 512 * 2**20
_LENGTH = struct.Struct(">I")
#: A str as an ASCII JSON string (the json module's C encoder): a name a broker passed
#: with bytes that are not UTF-8 (kept as lone surrogates) reads back as it was.
_string = json.encoder.encode_basestring_ascii
_loads = json.JSONDecoder().decode


@dataclass(frozen=True, slots=True)
class Copy:
    """What a ``scheduled`` record keeps of the message, to issue it again.

    Attributes:
        properties: the encoded basic properties of its first hop (or of the hop a relay
            refreshed it at): the caller's properties and headers, and hopsched's.
        body: the body bytes, as the caller gave them.
    """

    properties: bytes
    body: bytes


@dataclass(slots=True)  # not frozen: a relay makes one per delivery (half the cost)
class JournalRecord:
    """One record of the journal (treat it as read-only).

    Attributes:
        op: ``SCHEDULED``, ``DELIVERED``, ``PARKED``, ``CANCELLED`` or a reader's
            ``MARKER``.
        schedule_id: the schedule it is about.
        at_us: when it was written, µs since the epoch (the writer's clock).
        created_us: the copy it is about (its ``x-hopsched-created``); for a cancel, the
            copies created at or before it are taken (its own instant).
        due_us: the copy's due time, µs since the epoch; None for a cancel.
        exchange, routing_key: the target; None for a cancel.
        size: the body's length, bytes; None for a cancel.
        owner: the signing key id of the copy's envelope (None: unsigned). For a
            cancel, whose copies it reaches (``cancel_reaches``): the canceller's key
            ids, comma-separated; ``""``: unsigned copies only; None (written before
            cancels said): every copy.
        reason: a ``PARKED`` record's reason (the parked message's reason header).
        origin: a ``SCHEDULED`` record's cause: ``"schedule"``, ``"replace"``,
            ``"reschedule"`` or ``"refresh"`` (a relay wrote it anew, same copy).
        copy: a ``SCHEDULED`` record's copy of the message; None otherwise.
        occurrence: a recurring schedule's occurrence (1, 2, ...) the record is about;
            0 for a one-shot message. Its occurrences share one created time, so a copy
            is its created time and its occurrence.
        user: the RabbitMQ user the copy is owned by (its ``x-hopsched-owner``; None:
            unknown). For a cancel (``WRITER_OWNED``), the user that wrote it: its stream
            message's ``user_id``, set by the reader (``read_journal``).
    """

    op: str
    schedule_id: str
    at_us: int
    created_us: int
    due_us: int | None = None
    exchange: str | None = None
    routing_key: str | None = None
    size: int | None = None
    owner: str | None = None
    reason: str | None = None
    origin: str | None = None
    copy: Copy | None = field(default=None, repr=False)
    occurrence: int = 0
    user: str | None = None


def encode_journal(records: Iterable[JournalRecord]) -> bytes:
    """Records as one stream message's body (the layout in the module's doc).

    The JSON is built by hand (a relay encodes one per delivery): keys in a fixed order,
    strings escaped by the json module's own encoder (ASCII), unset fields left out.
    """
    parts = [MAGIC]
    for r in records:
        meta = [
            '{"op":', _string(r.op), ',"id":', _string(r.schedule_id),
            ',"at":', str(r.at_us), ',"c":', str(r.created_us),
        ]  # fmt: skip
        if r.due_us is not None:
            meta += (',"due":', str(r.due_us))
        for key, text in (
            (',"ex":', r.exchange),
            (',"rk":', r.routing_key),
            (',"kid":', r.owner),
            (',"why":', r.reason),
            (',"by":', r.origin),
            (',"usr":', None if r.op in WRITER_OWNED else r.user),
        ):
            if text is not None:
                meta += (key, _string(text))
        if r.size is not None:
            meta += (',"size":', str(r.size))
        if r.occurrence:
            meta += (',"occ":', str(r.occurrence))
        if r.copy is not None:
            meta.append(',"copy":true')
        meta.append("}")
        encoded = "".join(meta).encode("ascii")
        parts += (_LENGTH.pack(len(encoded)), encoded)
        if r.copy is not None:
            parts += (_LENGTH.pack(len(r.copy.properties)), r.copy.properties)
            parts += (_LENGTH.pack(len(r.copy.body)), r.copy.body)
    return b"".join(parts)


#: Bodies up to this size are deflated with a small window (``_deflate``).
_SMALL_DEFLATE_BYTES = 4096


def pack_journal(records: Iterable[JournalRecord]) -> bytes:
    """Records as one stream message's body, compressed (zlib, level 1: a few µs per
    kilobyte) when that is shorter: a batch's records repeat their field names, targets
    and hopsched's headers, and take a third to a half of the room (docs/design.md)."""
    body = encode_journal(records)
    if len(body) < COMPRESS_FROM_BYTES:
        return body
    packed = ZLIB_MAGIC + _deflate(memoryview(body)[len(MAGIC) :])
    return packed if len(packed) < len(body) else body


def _deflate(data: memoryview) -> bytes:
    """zlib, level 1. Up to 4 KiB (a lone ``schedule()``'s record) with a 4 KiB window
    and the smallest hash table: zlib's default state is ~260 KiB to set up, which cost
    160 µs per record here against 11 µs, for the same output size (any zlib inflater
    reads it: the window is in the stream's header)."""
    if len(data) > _SMALL_DEFLATE_BYTES:
        return zlib.compress(data, 1)
    deflater = zlib.compressobj(1, zlib.DEFLATED, 12, 1)
    return deflater.compress(data) + deflater.flush()


def _inflated(body: bytes) -> bytes:
    """A ``ZLIB_MAGIC`` body as the plain layout; b"" if it does not inflate (noise,
    cut short, or larger than ``MAX_INFLATED_BYTES``)."""
    inflater = zlib.decompressobj()
    try:
        inflated = inflater.decompress(memoryview(body)[len(ZLIB_MAGIC) :], MAX_INFLATED_BYTES)
    except zlib.error:
        return b""
    if inflater.unconsumed_tail or not inflater.eof:
        return b""
    return MAGIC + inflated


def decode_journal(
    body: bytes, *, copies: bool = True, only: str | None = None
) -> Iterator[JournalRecord]:
    """The records of one stream message's body, in order.

    Args:
        body: the stream message's body.
        copies: keep each record's copy of the message (False: drop it, for a listing
            that holds many records at once).
        only: yield only the records of this schedule id (the others are skipped
            without decoding their copies).

    A body without the magic yields nothing; a record that cannot be read ends the
    message's reading (its length may be wrong too), what came before it is kept;
    a record whose fields are not as this version writes them is skipped.
    """
    if body.startswith(ZLIB_MAGIC):
        body = _inflated(body)
    if not body.startswith(MAGIC):
        return
    if only is not None and _id_field(only) not in body:
        return  # no record of it here, as encode_journal writes ids (get(): 4x faster)
    view = memoryview(body)
    offset, end = len(MAGIC), len(body)
    while offset < end:
        try:
            meta, offset = _part(view, offset, end)
            fields = _loads(str(meta, "utf-8"))
            copy = None
            if type(fields) is dict and fields.get("copy") is True:
                properties, offset = _part(view, offset, end)
                content, offset = _part(view, offset, end)
                if copies and (only is None or fields.get("id") == only):
                    copy = Copy(bytes(properties), bytes(content))
        except (ValueError, struct.error):
            return
        if type(fields) is not dict or (only is not None and fields.get("id") != only):
            continue
        record = _record(fields, copy)
        if record is not None:
            yield record


def _id_field(schedule_id: str) -> bytes:
    """``schedule_id``'s field as ``encode_journal`` writes it into a record's JSON."""
    return ('"id":' + _string(schedule_id)).encode("ascii")


def _part(view: memoryview, offset: int, end: int) -> tuple[memoryview, int]:
    (length,) = _LENGTH.unpack_from(view, offset)
    start = offset + _LENGTH.size
    if start + length > end:
        raise ValueError("a part runs past the end of the message")
    return view[start : start + length], start + length


def _record(fields: dict[str, Any], copy: Copy | None) -> JournalRecord | None:
    get = fields.get
    op, schedule_id, at_us, created_us = get("op"), get("id"), get("at"), get("c")
    op = _OP_NAMES.get(op) if type(op) is str else None  # the constant: one str, not one each
    if (
        op is None
        or type(schedule_id) is not str
        or type(at_us) is not int
        or type(created_us) is not int
    ):
        return None
    due, size, occurrence = get("due"), get("size"), get("occ")
    if any(v is not None and type(v) is not int for v in (due, size, occurrence)):
        return None
    texts = get("ex"), get("rk"), get("kid"), get("why"), get("by"), get("usr")
    for text in texts:
        if text is not None and type(text) is not str:
            return None
    # A listing holds one record per id: the few distinct targets, owners and origins
    # once each (a str per record was a third of a listing's memory).
    exchange, routing_key, owner, reason, origin, user = (
        None if text is None else sys.intern(text) for text in texts
    )
    if op in _COPY_OPS and (due is None or exchange is None or routing_key is None):
        return None
    return JournalRecord(
        op,
        schedule_id,
        at_us,
        created_us,
        due,
        exchange,
        routing_key,
        size,
        owner,
        reason,
        origin,
        copy,
        occurrence or 0,
        None if op in WRITER_OWNED else user,
    )


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """What the journal says of one schedule id (``Scheduler.get``).

    Attributes:
        schedule_id: the id.
        state: one of ``STATES``: ``pending`` (on the ladder), ``held`` (pending and due
            within the hold window: a relay holds it, or will once its last hop is
            back), ``delivered``, ``cancelled``, ``parked``.
        due_us: the due time of the newest copy, µs since the epoch (``due``: aware UTC).
        created_us: when that copy was scheduled, µs since the epoch (producer's clock).
        exchange, routing_key: its target.
        size: its body's length, bytes (None if no record said).
        owner: the signing key id of its envelope (None: unsigned).
        origin: how that copy came: ``"schedule"``, ``"replace"``, ``"reschedule"``,
            ``"recurring"`` (a relay scheduled this next occurrence) (None: only a
            relay's refresh record of it was read).
        occurrence: a recurring schedule's occurrence this is (its next, or its last
            once the chain ended); 0 for a one-shot schedule.
        pending_copies: how many messages of this id are pending, this one included
            (``get()``: 2 for an id scheduled twice without ``replace``, both delivered;
            None from a listing, which keeps only the newest).
        delivered_us, parked_us, cancelled_us: when it was delivered (the broker
            confirmed the final publish, relay's clock), parked, or cancelled (the
            cancel's instant); None if not.
        parked_reason: why it was parked.
        copy: the message, from which ``reschedule()`` issues it again; None if the
            journal holds no copy (only a relay's record was read, or it was read
            without copies).
        user: the RabbitMQ user that scheduled it (``x-hopsched-owner``; None:
            unknown): without keys, only that user's records (or a trusted user's)
            change it.
    """

    schedule_id: str
    state: str
    due_us: int
    created_us: int
    exchange: str
    routing_key: str
    size: int | None = None
    owner: str | None = None
    origin: str | None = None
    delivered_us: int | None = None
    parked_us: int | None = None
    cancelled_us: int | None = None
    parked_reason: str | None = None
    copy: Copy | None = field(default=None, repr=False, compare=False)
    occurrence: int = 0
    pending_copies: int | None = None
    user: str | None = None

    @property
    def due(self) -> datetime:
        """The due time, an aware UTC datetime."""
        return us_to_datetime(self.due_us)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (instants as ISO 8601 UTC strings and µs; no copy)."""

        def when(us: int | None) -> str | None:
            return None if us is None else us_to_datetime(us).isoformat()

        return {
            "schedule_id": self.schedule_id,
            "state": self.state,
            "due": when(self.due_us),
            "due_us": self.due_us,
            "created": when(self.created_us),
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "size": self.size,
            "owner": self.owner,
            "origin": self.origin,
            "delivered": when(self.delivered_us),
            "parked": when(self.parked_us),
            "parked_reason": self.parked_reason,
            "cancelled": when(self.cancelled_us),
            "occurrence": self.occurrence or None,
            "pending_copies": self.pending_copies,
            "user": self.user,
        }


def cancel_owner(key_ids: Sequence[str]) -> str:
    """A cancel's ``owner`` in the journal: the key ids its cancel stream records were
    signed with (``""``: unsigned)."""
    return ",".join(key_ids)


def cancel_reaches(
    cancel_owner: str | None,
    copy_owner: str | None,
    scope: str | None = None,
    copy_user: str | None = None,
) -> bool:
    """Whether a cancel written by ``cancel_owner`` (``JournalRecord.owner``) takes a copy
    signed by ``copy_owner`` and owned by ``copy_user``, as the relays decide
    (``hopsched.core.cancel``): a record reaches the messages its key signed; an
    unsigned one (``""``), by its ``scope`` (``writer_scope``), unsigned messages only.
    A cancel journaled before it said (None) takes every copy, as it was shown then."""
    if cancel_owner is None:
        return True
    if not cancel_owner:
        return reaches(scope, copy_owner, copy_user)
    return copy_owner is not None and copy_owner in cancel_owner.split(",")


class _Entry:
    """One id's fold so far: its newest copy's record, that copy's latest outcome, and
    the cancels (instant and owner): the first that takes the copy is shown."""

    __slots__ = ("cancels", "copy", "outcome")

    def __init__(self) -> None:
        self.copy: JournalRecord | None = None
        self.outcome: JournalRecord | None = None
        self.cancels: list[_Cancel] = []

    def cancelled_us(self, copy: JournalRecord) -> int | None:
        """When the first cancel that takes ``copy`` was made; None if none does."""
        return min(
            (
                at
                for at, owner, scope in self.cancels
                if at >= copy.created_us and cancel_reaches(owner, copy.owner, scope, copy.user)
            ),
            default=None,
        )


#: A cancel as the fold keeps it: its instant, ``owner`` and ``writer_scope``.
_Cancel = tuple[int, str | None, str | None]


_OUTCOME_RANK = {PARKED: 0, DELIVERED: 1}
#: A copy of these origins was followed by a cancel of its id's older copies (in the
#: cancel stream, at its created instant - 1 µs): ``JournalFold.pending_copies``.
_CANCELS_OLDER = frozenset({"replace", "reschedule"})


def _outcome_rank(record: JournalRecord) -> tuple[int, int, str]:
    """The latest outcome; at one instant a delivery over a park."""
    return (record.at_us, _OUTCOME_RANK[record.op], record.reason or "")


def _version(record: JournalRecord) -> tuple[int, int]:
    """Which copy a record is about: its created time, then its occurrence (a recurring
    schedule's occurrences share the created time; each is newer than the last)."""
    return (record.created_us, record.occurrence)


def _copy_rank(
    record: JournalRecord,
) -> tuple[tuple[int, int], bool, bool, int, int, str, str, str]:
    """The newest copy first; of one copy's records, one with the message's copy, then
    a producer's (it has the origin), then the latest (then any order, but always the
    same: the fold must not depend on the order it reads in, so the origin and user
    too)."""
    return (
        _version(record),
        record.copy is not None,
        record.origin is not None and record.origin != "refresh",
        record.at_us,
        record.due_us or 0,
        record.op,
        record.origin or "",
        record.user or "",
    )


#: Numbers a column holds (``array('q')``) are above ``_UNSET`` and at most ``_INT64_MAX``;
#: a record with one outside is kept as it is. ``_at`` is ``_UNSET`` in a row not filled yet.
_UNSET, _INT64_MAX = -(2**63), 2**63 - 1
#: The columns of a row not filled yet (created, at, due, occurrence, size, strings).
_UNSET_ROW = (0, _UNSET, 0, 0, 0, 0, 0, 0, 0, 0)
#: A listing's sort key is ``due << _ROW_BITS | row`` (one int per pending id, no tuple).
_ROW_BITS = 32
_ROW_MASK = 2**_ROW_BITS - 1


class JournalFold:
    """The journal's records folded by schedule id, in any order.

    Args:
        only: fold only this id's records (the others are ignored).
        trusted: users whose unsigned cancels take every unsigned copy
            (``Settings.trusted_users``), as the relays are told.

    Memory: each id read has a row (``IdTable``). While an id's records are only
    ``scheduled`` records without a copy (a pending id, read by a listing), its newest
    one lives in the fold's columns: one ``array`` per field, its strings by index in one
    table: 127 bytes with its id (32 characters), measured over 300,000 (4 of them its
    user's column), where a dict of id strings to packed bytes took 218
    (``benchmarks/results/journal/pending.md``). Any
    other id's row has an object: its newest copy's record, or an entry (three
    references) once an outcome or a cancel of it was read. An id is never dropped: a
    record read later (the fold does not depend on the order) must find its state.
    """

    #: A listing sorts its rows in passes of about this many, each a range of due times
    #: (``_due_ranges``): one int per row at once, for a million rows, was 44 MB.
    SORT_PASS = 2**17

    def __init__(self, only: str | None = None, *, trusted: Collection[str] = ()) -> None:
        self.only = only
        self.trusted = frozenset(trusted)
        self._ids = IdTable()
        #: A row's newest ``scheduled`` record while it is alone (no copy, numbers that
        #: fit): created, at, due (µs), occurrence, size (-1: None), and the indices of
        #: its exchange, routing key, owner, origin and user in ``_strings``.
        self._created, self._at, self._due = array("q"), array("q"), array("q")
        self._occurrence, self._size = array("q"), array("q")
        self._exchange, self._routing_key = array("I"), array("I")
        self._owner, self._origin, self._user = array("I"), array("I"), array("I")
        self._columns = (
            self._created, self._at, self._due, self._occurrence, self._size,
            self._exchange, self._routing_key, self._owner, self._origin, self._user,
        )  # fmt: skip
        self._strings: list[str | None] = [None]
        self._string_index: dict[str | None, int] = {None: 0}
        #: The rows whose state is an object (their columns are left as they were).
        self._objects: dict[int, _Entry | JournalRecord] = {}
        #: With ``only``: every copy of it read (its version), whether it had an
        #: outcome, its owner and user, and every cancel (``pending_copies``).
        self._copies: dict[tuple[int, int], tuple[bool, str | None, str | None]] = {}
        self._cancels: list[_Cancel] = []

    def __len__(self) -> int:
        return len(self._ids)

    def apply(self, record: JournalRecord) -> None:
        """Fold one record in (a marker or a cancel stream's copy is ignored)."""
        if record.op in _NOT_FOLDED or (self.only is not None and record.schedule_id != self.only):
            return
        if self.only is not None:
            if record.op == CANCELLED:
                self._cancels.append(self._cancel(record))
            else:
                if record.origin in _CANCELS_OLDER:  # its cancel went to the cancel stream
                    self._cancels.append(self._older_cancelled(record))
                version = _version(record)
                finished, owner, user = self._copies.get(
                    version, (False, record.owner, record.user)
                )
                self._copies[version] = (finished or record.op != SCHEDULED, owner, user)
        row, new = self._ids.add(record.schedule_id)
        entry = None
        if new:
            values = self._row_values(record) if record.op == SCHEDULED else None
            for column, value in zip(self._columns, values or _UNSET_ROW, strict=True):
                column.append(value)
            if values is not None:
                return
        else:
            entry = self._entry_at(row)
        if entry is None or isinstance(entry, JournalRecord):
            if record.op == SCHEDULED:  # an id with copies only: its newest is all there is
                if entry is None or _copy_rank(record) > _copy_rank(entry):
                    self._keep(row, record)
                return
            plain, entry = entry, _Entry()
            entry.copy = plain
            self._objects[row] = entry
        if record.op == CANCELLED:
            entry.cancels.append(self._cancel(record))
            return
        copy = entry.copy
        version = _version(record)
        if copy is None or version > _version(copy):
            entry.copy = record
            if entry.outcome is not None and _version(entry.outcome) < version:
                entry.outcome = None  # an older copy's outcome
        elif version == _version(copy) and _copy_rank(record) > _copy_rank(copy):
            entry.copy = record
        current = version if copy is None else max(_version(copy), version)
        if record.op == SCHEDULED or version != current:
            return
        outcome = entry.outcome
        if outcome is None or _outcome_rank(record) > _outcome_rank(outcome):
            entry.outcome = record

    def _cancel(self, record: JournalRecord) -> _Cancel:
        return record.at_us, record.owner, writer_scope(record.user, self.trusted)

    def _older_cancelled(self, record: JournalRecord) -> _Cancel:
        """The cancel a ``replace`` or ``reschedule`` wrote for the older copies of its id
        (at its created instant - 1 µs), by the copy's user; signed: every copy, as
        before cancels said whose they were."""
        if record.owner is not None:
            return record.created_us - 1, None, None
        return record.created_us - 1, "", None if record.user is None else user_scope(record.user)

    def info(self, schedule_id: str, now_us: int, hold_window_us: int) -> ScheduleInfo | None:
        """What is known of ``schedule_id`` at ``now_us`` (µs since the epoch), None if no
        record of a copy of it was read (a cancel alone does not make an id known)."""
        row = self._ids.find(schedule_id)
        if row < 0:
            return None
        entry = self._entry_at(row)
        assert entry is not None
        return _info(schedule_id, entry, now_us, hold_window_us)

    def pending(
        self,
        due_before_us: int | None = None,
        routing_key: str | None = None,
        limit: int | None = None,
    ) -> Iterator[str]:
        """The ids of every pending (or held) schedule, due before ``due_before_us`` and
        with ``routing_key`` if given, in due order (then by id), at most ``limit``;
        ``due_us(id)`` gives each one's due time.

        Each id is made as it is yielded: what is held meanwhile is one int per pending
        id (its due time and row), about 44 bytes (a million: 44 MB; a list of ids was
        89, of (due, id) tuples 160).
        """
        for row in self._pending_rows(due_before_us, routing_key, limit):
            yield self._ids.id_at(row)

    def pending_infos(
        self,
        now_us: int,
        hold_window_us: int,
        due_before_us: int | None = None,
        routing_key: str | None = None,
        limit: int | None = None,
    ) -> Iterator[ScheduleInfo]:
        """``info()`` of each id ``pending()`` lists, in its order (no look-up by id)."""
        for row in self._pending_rows(due_before_us, routing_key, limit):
            entry = self._entry_at(row)
            assert entry is not None
            info = _info(self._ids.id_at(row), entry, now_us, hold_window_us)
            assert info is not None
            yield info

    def _pending_rows(
        self, due_before_us: int | None, routing_key: str | None, limit: int | None
    ) -> Iterator[int]:
        """The rows ``pending()`` lists, in its order."""
        if limit == 0:
            return
        # A routing key's index in the columns' strings (-1: no row in the columns has it).
        wanted = None if routing_key is None else self._string_index.get(routing_key, -1)
        dues, rows = array("q"), array("L")  # the listed rows and their due times
        objects = self._objects
        for row, (due, target) in enumerate(zip(self._due, self._routing_key, strict=True)):
            if row in objects:
                copy = _pending_copy(objects[row])
                if copy is None or copy.due_us is None:
                    continue
                due, matches = copy.due_us, routing_key in (None, copy.routing_key)
            else:
                matches = wanted is None or target == wanted
            if matches and (due_before_us is None or due < due_before_us):
                dues.append(due)
                rows.append(row)
        # Only the rows due no later than the limit-th: its ties too, ordered by id below.
        last = heapq.nsmallest(limit, dues)[-1] if limit is not None and limit < len(dues) else None
        listed = 0
        for low, high in _due_ranges(dues, self.SORT_PASS):
            if last is not None:
                if low > last:
                    return
                high = min(high, last + 1)
            keys = [
                due << _ROW_BITS | row
                for due, row in zip(dues, rows, strict=True)
                if low <= due < high
            ]
            keys.sort()
            for row in self._by_id_within_due(keys):
                yield row
                listed += 1
                if listed == limit:
                    return

    def _by_id_within_due(self, keys: list[int]) -> Iterator[int]:
        """The rows of sorted ``keys`` (by due, then row), rows due at one instant by id."""
        tied: list[int] = []  # the rows due at one instant: rarely more than one
        tied_due = None
        for key in keys:
            due = key >> _ROW_BITS
            if due != tied_due:
                yield from self._by_id(tied)
                tied.clear()
                tied_due = due
            tied.append(key & _ROW_MASK)
        yield from self._by_id(tied)

    def _by_id(self, rows: list[int]) -> list[int]:
        if len(rows) > 1:  # their ids are made only to order them
            rows.sort(key=self._ids.id_at)
        return rows

    def pending_copies(self) -> int:
        """With ``only``: how many of its copies are pending (read, neither delivered nor
        parked, nor created at or before a cancel)."""
        return sum(
            1
            for (created_us, _), (finished, owner, user) in self._copies.items()
            if not finished
            and not any(
                at >= created_us and cancel_reaches(by, owner, scope, user)
                for at, by, scope in self._cancels
            )
        )

    def due_us(self, schedule_id: str) -> int | None:
        """The due time (µs since the epoch) of ``schedule_id``'s newest copy, None if
        no record of a copy of it was read."""
        row = self._ids.find(schedule_id)
        if row < 0:
            return None
        entry = self._objects.get(row)
        if entry is None:
            return self._due[row]
        copy = entry if isinstance(entry, JournalRecord) else entry.copy
        return None if copy is None else copy.due_us

    def infos(self, now_us: int, hold_window_us: int) -> Iterator[ScheduleInfo]:
        """Every known id's ``ScheduleInfo``, in no particular order."""
        for row in range(len(self._ids)):
            entry = self._entry_at(row)
            assert entry is not None
            info = _info(self._ids.id_at(row), entry, now_us, hold_window_us)
            if info is not None:
                yield info

    def _entry_at(self, row: int) -> _Entry | JournalRecord | None:
        """Row ``row``'s state: its object, or its columns as a record (None: a row just
        added, with nothing in it yet)."""
        entry = self._objects.get(row)
        if entry is not None or self._at[row] == _UNSET:
            return entry
        strings, size = self._strings, self._size[row]
        return JournalRecord(
            SCHEDULED, self._ids.id_at(row), self._at[row], self._created[row], self._due[row],
            strings[self._exchange[row]], strings[self._routing_key[row]],
            None if size < 0 else size, strings[self._owner[row]], None,
            strings[self._origin[row]], None, self._occurrence[row], strings[self._user[row]],
        )  # fmt: skip

    def _keep(self, row: int, record: JournalRecord) -> None:
        """``record`` as ``row``'s state: in its columns if it fits them, else as an object."""
        values = self._row_values(record)
        if values is None:
            self._objects[row] = record
            return
        self._objects.pop(row, None)
        for column, value in zip(self._columns, values, strict=True):
            column[row] = value

    def _row_values(self, record: JournalRecord) -> tuple[int, ...] | None:
        """A ``scheduled`` record's values for the columns, None if it does not fit them:
        it holds a copy, or a number a column cannot carry (a record a hopsched did not
        write)."""
        due, size = record.due_us, -1 if record.size is None else record.size
        numbers = (record.created_us, record.at_us, due or 0, record.occurrence, size)
        if (
            record.copy is not None
            or due is None
            or (record.size or 0) < 0
            or min(numbers) <= _UNSET  # the lowest int64 marks a row not filled yet
            or max(numbers) > _INT64_MAX
        ):
            return None
        string = self._string
        return (
            *numbers, string(record.exchange), string(record.routing_key),
            string(record.owner), string(record.origin), string(record.user),
        )  # fmt: skip

    def _string(self, text: str | None) -> int:
        at = self._string_index.get(text)
        if at is None:
            at = self._string_index[text] = len(self._strings)
            self._strings.append(text)
        return at


def _due_ranges(dues: Sequence[int], per_range: int) -> Iterator[tuple[float, float]]:
    """Ranges [low, high) of due times, in order, that cover every one of ``dues`` and
    hold about ``per_range`` of them each (bounds from a sorted sample of 64 a range)."""
    step = max(1, per_range // 64)
    every = max(1, per_range // step)  # samples a range
    sample = sorted(dues[::step])
    bounds = sorted(set(sample[every::every]))
    yield from itertools.pairwise([-math.inf, *bounds, math.inf])


def _pending_copy(entry: _Entry | JournalRecord) -> JournalRecord | None:
    """An id's newest copy if it is pending (or held): no outcome, not cancelled."""
    if isinstance(entry, JournalRecord):
        return entry
    copy = entry.copy
    if copy is None or entry.outcome is not None:
        return None
    if entry.cancels and entry.cancelled_us(copy) is not None:
        return None
    return copy


def _info(
    schedule_id: str, entry: _Entry | JournalRecord, now_us: int, hold_window_us: int
) -> ScheduleInfo | None:
    copy: JournalRecord | None
    if isinstance(entry, JournalRecord):
        copy, outcome, cancelled = entry, None, None
    else:
        copy, outcome = entry.copy, entry.outcome
        # The first cancel that took this copy (a second cancel does not move it: a
        # trial's get() showed a cancel a minute after the due time for one made in time).
        cancelled = entry.cancelled_us(copy) if copy is not None else None
    if copy is None:  # a cancel alone does not make an id known
        return None
    assert copy.due_us is not None
    assert copy.exchange is not None
    assert copy.routing_key is not None
    delivered = parked = reason = None
    if outcome is not None and outcome.op == DELIVERED:
        state, delivered = DELIVERED, outcome.at_us
    elif outcome is not None:
        state, parked, reason = PARKED, outcome.at_us, outcome.reason
    elif cancelled is not None:
        state = CANCELLED
    elif copy.due_us - now_us <= hold_window_us:
        state = HELD
    else:
        state = PENDING
    return ScheduleInfo(
        schedule_id,
        state,
        copy.due_us,
        copy.created_us,
        copy.exchange,
        copy.routing_key,
        copy.size if copy.size is not None else (outcome.size if outcome else None),
        copy.owner,
        copy.origin if copy.origin != "refresh" else None,
        delivered,
        parked,
        cancelled if state == CANCELLED else None,
        reason,
        copy.copy,
        copy.occurrence,
        user=copy.user,
    )


def cancel_copy_record(body: bytes, at_us: int) -> JournalRecord:
    """A ``CANCEL_COPY`` record: ``body``, one stream message of ``{prefix}.cancelled``
    (``hopsched.core.cancel.encode_records``), which the stream confirmed by ``at_us``
    (µs since the epoch, the writer's clock)."""
    return JournalRecord(CANCEL_COPY, CANCEL_COPY_ID, at_us, at_us, copy=Copy(b"", body))


def delivered_record(envelope: Envelope, size: int, at_us: int) -> JournalRecord:
    """A relay's record that the broker confirmed ``envelope``'s final publish at
    ``at_us`` (µs since the epoch, relay's clock); ``size``: the body's bytes."""
    return _relay_record(DELIVERED, envelope, size, at_us)


def parked_record(envelope: Envelope, size: int, at_us: int, reason: str) -> JournalRecord:
    """A relay's record that it parked ``envelope``'s message, confirmed at ``at_us``."""
    return _relay_record(PARKED, envelope, size, at_us, reason=reason)


def next_occurrence_record(envelope: Envelope, size: int, at_us: int) -> JournalRecord:
    """A relay's record that it scheduled a recurring schedule's next occurrence
    (``envelope``; the broker confirmed it at ``at_us``). No copy: the schedule's first
    record has the message."""
    return _relay_record(SCHEDULED, envelope, size, at_us, origin="recurring")


def refreshed_record(
    envelope: Envelope, properties: bytes, body: bytes, at_us: int
) -> JournalRecord:
    """A relay's ``scheduled`` record anew for a message it hopped on a long step
    (``ladder.REFRESH_STEP_MS``), with the hop's encoded ``properties`` as its copy."""
    return _relay_record(
        SCHEDULED, envelope, len(body), at_us, origin="refresh", copy=Copy(properties, body)
    )


def ingested_record(
    envelope: Envelope, properties: bytes, body: bytes, at_us: int
) -> JournalRecord:
    """A relay's ``scheduled`` record for a message it took from an ingress
    (``hopsched.core.ingress``), with its encoded ``properties`` as its copy."""
    return _relay_record(
        SCHEDULED, envelope, len(body), at_us, origin="ingress", copy=Copy(properties, body)
    )


def _relay_record(
    op: str,
    envelope: Envelope,
    size: int,
    at_us: int,
    *,
    reason: str | None = None,
    origin: str | None = None,
    copy: Copy | None = None,
) -> JournalRecord:
    return JournalRecord(
        op,
        envelope.schedule_id,
        at_us,
        envelope.created_us,
        envelope.due_us,
        envelope.exchange,
        envelope.routing_key,
        size,
        envelope.owner,
        reason,
        origin,
        copy,
        envelope.occurrence,
        envelope.user,
    )
