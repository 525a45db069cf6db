"""Signed envelopes and records (``hopsched.core.signing``): the canonical bytes and test
vectors of docs/security.md, verification, rotation, and keys never shown. Pure."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import hopsched
from hopsched.core.cancel import CANCEL, PARKED, RESCHEDULE, Record, decode_records, encode_records
from hopsched.core.envelope import Envelope
from hopsched.core.signing import (
    BAD_SIGNATURE,
    ENVELOPE_DOMAIN,
    UNSIGNED,
    Refusal,
    Signatures,
    SigningKey,
    canonical,
    envelope_bytes,
    mac,
    parse_signing_keys,
    record_bytes,
)

SECURITY_MD = (Path(__file__).parents[2] / "docs" / "security.md").read_text()

# --- the test vectors of docs/security.md ----------------------------------------------------

VECTOR_KEY = SigningKey("2026-12", bytes(range(32)))
VECTOR_KEY_TEXT = "2026-12:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"
VECTOR_ENVELOPE = Envelope(
    "order-42-timeout",
    due_us=1_798_763_400_000_000,  # 2027-01-01T00:30:00Z
    exchange="orders",
    routing_key="timeout",
    created_us=1_798_761_600_000_000,  # 2027-01-01T00:00:00Z
)
VECTOR_BODY = b'{"order": 42}'
VECTOR_ENVELOPE_BYTES = (
    "00000013686f7073636865642d656e76656c6f70652d3100000007323032362d313200000008686f70736368"
    "6564000000106f726465722d34322d74696d656f7574000000103137393837363136303030303030303000000010"
    "31373938373633343030303030303030000000066f72646572730000000774696d656f75740000000000000020"
    "7522daf3f873864644b93416b89a4294f1b73dcbdffb1d5e38c9eff311be6ee9"
)
VECTOR_ENVELOPE_MAC = "0e0140b23681cd7a45a0ed3bbdba072449aab939caa6c980dea717d8601df9fc"
VECTOR_CANCEL = Record(CANCEL, "order-42-timeout", 1_798_762_500_000_000)
VECTOR_CANCEL_BYTES = (
    "00000011686f7073636865642d7265636f72642d3100000007323032362d313200000008686f707363686564"
    "0000000663616e63656c000000106f726465722d34322d74696d656f757400000010313739383736323530303030"
    "303030300000000000000000"
)
VECTOR_CANCEL_MAC = "701ea8397632b4515d8b87e57bb329f24092c1fc7645676917457b6376be7882"
VECTOR_RESCHEDULE = Record(
    RESCHEDULE, "order-42-timeout", 1_798_762_500_000_000, 1_798_765_200_000_000
)
VECTOR_RESCHEDULE_MAC = "9686ee4ab4bb00247f70ee25b9e4f6ccd6431aa01cacbe7b09fc5226ad4281ee"


def test_the_envelope_vector() -> None:
    data = envelope_bytes("hopsched", VECTOR_KEY.key_id, VECTOR_ENVELOPE, VECTOR_BODY)
    assert data.hex() == VECTOR_ENVELOPE_BYTES
    # HMAC-SHA256 as any library computes it: nothing home-made
    assert hmac.new(bytes(range(32)), data, hashlib.sha256).hexdigest() == VECTOR_ENVELOPE_MAC
    signed = Signatures((VECTOR_KEY,), "hopsched").sign_envelope(VECTOR_ENVELOPE, VECTOR_BODY)
    assert signed.signature == f"2026-12:{VECTOR_ENVELOPE_MAC}"


def test_the_record_vectors() -> None:
    assert record_bytes("hopsched", "2026-12", VECTOR_CANCEL).hex() == VECTOR_CANCEL_BYTES
    signing = Signatures((VECTOR_KEY,), "hopsched")
    cancel, reschedule = signing.sign_records([VECTOR_CANCEL, VECTOR_RESCHEDULE])
    assert (cancel.key_id, cancel.mac) == ("2026-12", VECTOR_CANCEL_MAC)
    assert reschedule.mac == VECTOR_RESCHEDULE_MAC
    assert encode_records([cancel]) == (
        b'{"op":"cancel","id":"order-42-timeout","at":1798762500000000,"due":null,'
        b'"kid":"2026-12","mac":"' + VECTOR_CANCEL_MAC.encode() + b'"}\n'
    )


def test_docs_security_md_gives_these_vectors() -> None:
    """The figures another language reproduces are the code's own (no drift)."""
    flat = re.sub(r"\s+", "", SECURITY_MD)
    for value in (
        VECTOR_KEY_TEXT,
        VECTOR_ENVELOPE_BYTES,
        VECTOR_ENVELOPE_MAC,
        VECTOR_CANCEL_BYTES,
        VECTOR_CANCEL_MAC,
        VECTOR_RESCHEDULE_MAC,
        hashlib.sha256(VECTOR_BODY).hexdigest(),
    ):
        assert value in flat, value
    assert SigningKey.parse(VECTOR_KEY_TEXT) == VECTOR_KEY


# --- canonical bytes -------------------------------------------------------------------------

fields = st.lists(st.one_of(st.text(max_size=8), st.integers(0, 2**63), st.binary(max_size=8)))


@given(first=fields, second=fields)
def test_canonical_bytes_of_different_fields_differ(
    first: list[str | int | bytes], second: list[str | int | bytes]
) -> None:
    """The length prefixes make the encoding injective: no content is another's."""

    def normal(values: list[str | int | bytes]) -> list[bytes]:
        return [
            v if isinstance(v, bytes) else str(v).encode() if isinstance(v, int) else v.encode()
            for v in values
        ]

    if normal(first) != normal(second):
        assert canonical(b"d", *first) != canonical(b"d", *second)


envelopes = st.builds(
    Envelope,
    schedule_id=st.text(min_size=1, max_size=30),
    due_us=st.integers(0, 2**62),
    exchange=st.text(max_size=20),
    routing_key=st.text(max_size=20),
    expiration=st.none() | st.text(max_size=12),
    created_us=st.integers(0, 2**62),
)


@given(envelope=envelopes, body=st.binary(max_size=64))
def test_envelope_bytes_are_canonical_of_the_documented_fields(
    envelope: Envelope, body: bytes
) -> None:
    assert envelope_bytes("p", "k", envelope, body) == canonical(
        ENVELOPE_DOMAIN,
        "k",
        "p",
        envelope.schedule_id,
        envelope.created_us,
        envelope.due_us,
        envelope.exchange,
        envelope.routing_key,
        envelope.expiration,
        hashlib.sha256(body).digest(),
    )


# --- envelopes -------------------------------------------------------------------------------

NEW = SigningKey("new", b"n" * 32)
OLD = SigningKey("old", b"o" * 32)
OTHER = SigningKey("other", b"x" * 32)


@given(envelope=envelopes, body=st.binary(max_size=64))
def test_a_signed_envelope_verifies_and_any_change_does_not(
    envelope: Envelope, body: bytes
) -> None:
    signing = Signatures((NEW,), "p", required=True)
    signed = signing.sign_envelope(envelope, body)
    assert signing.check_envelope(signed, body) == signed
    assert signed.owner == "new"
    changes = [
        {"schedule_id": envelope.schedule_id + "x"},
        {"due_us": envelope.due_us + 1},
        {"created_us": envelope.created_us + 1},
        {"exchange": envelope.exchange + "x"},
        {"routing_key": envelope.routing_key + "x"},
        {"expiration": "0" if envelope.expiration != "0" else "1"},
    ]
    for change in changes:
        refusal = signing.check_envelope(dataclasses.replace(signed, **change), body)
        assert isinstance(refusal, Refusal), change
        assert refusal.kind == BAD_SIGNATURE
    assert isinstance(signing.check_envelope(signed, body + b"x"), Refusal)
    # the same key on another prefix: not a signature for this one
    assert isinstance(Signatures((NEW,), "q").check_envelope(signed, body), Refusal)


def test_unsigned_envelopes_pass_unless_required_and_forged_ones_never() -> None:
    envelope = Envelope("id", 10, "orders", "timeout")
    forged = dataclasses.replace(envelope, signature="new:" + "0" * 64)
    lenient, strict = Signatures((NEW,), "p"), Signatures((NEW,), "p", required=True)

    assert lenient.check_envelope(envelope, b"") == envelope
    assert lenient.check_envelope(envelope, b"").owner is None  # type: ignore[union-attr]
    refusal = strict.check_envelope(envelope, b"")
    assert isinstance(refusal, Refusal)
    assert refusal.kind == UNSIGNED
    assert "require_signatures" in refusal.reason
    for signing in (lenient, strict):
        refusal = signing.check_envelope(forged, b"")
        assert isinstance(refusal, Refusal)
        assert refusal.kind == BAD_SIGNATURE
        assert "does not match" in refusal.reason
    garbled = dataclasses.replace(envelope, signature="no signature")
    refusal = lenient.check_envelope(garbled, b"")
    assert isinstance(refusal, Refusal)
    assert "KEY-ID:MAC" in refusal.reason


def test_without_keys_nothing_is_verified_and_every_envelope_counts_as_unsigned() -> None:
    signed = Signatures((NEW,), "p").sign_envelope(Envelope("id", 10, "o", "k"), b"b")
    checked = Signatures((), "p").check_envelope(signed, b"other body")
    assert isinstance(checked, Envelope)
    assert checked.owner is None
    assert checked.signature is None


def test_rotation_new_then_old_accepts_both_and_dropping_old_parks_its_own() -> None:
    envelope, body = Envelope("id", 10, "o", "k"), b"b"
    by_old = Signatures((OLD,), "p").sign_envelope(envelope, body)
    by_new = Signatures((NEW, OLD), "p").sign_envelope(envelope, body)  # the first signs
    assert by_new.owner == "new"

    rotating = Signatures((NEW, OLD), "p", required=True)
    assert rotating.check_envelope(by_old, body) == by_old
    assert rotating.check_envelope(by_new, body) == by_new
    rotated = Signatures((NEW,), "p", required=True)
    assert rotated.check_envelope(by_new, body) == by_new
    refusal = rotated.check_envelope(by_old, body)
    assert isinstance(refusal, Refusal)
    assert refusal.kind == BAD_SIGNATURE
    assert "key id 'old', which this process does not hold" in refusal.reason
    assert "hopsched parked replay" in refusal.reason


def test_a_resigned_envelope_keeps_its_owner() -> None:
    signing = Signatures((NEW, OLD), "p")
    by_old = Signatures((OLD,), "p").sign_envelope(Envelope("id", 10, "o", "k"), b"b")
    moved = signing.resigned(dataclasses.replace(by_old, due_us=99), b"b")
    assert moved.owner == "old"
    assert signing.check_envelope(moved, b"b") == moved
    unsigned = Envelope("id", 10, "o", "k")
    assert signing.resigned(unsigned, b"b") is unsigned


# --- records ---------------------------------------------------------------------------------


def test_records_are_signed_with_every_key_and_checked_one_by_one() -> None:
    signing = Signatures((NEW, OLD), "p", required=True)
    signed = signing.sign_records([Record(CANCEL, "a", 1), Record(RESCHEDULE, "b", 2, 3)])
    assert [(r.schedule_id, r.key_id) for r in signed] == [
        ("a", "new"),
        ("a", "old"),
        ("b", "new"),
        ("b", "old"),
    ]
    assert [signing.check_record(r) for r in decode_records(encode_records(signed))] == signed
    # only the old key: its own lines verify, the new key's are unknown
    only_old = Signatures((OLD,), "p")
    assert [isinstance(only_old.check_record(r), Refusal) for r in signed] == [
        True,
        False,
        True,
        False,
    ]


@pytest.mark.parametrize(
    ("change", "kind"),
    [
        ({"schedule_id": "victim"}, BAD_SIGNATURE),
        ({"op": RESCHEDULE, "due_us": 5}, BAD_SIGNATURE),
        ({"at_us": 2}, BAD_SIGNATURE),
        ({"due_us": 7}, BAD_SIGNATURE),
        ({"key_id": "other"}, BAD_SIGNATURE),  # a key the reader does not hold
        ({"mac": "f" * 64}, BAD_SIGNATURE),
        ({"mac": "not hex"}, BAD_SIGNATURE),
        ({"key_id": None, "mac": None}, UNSIGNED),
    ],
)
def test_an_altered_record_is_refused(change: dict[str, object], kind: str) -> None:
    signing = Signatures((NEW,), "p", required=True)
    (record,) = signing.sign_records([Record(CANCEL, "mine", 1)])

    refusal = signing.check_record(dataclasses.replace(record, **change))  # type: ignore[arg-type]

    assert isinstance(refusal, Refusal)
    assert refusal.kind == kind


def test_unsigned_records_pass_unless_required_and_without_keys_signatures_are_dropped() -> None:
    record = Record(CANCEL, "x", 1)
    assert Signatures((NEW,), "p").check_record(record) == record
    (signed,) = Signatures((NEW,), "p").sign_records([record])
    assert Signatures((), "p").check_record(signed) == record  # counts as unsigned
    notice = Signatures((NEW, OLD), "p").sign_notice(Record(PARKED, "x", 1, kind="unsigned"))
    assert notice.key_id == "new"
    assert Signatures((NEW,), "p").check_record(notice) == notice


# --- keys are never shown --------------------------------------------------------------------

SECRET_TEXT = "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0"  # base64 of "secret-secret-secret-secret"


def test_a_key_never_shows_its_secret() -> None:
    key = SigningKey.parse(f"k1:{SECRET_TEXT}")
    settings = hopsched.Settings(signing_keys=(f"k1:{SECRET_TEXT}",), require_signatures=True)
    shown = " ".join(
        [repr(key), str(key), repr(settings), str(settings), repr(settings.signatures)]
    )
    assert "k1" in shown
    assert SECRET_TEXT not in shown
    assert key.secret.decode() not in shown
    assert repr(key) == "SigningKey('k1', secret=***)"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (SECRET_TEXT, "write KEY-ID:SECRET"),
        (f"k 1:{SECRET_TEXT}", "letters, digits"),
        ("k1:c2hvcnQ", "at least 16 bytes"),
        (f"k1:{SECRET_TEXT}!!", "not base64"),
    ],
)
def test_a_bad_key_is_refused_without_showing_it(text: str, says: str) -> None:
    with pytest.raises(hopsched.InvalidSettingsError, match=says) as raised:
        hopsched.Settings(signing_keys=(text,))
    assert SECRET_TEXT not in str(raised.value)
    assert "c2hvcnQ" not in str(raised.value)


def test_signing_settings_from_the_environment() -> None:
    environ = {
        "HOPSCHED_SIGNING_KEYS": f" new:{SECRET_TEXT} , old:{SECRET_TEXT.replace('c', 'd')}",
        "HOPSCHED_REQUIRE_SIGNATURES": "true",
    }
    settings = hopsched.Settings.from_env(environ)
    assert [key.key_id for key in settings.signatures.keys] == ["new", "old"]
    assert settings.require_signatures is True
    assert hopsched.Settings.from_env({}).signatures.enabled is False
    with pytest.raises(hopsched.InvalidSettingsError, match="needs signing_keys"):
        hopsched.Settings.from_env({"HOPSCHED_REQUIRE_SIGNATURES": "1"})
    with pytest.raises(hopsched.InvalidSettingsError, match="true or false"):
        hopsched.Settings.from_env({**environ, "HOPSCHED_REQUIRE_SIGNATURES": "maybe"})
    with pytest.raises(hopsched.InvalidSettingsError, match="given twice"):
        parse_signing_keys([f"a:{SECRET_TEXT}", f"a:{SECRET_TEXT}"])
    with pytest.raises(hopsched.InvalidSettingsError, match="sequence of keys"):
        hopsched.Settings(signing_keys=f"a:{SECRET_TEXT}")  # type: ignore[arg-type]


def test_a_standard_base64_secret_is_read_as_url_safe() -> None:
    secret = bytes(range(250, 256)) * 4 + b"\xfb\xff"
    standard = base64.b64encode(secret).decode()
    assert "+" in standard or "/" in standard
    assert SigningKey.parse(f"k:{standard}").secret == secret
    assert SigningKey.parse(f"k:{base64.urlsafe_b64encode(secret).decode()}").secret == secret


def test_mac_is_hmac_sha256_in_hex() -> None:
    assert mac(NEW, b"data") == hmac.new(b"n" * 32, b"data", "sha256").hexdigest()
