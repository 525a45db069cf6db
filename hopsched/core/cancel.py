"""Cancellations and reschedules: what every relay of a prefix has been told. Pure: no
I/O; the clock comes in as arguments.

``Scheduler.cancel`` and ``Scheduler.reschedule`` append records to the prefix's
stream ``{prefix}.cancelled`` (a RabbitMQ stream: replicated, read by every relay from
its start); each relay applies them to its ``Cancellations`` and asks it about every
message before every hop and before the final publish.

A record applies to the messages of its schedule id *created* (scheduled) before it,
by the clocks of the two producers: a message scheduled again with the same id after a
cancel is a new schedule and is delivered. A reschedule moves those messages to a new
due time.

A record changes only the schedules of its writer (``reaches``), its *scope*:

* signed (``hopsched.core.signing``): the messages whose envelope the same key signed;
* unsigned, written by RabbitMQ user U (the stream message's ``user_id``, which the
  broker checks against the login: https://www.rabbitmq.com/docs/validated-user-id):
  the unsigned messages U scheduled (``x-hopsched-owner``), and those whose owner is
  unknown (hand-made envelopes, the ingress, older versions);
* unsigned, by a trusted user (``Settings.trusted_users``): every unsigned message;
  with ``own`` (a relay's copy of another's record: a restore, a lineage claim), as if
  user ``own`` had written it (``""``: unknown; ``OWN_EVERY``: a trusted user);
* unsigned, without ``user_id``: the unsigned messages whose owner is unknown.

A relay keys each record by its scope and looks a message up under every scope that
reaches it.

Records are kept until their schedule can no longer come by. Until a relay has met
the message, that is ``retention_us`` after the record, which is at least the top step:
every pending message visits a relay at least that often, so it meets the record while
it is kept (a reschedule to a time further off is kept until that time too). Once a
relay has met the message, its due time is known: the record is kept until the later
of the message's and the record's due times, plus ``GRACE_US`` for copies a crash may
have left on the ladder.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "CANCEL",
    "EVERY",
    "GRACE_US",
    "HANDED_BACK",
    "LINEAGE",
    "MARKER",
    "NOTICES",
    "OWN_EVERY",
    "PARKED",
    "RESCHEDULE",
    "RESTORED",
    "Cancellations",
    "Record",
    "RecordTally",
    "decode_records",
    "encode_records",
    "lineage_generation",
    "reaches",
    "record_scope",
    "user_scope",
    "writer_scope",
]

CANCEL, RESCHEDULE = "cancel", "reschedule"
#: A record a relay writes and reads back to know it has read every record before it.
MARKER = "marker"
#: A relay's notice that it parked a message for its signature or its target (``kind``,
#: a ParkKind): read by ``hopsched status``, applied to nothing.
PARKED = "parked"
#: A relay's notice that it could not park a message and handed it back to the relay
#: queue, which dead-letters it into parking as it is: ``reason`` is why (the broker's
#: refusal), for ``hopsched parked list``, the parked copy having no room for it.
HANDED_BACK = "handed_back"
#: A relay's claim that a recurring schedule goes on, from the occurrence due at ``due``,
#: as lineage ``kind`` alone (docs/recurring.md, "Never forked"): written before the relay
#: acts on an occurrence delivered to it again, whose successor may exist already.
LINEAGE = "lineage"
#: A relay's notice that this stream holds again what the journal kept of the stream's
#: earlier records (``kind``: how many stream messages it copied back): a stream without
#: it was declared anew, and may lack cancels (``hopsched.journal.cancels``).
RESTORED = "restored"
_OPS = frozenset({CANCEL, RESCHEDULE, MARKER, PARKED, HANDED_BACK, LINEAGE, RESTORED})
#: Records that change no schedule: a relay applies none of them.
NOTICES = frozenset({MARKER, PARKED, HANDED_BACK, RESTORED})
#: How long past its due time a record is kept, µs: a relay crash can leave a second copy
#: of a message on the ladder, which must meet the record too.
GRACE_US = 3_600_000_000


@dataclass(frozen=True, slots=True)
class Record:
    """One cancel or reschedule (or a relay's marker or notice).

    Attributes:
        op: ``"cancel"``, ``"reschedule"``, a relay's ``"marker"`` or ``"parked"``.
        schedule_id: the schedule it applies to.
        at_us: when it was made, µs since the epoch (the canceller's clock): it applies
            to messages created before.
        due_us: a reschedule's new due time; a cancel's due time if the canceller knew it.
        kind: a ``"parked"`` notice's ParkKind; a ``"lineage"`` claim's lineage; None
            otherwise.
        key_id, mac: its signature (``hopsched.core.signing``): the signing key's id and the
            HMAC, 64 hex digits; None if unsigned.
        reason: a ``"handed_back"`` notice's reason; None otherwise.
        own: the user a trusted writer wrote it for (``""``: unknown); None otherwise.
        user: the RabbitMQ user that wrote it: its stream message's ``user_id``, set by
            the reader (never from the body); None if the message had none.
    """

    op: str
    schedule_id: str
    at_us: int
    due_us: int | None = None
    kind: str | None = None
    key_id: str | None = None
    mac: str | None = None
    reason: str | None = None
    own: str | None = None
    user: str | None = None


@dataclass
class RecordTally:
    """What a reading of ``{prefix}.cancelled`` met, by signature (a relay's, or
    ``hopsched status``'s).

    Attributes:
        signed: cancel and reschedule records whose signature verified.
        unsigned: those without a signature, accepted (signatures not required): they
            reach unsigned messages only.
        refused: records ignored, by why: ``"unsigned"`` (signatures required),
            ``"bad_signature"`` (forged, altered, or an unknown key), ``"relayed"``
            (stream messages a relay delivered there, counted per message).
        parked: relays' notices of messages parked for their signature or target, by
            ParkKind.
        checked: False if the reader held no keys: signatures were not verified, and
            ``signed`` counts the records that carry one.
        unrestored: True if the stream was declared anew and no relay has restored
            into it the journal's copies of its earlier records (``RESTORED``).
    """

    signed: int = 0
    unsigned: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    parked: Counter[str] = field(default_factory=Counter)
    checked: bool = True
    unrestored: bool = False

    def count(self, record: Record) -> None:
        """Count an accepted record (a verified one has its ``key_id``)."""
        if record.op == PARKED:
            self.parked[record.kind or "?"] += 1
        elif record.op == CANCEL or record.op == RESCHEDULE:
            if record.key_id is None:
                self.unsigned += 1
            else:
                self.signed += 1


def encode_records(records: Iterable[Record]) -> bytes:
    """Records as a stream message's body: one JSON object per line, with keys ``op``,
    ``id``, ``at``, ``due`` and, when set, ``kind``, ``kid``, ``mac``, ``why`` and
    ``own`` (``user`` travels as the message's ``user_id``)."""
    lines = []
    for r in records:
        fields: dict[str, object] = {
            "op": r.op,
            "id": r.schedule_id,
            "at": r.at_us,
            "due": r.due_us,
        }
        if r.kind is not None:
            fields["kind"] = r.kind
        if r.key_id is not None:
            fields["kid"] = r.key_id
        if r.mac is not None:
            fields["mac"] = r.mac
        if r.reason is not None:
            fields["why"] = r.reason
        if r.own is not None:
            fields["own"] = r.own
        lines.append(json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode())
    return b"".join(line + b"\n" for line in lines)


def decode_records(body: bytes, user: str | None = None) -> Iterator[Record]:
    """The records of a stream message's body, written by ``user`` (its ``user_id``);
    a line that is not one is skipped (a newer hopsched's record, or noise: a relay must
    never stop on its stream). Fields this version does not know are ignored."""
    for line in body.splitlines():
        try:
            fields = json.loads(line)
            record = Record(
                fields["op"],
                fields["id"],
                fields["at"],
                fields.get("due"),
                fields.get("kind"),
                fields.get("kid"),
                fields.get("mac"),
                fields.get("why"),
                fields.get("own"),
                user,
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if (
            record.op in _OPS
            and isinstance(record.schedule_id, str)
            and type(record.at_us) is int
            and (record.due_us is None or type(record.due_us) is int)
            and (record.op != RESCHEDULE or record.due_us is not None)
            and all(
                v is None or isinstance(v, str)
                for v in (record.kind, record.key_id, record.mac, record.reason, record.own)
            )
        ):
            yield record


def lineage_generation(lineage: str | None) -> int:
    """A lineage's generation: 0 for the first (None), else the number before its dot
    (``GEN.NONCE``; a relay claims generation + 1 of the copy it got again)."""
    if lineage is None:
        return 0
    head = lineage.partition(".")[0]
    return int(head) if head.isdigit() else 0


def _rank(lineage: str, claim: tuple[int, int]) -> tuple[int, int, str]:
    return claim[0], lineage_generation(lineage), lineage


#: The scope of a trusted user's record: every unsigned message.
EVERY = "\x02"
_USER = "\x01"
#: ``Record.own`` of a trusted user's record copied by a relay (no PLAIN login holds a
#: NUL: it names no user).
OWN_EVERY = "\x00every"


def user_scope(user: str) -> str:
    """The scope of an unsigned record by RabbitMQ user ``user``. It starts with a byte
    no key id holds (``[A-Za-z0-9._-]``), and PLAIN logins hold no NUL: no two coincide."""
    return _USER + user


def writer_scope(user: str | None, trusted: Collection[str]) -> str | None:
    """The scope of an unsigned record that RabbitMQ user ``user`` wrote (None: a
    message without ``user_id``), naming no ``own``."""
    if user is None:
        return None
    return EVERY if user in trusted else user_scope(user)


def record_scope(
    record: Record, trusted: Collection[str], relays: Collection[str] = ()
) -> str | None:
    """Whose messages a verified record reaches (the module's doc): a key id, a
    ``user_scope``, ``EVERY``, or None (those whose owner is unknown).

    Args:
        record: as ``Signatures.check_record`` returned it (``key_id`` verified).
        trusted: users whose records reach every unsigned message
            (``Settings.trusted_users``); their ``own`` is honoured.
        relays: users whose ``own`` is honoured too (a relay's own login: its restores
            and lineage claims), whose other records reach their own messages.
    """
    if record.key_id is not None:
        return record.key_id
    user = record.user
    if user is not None and record.own is not None and (user in trusted or user in relays):
        if record.own == OWN_EVERY:
            return EVERY
        return user_scope(record.own) if record.own else None
    return writer_scope(user, trusted)


def reaches(scope: str | None, owner: str | None, user: str | None) -> bool:
    """Whether a record of ``scope`` (``record_scope``) reaches a message whose envelope
    key ``owner`` signed (None: unsigned), scheduled by ``user`` (None: unknown)."""
    if owner is not None:
        return scope == owner
    if scope == EVERY:
        return True
    if user is None:
        return scope is None or scope.startswith(_USER)
    return scope == _USER + user


def _key(schedule_id: str, scope: str | None) -> bytes:
    """A record's or message's key: its scope (none: unowned) and its id. An unowned
    key starts with NUL, a scope never holds one: no two keys coincide."""
    if scope is None:
        return b"\0" + schedule_id.encode()
    return scope.encode() + b"\0" + schedule_id.encode()


class Cancellations:
    """The records a relay has read, by schedule id.

    Args:
        retention_us: how long a record whose schedule's due time is unknown is kept.
        trusted, relays: as ``record_scope``.

    Memory: a cancel no relay has met the message of (the common case) is one entry
    keyed by the id's UTF-8 bytes (after its signer's key id and a NUL) with its instant
    as the value, about 180 bytes for a 32-character id (``tests/unit/test_cancel_records.py``);
    the others keep a tuple.
    """

    def __init__(
        self,
        retention_us: int,
        *,
        trusted: Collection[str] = frozenset(),
        relays: Collection[str] = frozenset(),
    ) -> None:
        self.retention_us = retention_us
        self.trusted = frozenset(trusted)
        self.relays = frozenset(relays)
        # the scopes records were applied under: a message is looked up under these only
        self._scopes: set[str | None] = set()
        self._user_scopes: set[str] = set()
        self._cancelled: dict[bytes, int] = {}  # id -> when; no message met yet
        # id -> (op, when, the record's due time, kept until)
        self._timed: dict[bytes, tuple[str, int, int | None, int]] = {}
        # id -> {lineage: (due, when)}: the lineage claims read
        self._lineages: dict[bytes, dict[str, tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._cancelled) + len(self._timed) + len(self._lineages)

    def _known(self, key: bytes) -> tuple[str, int, int | None, int] | None:
        at = self._cancelled.get(key)
        if at is not None:
            return CANCEL, at, None, at + self.retention_us
        return self._timed.get(key)

    def _scopes_of(self, owner: str | None, user: str | None) -> list[str | None]:
        """The scopes whose records reach a message (``reaches``), of those applied."""
        if owner is not None:
            wanted: list[str | None] = [owner]
        elif user is not None:
            wanted = [_USER + user, EVERY]
        else:
            wanted = [None, EVERY, *self._user_scopes]
        return [scope for scope in wanted if scope in self._scopes]

    def _scope(self, record: Record) -> str | None:
        scope = record_scope(record, self.trusted, self.relays)
        self._scopes.add(scope)
        if scope is not None and scope.startswith(_USER):
            self._user_scopes.add(scope)
        return scope

    def apply(self, record: Record) -> None:
        """Add a verified record (``Signatures.check_record``, ``user`` set by the
        reader): it applies to the messages of its id in its scope (``record_scope``).
        Of two for one id and scope, the later one (by ``at_us``) stands. A marker or a
        notice is none of its business. Lineage claims are all kept (``superseded``)."""
        if record.op == LINEAGE:
            if record.due_us is not None and record.kind:
                key = _key(record.schedule_id, self._scope(record))
                claims = self._lineages.setdefault(key, {})
                claim = (record.due_us, record.at_us)  # (one lineage claimed twice: the later)
                claims[record.kind] = max(claims.get(record.kind, claim), claim)
            return
        if record.op != CANCEL and record.op != RESCHEDULE:
            return
        key = _key(record.schedule_id, self._scope(record))
        known = self._known(key)
        if known is not None and record.at_us < known[1]:
            return
        self._cancelled.pop(key, None)
        self._timed.pop(key, None)
        if record.due_us is None:  # a cancel by id alone
            self._cancelled[key] = record.at_us
        elif record.op == CANCEL:  # the canceller knew the due time (and a reschedule's)
            due = max(record.due_us, known[2] or 0) if known else record.due_us
            self._timed[key] = (CANCEL, record.at_us, record.due_us, due + GRACE_US)
        else:  # a reschedule: kept for its message's next visit, and past its own due time
            until = max(record.at_us + self.retention_us, record.due_us + GRACE_US)
            self._timed[key] = (RESCHEDULE, record.at_us, record.due_us, until)

    def verdict(
        self,
        schedule_id: str,
        created_us: int,
        due_us: int,
        owner: str | None,
        user: str | None = None,
    ) -> str | int | None:
        """What applies to a message created at ``created_us`` and due at ``due_us``,
        whose envelope the key ``owner`` signed (None: unsigned), scheduled by ``user``
        (None: unknown): ``CANCEL``, a new due time (µs), or None. Of the records in
        scopes that reach it, the latest stands.

        The record learns the message's due time here, so that it is forgotten once
        that (and a reschedule's own due time) has passed.
        """
        if not self._cancelled and not self._timed:
            return None
        best: tuple[bytes, tuple[str, int, int | None, int]] | None = None
        for scope in self._scopes_of(owner, user):
            key = _key(schedule_id, scope)
            known = self._known(key)
            if (
                known is not None
                and known[1] >= created_us
                and (best is None or known[1] > best[1][1])
            ):
                best = key, known
        if best is None:
            return None
        key, (op, at, record_due, _) = best
        until = max(due_us, record_due or 0) + GRACE_US
        self._cancelled.pop(key, None)
        self._timed[key] = (op, at, record_due, until)
        if op == CANCEL:
            return CANCEL
        return record_due if record_due != due_us else None

    def superseded(
        self,
        schedule_id: str,
        owner: str | None,
        due_us: int,
        lineage: str | None,
        user: str | None = None,
    ) -> bool:
        """Whether a recurring occurrence due at ``due_us`` of lineage ``lineage`` (None:
        the first) is a copy another lineage replaced.

        Of a schedule's claims the winner is the greatest by (due time, generation,
        lineage): every relay that has read them picks the same one, and each claimed
        lineage had a live copy when it was claimed. A copy is replaced if the winner is
        of another lineage, claimed at or before its occurrence, and its own lineage is
        the first or ranks below the winner. A lineage whose claim this relay has not read
        yet is kept: at worst a duplicate, never a chain lost."""
        if not self._lineages:
            return False
        claims: dict[str, tuple[int, int]] = {}
        for scope in self._scopes_of(owner, user):
            for token, claim in self._lineages.get(_key(schedule_id, scope), {}).items():
                claims[token] = max(claims.get(token, claim), claim)
        if not claims:
            return False
        winner = max(claims, key=lambda token: _rank(token, claims[token]))
        if lineage == winner or due_us < claims[winner][0]:
            return False
        return lineage is None or lineage in claims

    def forget(self, now_us: int) -> int:
        """Drop the records no message can meet any more; returns how many."""
        horizon = now_us - self.retention_us
        lineages = 0
        for key, claims in list(self._lineages.items()):
            old = [token for token, (_, at) in claims.items() if at < horizon]
            for token in old:
                del claims[token]
            lineages += len(old)
            if not claims:
                del self._lineages[key]
        stale = [key for key, at in self._cancelled.items() if at < horizon]
        for key in stale:
            del self._cancelled[key]
        timed = [key for key, (_, _, _, until) in self._timed.items() if until < now_us]
        for key in timed:
            del self._timed[key]
        return len(stale) + len(timed) + lineages
