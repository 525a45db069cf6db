"""Signed envelopes and records: canonical bytes and HMAC-SHA256. Pure: no I/O, no clock.

A producer holding a signing key (``Settings.signing_keys``) signs every envelope it
schedules and every cancel or reschedule record it writes; a relay holding the same key
verifies them. The MAC is HMAC-SHA256 (RFC 2104, Python's ``hmac``) over *canonical
bytes*: a domain tag, the key id, the prefix and the content fields, each written as its
length (4 bytes, big-endian) then its bytes, so that no two different contents encode
alike. Integers are written in decimal ASCII, text in UTF-8, an absent value as no
bytes. docs/security.md gives the layout and test vectors, for other languages.

* An envelope's MAC covers its schedule id, created and due times, target exchange and
  routing key, the caller's ``expiration`` and the SHA-256 of the body; it travels in
  header ``x-hopsched-signature`` as ``KEY-ID:HEX-MAC``.
* A record's MAC covers its op, schedule id, instant, due time and kind; it travels in
  the record's ``kid`` and ``mac`` fields.

A schedule belongs to the key that signed its envelope: a record changes it only if it
was signed with that same key (``Cancellations`` keys its records by signer). So a
producer signs each record with every key it holds (``Signatures.sign_records``): a
schedule signed with a key it is rotating out stays its own.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hopsched.core.cancel import Record
from hopsched.errors import InvalidSettingsError

if TYPE_CHECKING:  # at run time envelope.py's imports reach settings.py, which imports this
    from hopsched.core.envelope import Envelope

__all__ = [
    "BAD_SIGNATURE",
    "ENVELOPE_DOMAIN",
    "MIN_SECRET_BYTES",
    "RECORD_DOMAIN",
    "UNSIGNED",
    "Refusal",
    "Signatures",
    "SigningKey",
    "canonical",
    "envelope_bytes",
    "mac",
    "parse_signing_keys",
    "record_bytes",
]

#: The first field of every canonical encoding: what is signed, and the layout's version.
ENVELOPE_DOMAIN = b"hopsched-envelope-1"
RECORD_DOMAIN = b"hopsched-record-1"
#: The least secret a key may have, bytes (128 bits; 32, as ``secrets.token_urlsafe(32)``
#: makes, is what docs/security.md recommends).
MIN_SECRET_BYTES = 16
#: Why a signature is refused (``Refusal.kind``; the parked kinds of the same names).
UNSIGNED, BAD_SIGNATURE = "unsigned", "bad_signature"

_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HEX_MAC = re.compile(r"^[0-9a-f]{64}$")
_LENGTH = struct.Struct(">I").pack
_DIGEST_LENGTH = _LENGTH(hashlib.sha256().digest_size)


@dataclass(frozen=True, slots=True)
class SigningKey:
    """One key: its id (travels with every signature) and its secret (never shown).

    Attributes:
        key_id: 1-64 letters, digits, ``.``, ``_`` or ``-``, e.g. ``2026-12``.
        secret: at least ``MIN_SECRET_BYTES`` bytes.
    """

    key_id: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key_id, str) or not _KEY_ID.match(self.key_id):
            raise InvalidSettingsError(
                f"signing key id {str(self.key_id)[:70]!r}: use 1-64 letters, digits, '.', '_' "
                "or '-'"
            )
        if not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES:
            raise InvalidSettingsError(
                f"signing key {self.key_id!r}: its secret must be at least {MIN_SECRET_BYTES} "
                "bytes (make one with: python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))')"
            )

    def __repr__(self) -> str:
        return f"SigningKey({self.key_id!r}, secret=***)"

    __str__ = __repr__

    @classmethod
    def parse(cls, text: str) -> SigningKey:
        """A key from ``KEY-ID:SECRET``, the secret in base64 (URL-safe or standard
        alphabet, padding optional), as ``HOPSCHED_SIGNING_KEYS`` lists them.

        Raises:
            InvalidSettingsError: naming the key id, never the secret.
        """
        key_id, sep, encoded = text.strip().partition(":")
        if not sep:
            raise InvalidSettingsError(
                "signing key: write KEY-ID:SECRET (the secret in base64, e.g. from "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        padded = encoded.strip().replace("+", "-").replace("/", "_")
        padded += "=" * (-len(padded) % 4)
        try:
            secret = base64.b64decode(padded, altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise InvalidSettingsError(
                f"signing key {key_id[:70]!r}: its secret is not base64"
            ) from None
        return cls(key_id, secret)


def parse_signing_keys(keys: Iterable[SigningKey | str]) -> tuple[SigningKey, ...]:
    """``Settings.signing_keys`` as keys: each a ``SigningKey`` or ``KEY-ID:SECRET`` text.

    Raises:
        InvalidSettingsError: a key does not parse, or two share a key id.
    """
    if isinstance(keys, str | bytes):  # one key is not its characters
        raise InvalidSettingsError("signing_keys: give a sequence of keys (KEY-ID:SECRET each)")
    parsed = tuple(key if isinstance(key, SigningKey) else SigningKey.parse(key) for key in keys)
    seen: set[str] = set()
    for key in parsed:
        if key.key_id in seen:
            raise InvalidSettingsError(f"signing_keys: key id {key.key_id!r} is given twice")
        seen.add(key.key_id)
    return parsed


def canonical(domain: bytes, *fields: str | int | bytes | None) -> bytes:
    """``domain`` then each field, each as its length (4 bytes, big-endian) and its bytes:
    text in UTF-8, an int in decimal ASCII, bytes as they are, None as no bytes."""
    parts = [_LENGTH(len(domain)), domain]
    for value in fields:
        if value is None:
            data = b""
        elif isinstance(value, bytes):
            data = value
        elif isinstance(value, int):
            data = str(value).encode()
        else:
            data = value.encode()
        parts += (_LENGTH(len(data)), data)
    return b"".join(parts)


def envelope_bytes(prefix: str, key_id: str, envelope: Envelope, body: bytes) -> bytes:
    """What an envelope's MAC covers (docs/security.md, "Canonical bytes"): ``canonical``
    of the domain, key id, prefix, schedule id, created and due times, exchange, routing
    key, expiration and the body's SHA-256; then, for an occurrence of a recurring
    schedule only, its rule (empty once its successor is scheduled), occurrence number and
    lineage (empty for the first)."""
    return canonical(ENVELOPE_DOMAIN, key_id, prefix) + _envelope_fields(envelope, body)


def _envelope_fields(envelope: Envelope, body: bytes) -> bytes:
    """The fields of ``envelope_bytes`` after the prefix, as ``canonical`` writes them:
    spelled out, as the relay checks every envelope it receives."""
    schedule_id = envelope.schedule_id.encode()
    created, due = b"%d" % envelope.created_us, b"%d" % envelope.due_us
    exchange, routing_key = envelope.exchange.encode(), envelope.routing_key.encode()
    expiration = b"" if envelope.expiration is None else envelope.expiration.encode()
    recurring = b""
    if envelope.rule is not None or envelope.occurrence:  # absent from one-shot envelopes
        rule = (envelope.rule or "").encode()
        occurrence = b"%d" % envelope.occurrence
        lineage = (envelope.lineage or "").encode()
        recurring = (
            b"".join(
                (_LENGTH(len(rule)), rule, _LENGTH(len(occurrence)), occurrence),
            )
            + _LENGTH(len(lineage))
            + lineage
        )
    return b"".join(
        (
            _LENGTH(len(schedule_id)), schedule_id,
            _LENGTH(len(created)), created,
            _LENGTH(len(due)), due,
            _LENGTH(len(exchange)), exchange,
            _LENGTH(len(routing_key)), routing_key,
            _LENGTH(len(expiration)), expiration,
            _DIGEST_LENGTH, hashlib.sha256(body).digest(),
        )
    ) + recurring  # fmt: skip


def record_bytes(prefix: str, key_id: str, record: Record) -> bytes:
    """What a record's MAC covers (docs/security.md, "Canonical bytes")."""
    return canonical(
        RECORD_DOMAIN,
        key_id,
        prefix,
        record.op,
        record.schedule_id,
        record.at_us,
        record.due_us,
        record.kind,
        *(() if record.reason is None else (record.reason,)),  # records before it had none
    )


def mac(key: SigningKey, data: bytes) -> str:
    """HMAC-SHA256 of ``data`` with ``key``, as 64 lowercase hex digits."""
    return hmac.digest(key.secret, data, "sha256").hex()


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a signature is not accepted: ``kind`` is ``UNSIGNED`` or ``BAD_SIGNATURE``;
    ``reason`` names the key id (never a secret) and the fix."""

    kind: str
    reason: str


class Signatures:
    """One process's signing keys for one prefix, and whether signatures are required.

    Args:
        keys: the first signs; every one verifies. None: nothing is signed and no
            signature is read (every envelope and record counts as unsigned).
        prefix: the ladder's prefix (part of what is signed: a signature holds on its
            own prefix only).
        required: refuse what is unsigned (parked envelopes, ignored records).

    Raises:
        InvalidSettingsError: ``required`` without keys.
    """

    __slots__ = ("_by_id", "_heads", "keys", "prefix", "required")

    def __init__(
        self, keys: Sequence[SigningKey] = (), prefix: str = "hopsched", *, required: bool = False
    ) -> None:
        if required and not keys:
            raise InvalidSettingsError(
                "require_signatures needs signing_keys (HOPSCHED_SIGNING_KEYS): the keys "
                "whose signatures this process accepts"
            )
        self.keys = tuple(keys)
        self.prefix = prefix
        self.required = required
        self._by_id = {key.key_id: key for key in self.keys}
        # per key, an HMAC that has taken the first three fields of envelope_bytes (they
        # never change): a relay copies it for each envelope it checks
        self._heads = {
            key.key_id: hmac.new(
                key.secret, canonical(ENVELOPE_DOMAIN, key.key_id, prefix), hashlib.sha256
            )
            for key in self.keys
        }

    def __repr__(self) -> str:
        ids = ", ".join(repr(key.key_id) for key in self.keys)
        return f"Signatures(keys=[{ids}], prefix={self.prefix!r}, required={self.required})"

    @property
    def enabled(self) -> bool:
        """True with keys: signatures are written and read."""
        return bool(self.keys)

    # --- envelopes ------------------------------------------------------------------------

    def sign_envelope(self, envelope: Envelope, body: bytes) -> Envelope:
        """``envelope`` signed with the first key (unchanged without keys)."""
        if not self.keys:
            return envelope
        return self._signed(envelope, body, self.keys[0])

    def _mac(self, key: SigningKey, envelope: Envelope, body: bytes) -> str:
        """``mac(key, envelope_bytes(...))``, from the key's HMAC of the first fields."""
        state = self._heads[key.key_id].copy()
        state.update(_envelope_fields(envelope, body))
        return state.hexdigest()

    def _signed(self, envelope: Envelope, body: bytes, key: SigningKey) -> Envelope:
        signature = f"{key.key_id}:{self._mac(key, envelope, body)}"
        return dataclasses.replace(envelope, signature=signature)

    def check_envelope(
        self, envelope: Envelope, body: bytes, *, verify_mac: bool = True
    ) -> Envelope | Refusal:
        """The envelope as it may be relayed, its ``owner`` the key id that verifies its
        signature (None: unsigned, accepted as signatures are not required), or why not.

        A signature that does not verify (an unknown key id, a MAC that does not match)
        is refused whether or not signatures are required: it is forged or altered.
        Without keys nothing is verified: the envelope comes back without its signature
        (its header stays), so that it counts as unsigned.

        Args:
            verify_mac: False: check all but the MAC (the relay's check at a hop, which
                only moves the message along the ladder; ``owner`` is then its claim).
        """
        if not self.keys:
            if envelope.signature is None:
                return envelope
            return dataclasses.replace(envelope, signature=None)
        signature = envelope.signature
        if signature is None:
            if self.required:
                return Refusal(
                    UNSIGNED,
                    "unsigned envelope, and this relay requires signatures "
                    "(require_signatures): schedule it with a Scheduler that holds a signing "
                    "key (signing_keys, HOPSCHED_SIGNING_KEYS)",
                )
            return envelope
        key_id, _, given = signature.rpartition(":")
        key = self._by_id.get(key_id)
        if key is None or len(given) != 64 or not given.isascii():  # compare_digest: ASCII
            return Refusal(BAD_SIGNATURE, _unknown(key_id, given, "envelope", _REPLAY))
        if verify_mac and not hmac.compare_digest(self._mac(key, envelope, body), given):
            return Refusal(
                BAD_SIGNATURE,
                f"its signature (key id {key_id!r}) does not match its content (schedule id, "
                "times, target, expiration, body) on this prefix: altered or forged",
            )
        return envelope

    def resigned(self, envelope: Envelope, body: bytes) -> Envelope:
        """A verified envelope whose content the relay changed (a reschedule moved its due
        time), signed again with the key that signed it; an unsigned one unchanged."""
        if envelope.owner is None:
            return envelope
        return self._signed(envelope, body, self._by_id[envelope.owner])

    # --- records --------------------------------------------------------------------------

    def sign_records(self, records: Iterable[Record]) -> list[Record]:
        """Each record once per key (unchanged without keys): signed with every key, so
        that it reaches the schedules signed with any of them."""
        if not self.keys:
            return list(records)
        return [
            dataclasses.replace(
                record,
                key_id=key.key_id,
                mac=mac(key, record_bytes(self.prefix, key.key_id, record)),
            )
            for record in records
            for key in self.keys
        ]

    def sign_as(self, record: Record, key_id: str | None) -> Record:
        """``record`` signed with the key ``key_id`` alone (a relay's lineage claim, with
        the key of the schedule it is about); unchanged for None (unsigned)."""
        if key_id is None or not self.keys:
            return record
        key = self._by_id[key_id]
        return dataclasses.replace(
            record, key_id=key_id, mac=mac(key, record_bytes(self.prefix, key_id, record))
        )

    def sign_notice(self, record: Record) -> Record:
        """A relay's own record (a notice) signed with the first key alone."""
        return self.sign_records([record])[0]

    def check_record(self, record: Record) -> Record | Refusal:
        """The record as it may be applied: ``key_id`` the key that verified it (the
        schedules of that key are the ones it may change), None if unsigned and accepted;
        or why not. Without keys every record counts as unsigned."""
        if not self.keys:
            if record.key_id is None and record.mac is None:
                return record
            return dataclasses.replace(record, key_id=None, mac=None)
        if record.key_id is None and record.mac is None:
            if self.required:
                return Refusal(UNSIGNED, "unsigned record, and signatures are required")
            return record
        key = self._by_id.get(record.key_id or "")
        given = record.mac or ""
        if key is None or not _HEX_MAC.match(given):
            return Refusal(BAD_SIGNATURE, _unknown(record.key_id or "", given, "record", ""))
        expected = mac(key, record_bytes(self.prefix, key.key_id, record))
        if not hmac.compare_digest(expected, given):
            return Refusal(
                BAD_SIGNATURE,
                f"record signature (key id {key.key_id!r}) does not match: altered or forged",
            )
        return record


_REPLAY = ": add that key to verify it, then replay it (hopsched parked replay)"


def _unknown(key_id: str, given: str, what: str, fix: str) -> str:
    if not _KEY_ID.match(key_id) or not _HEX_MAC.match(given):
        return f"{what} signature is not KEY-ID:MAC (a key id, ':', 64 lowercase hex digits)"
    return (
        f"{what} signed with key id {key_id!r}, which this process does not hold "
        f"(signing_keys, HOPSCHED_SIGNING_KEYS){fix}"
    )
