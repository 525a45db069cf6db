"""The envelope: hopsched's headers on a message in the ladder, and every header and
property change a message goes through. Pure: no I/O, no clock.

This module is the one place that builds a message's headers and properties for each
step of its life: the first placement (``schedule()``), a hop, a retry after the
target refused it, the final delivery, parking, and a replay from the parking queue.

Header values are kept to types every AMQP 0-9-1 client encodes and decodes the same
way (long strings and signed integers). The due time is an integer count of
microseconds since the Unix epoch, never a float: a field-table float may be 32 bits
wide (pamqp encodes Python floats as type ``f``), which would move an epoch timestamp
by minutes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, NamedTuple

from hopsched.amqp.wire import Properties, Table
from hopsched.core.clock import MAX_DUE_US
from hopsched.core.plausible import unit_hint
from hopsched.errors import EnvelopeError

__all__ = [
    "BROKER_DEAD_LETTER_HEADERS",
    "BROKER_DELIVERY_COUNT_HEADER",
    "ENVELOPE_VERSION",
    "FEATURES",
    "FEATURE_RECURRING",
    "HEADER_CREATED",
    "HEADER_DELIVERY_MODE",
    "HEADER_DUE",
    "HEADER_EXCHANGE",
    "HEADER_EXPIRATION",
    "HEADER_FEATURES",
    "HEADER_HOPS",
    "HEADER_HOP_CLOCK",
    "HEADER_HOP_EXPIRES",
    "HEADER_ID",
    "HEADER_KEY",
    "HEADER_LINEAGE",
    "HEADER_OCCURRENCE",
    "HEADER_OWNER",
    "HEADER_PARKED_AT",
    "HEADER_PARKED_KIND",
    "HEADER_PARKED_REASON",
    "HEADER_PARKED_USER_ID",
    "HEADER_PREFIX",
    "HEADER_RETRIES",
    "HEADER_RETRY_SINCE",
    "HEADER_ROUTING_KEY",
    "HEADER_RULE",
    "HEADER_SIGNATURE",
    "HEADER_VERSION",
    "NO_DEATH",
    "PERSISTENT",
    "RELAY_CLOCK",
    "Death",
    "DeliveryInfo",
    "Envelope",
    "callers_headers",
    "delivery_headers",
    "delivery_properties",
    "first_hop_properties",
    "hop_headers",
    "hop_properties",
    "latest_death",
    "lineage_properties",
    "next_occurrence_properties",
    "parked_headers",
    "parked_properties",
    "retry_properties",
    "unparked_headers",
    "unparked_properties",
    "without_rule",
]

ENVELOPE_VERSION = 1

#: AMQP delivery mode 2: every hop is persistent, whatever the caller chose.
PERSISTENT = 2

#: Every header hopsched writes starts with this; a caller's own are replaced.
HEADER_PREFIX = "x-hopsched-"
HEADER_VERSION = "x-hopsched-version"
HEADER_ID = "x-hopsched-id"
HEADER_DUE = "x-hopsched-due"  # int, microseconds since the Unix epoch, UTC
HEADER_EXCHANGE = "x-hopsched-exchange"
HEADER_ROUTING_KEY = "x-hopsched-routing-key"
#: Passes through a step queue so far (the first placement counts when it is one).
HEADER_HOPS = "x-hopsched-hops"
# int, µs since the Unix epoch: when the current hop's step TTL runs out (its publish
# instant + the step); the relay measures each hop's overshoot against it.
HEADER_HOP_EXPIRES = "x-hopsched-hop-expires"
#: Whose clock wrote ``x-hopsched-hop-expires``: ``RELAY_CLOCK``, or the producer's id
#: (the relay learns its hop margin from its own stamps only and estimates each
#: producer's clock offset from the others).
HEADER_HOP_CLOCK = "x-hopsched-hop-clock"
RELAY_CLOCK = "relay"
#: int, µs since the epoch by the producer's clock: when the message was scheduled (a
#: cancel or reschedule applies to the messages of its id created before it).
HEADER_CREATED = "x-hopsched-created"
HEADER_EXPIRATION = "x-hopsched-expiration"  # the caller's own expiration, final publish only
HEADER_DELIVERY_MODE = "x-hopsched-delivery-mode"  # the caller's, when not persistent (2)
#: Final publishes the target refused so far, and when the first refusal came (µs).
HEADER_RETRIES = "x-hopsched-retries"
HEADER_RETRY_SINCE = "x-hopsched-retry-since"
HEADER_PARKED_REASON = "x-hopsched-parked-reason"
HEADER_PARKED_AT = "x-hopsched-parked-at"  # int, microseconds since the Unix epoch, UTC
HEADER_PARKED_KIND = "x-hopsched-parked-kind"  # a hopsched.ParkKind value, e.g. "unroutable"
HEADER_PARKED_USER_ID = "x-hopsched-user-id"  # a parked message's user_id property
#: A recurring schedule's rule (``hopsched.core.recurring.Rule.encode``: compact JSON), on each
#: occurrence in the ladder whose successor is not scheduled yet; never delivered.
HEADER_RULE = "x-hopsched-rule"
#: int, a recurring schedule's occurrences delivered so far counting this one (1 for the
#: first): the relay stops the chain at the rule's ``count``. Delivered.
HEADER_OCCURRENCE = "x-hopsched-occurrence"
#: On a delivered occurrence of a recurring schedule only: ``ID@DUE`` (the schedule id and
#: the occurrence's due time, µs), one key per occurrence to de-duplicate on.
HEADER_KEY = "x-hopsched-key"
#: A recurring chain's lineage, set by a relay that claimed one (``hopsched.core.cancel.LINEAGE``)
#: for an occurrence delivered to it again; absent on the first lineage. Never delivered.
HEADER_LINEAGE = "x-hopsched-lineage"
#: The features a relay must understand to handle the message, beyond a one-shot
#: delivery: comma-separated names (``recurring``); absent when it needs none. A relay
#: parks a message naming one it does not know (``Decider.decide``): an older relay never
#: mishandles what a newer scheduler wrote.
HEADER_FEATURES = "x-hopsched-features"
#: A recurring schedule's occurrence (``x-hopsched-rule``, ``-occurrence``, ``-lineage``).
FEATURE_RECURRING = "recurring"
#: Every feature this version's relay understands.
FEATURES = frozenset({FEATURE_RECURRING})
#: ``KEY-ID:HEX-MAC``: the envelope's HMAC-SHA256 and the id of the key that made it
#: (``hopsched.core.signing``); absent when the producer holds no signing key.
HEADER_SIGNATURE = "x-hopsched-signature"
#: The RabbitMQ user that scheduled it (``Scheduler``: its login, when the broker checks
#: it: PLAIN authentication); absent if unknown (hand-made envelopes, the ingress, older
#: versions). A record without a signature changes only that user's schedules
#: (``hopsched.core.cancel``). Never delivered.
HEADER_OWNER = "x-hopsched-owner"
#: On a parked ingress message that could not be scheduled (``hopsched.core.ingress``): the
#: exchange it was published to; a replay publishes it there again.
HEADER_INGRESS = "x-hopsched-ingress"

#: What RabbitMQ adds when it dead-letters a message
#: (https://www.rabbitmq.com/docs/dlx#effects). Carried across hops they grow without
#: bound and, before RabbitMQ 4.0, make the broker see a cycle and drop the message.
BROKER_DEAD_LETTER_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)

#: What a quorum queue adds to a message it delivers again (``{prefix}.relay`` after a relay
#: crash; https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling).
#: Carried on, it would tell the target's consumer that a first delivery was a redelivery.
BROKER_DELIVERY_COUNT_HEADER = "x-delivery-count"
_BROKER_HEADERS = BROKER_DEAD_LETTER_HEADERS | {BROKER_DELIVERY_COUNT_HEADER}

# Only the relay needs these; the target consumer gets the id, due time and hop count.
_ROUTING_HEADERS = frozenset(
    {
        HEADER_VERSION,
        HEADER_EXCHANGE,
        HEADER_ROUTING_KEY,
        HEADER_CREATED,
        HEADER_EXPIRATION,
        HEADER_DELIVERY_MODE,
        HEADER_HOP_EXPIRES,
        HEADER_HOP_CLOCK,
        HEADER_RETRIES,
        HEADER_RETRY_SINCE,
        HEADER_SIGNATURE,
        HEADER_RULE,
        HEADER_LINEAGE,
        HEADER_FEATURES,
        HEADER_OWNER,
    }
)
_PARKED_HEADERS = frozenset(
    {HEADER_PARKED_REASON, HEADER_PARKED_KIND, HEADER_PARKED_AT, HEADER_PARKED_USER_ID}
)
_HOP_DROPS = _BROKER_HEADERS | {HEADER_HOP_EXPIRES, HEADER_HOP_CLOCK}


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the relay needs to route one scheduled message.

    Attributes:
        schedule_id: stable across hops and redeliveries; consumers de-duplicate on it.
        due_us: due time, integer microseconds since the Unix epoch (UTC).
        exchange: target exchange ("" is the default exchange).
        routing_key: target routing key.
        hops: passes through a step queue so far.
        expiration: the caller's per-message ``expiration`` (ms, as a string), applied
            to the final publish only: on a hop it would bring back head-of-line blocking.
        delivery_mode: the caller's delivery mode when it is not 2 (persistent);
            ``0`` means the caller left it unset. Hops are always persistent.
        retries: final publishes the target refused (nacked) so far.
        retry_since_us: when the first of them was refused, µs since the epoch.
        created_us: when it was scheduled, µs since the epoch by the producer's clock
            (0: not recorded, from a hopsched before cancellation).
        signature: header ``x-hopsched-signature`` (``KEY-ID:HEX-MAC``), None if unsigned.
        rule: a recurring schedule's rule, encoded (``hopsched.core.recurring.Rule``), while
            this occurrence's successor is not scheduled; None otherwise.
        occurrence: a recurring schedule's occurrences delivered counting this one
            (1-based); 0 for a one-shot message.
        lineage: a recurring chain's lineage (``HEADER_LINEAGE``); None for the first.
        features: feature names its ``x-hopsched-features`` lists beyond those its own
            fields imply (``required_features``), e.g. one a newer scheduler wrote.
        user: the RabbitMQ user that scheduled it (``HEADER_OWNER``), None if unknown.
    """

    schedule_id: str
    due_us: int
    exchange: str
    routing_key: str
    hops: int = 0
    expiration: str | None = None
    delivery_mode: int | None = None
    retries: int = 0
    retry_since_us: int | None = None
    created_us: int = 0
    signature: str | None = None
    rule: str | None = None
    occurrence: int = 0
    lineage: str | None = None
    features: frozenset[str] = frozenset()
    user: str | None = None

    @property
    def required_features(self) -> frozenset[str]:
        """The features a relay must understand to handle it (``HEADER_FEATURES``):
        ``features``, plus ``recurring`` for a rule."""
        implied = {FEATURE_RECURRING} if self.rule is not None else set()
        return self.features | implied

    @property
    def owner(self) -> str | None:
        """The key id of its signature (None: unsigned): whose schedule it is, once a
        relay's ``Signatures.check_envelope`` has verified it (which drops a signature
        it cannot verify)."""
        if self.signature is None:
            return None
        return self.signature.rpartition(":")[0]

    def to_headers(self) -> dict[str, Any]:
        """The envelope as AMQP header fields (merge them into the caller's headers)."""
        headers: dict[str, Any] = {
            HEADER_VERSION: ENVELOPE_VERSION,
            HEADER_ID: self.schedule_id,
            HEADER_DUE: self.due_us,
            HEADER_EXCHANGE: self.exchange,
            HEADER_ROUTING_KEY: self.routing_key,
            HEADER_HOPS: self.hops,
        }
        if self.expiration is not None:
            headers[HEADER_EXPIRATION] = self.expiration
        if self.delivery_mode is not None:
            headers[HEADER_DELIVERY_MODE] = self.delivery_mode
        if self.retries:
            headers[HEADER_RETRIES] = self.retries
        if self.retry_since_us is not None:
            headers[HEADER_RETRY_SINCE] = self.retry_since_us
        if self.created_us:
            headers[HEADER_CREATED] = self.created_us
        if self.signature is not None:
            headers[HEADER_SIGNATURE] = self.signature
        if self.rule is not None:
            headers[HEADER_RULE] = self.rule
        if self.occurrence:
            headers[HEADER_OCCURRENCE] = self.occurrence
        if self.lineage is not None:
            headers[HEADER_LINEAGE] = self.lineage
        if features := self.required_features:
            headers[HEADER_FEATURES] = ",".join(sorted(features))
        if self.user is not None:
            headers[HEADER_OWNER] = self.user
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, Any] | None) -> Envelope:
        """Read the envelope back from received AMQP headers (a dict or a ``Table``).

        Raises:
            EnvelopeError: a header is missing, has the wrong type, or the version is
                not ``ENVELOPE_VERSION``; the error keeps the raw headers.
        """
        headers = headers or {}
        version = _field(headers, HEADER_VERSION, int)
        if version != ENVELOPE_VERSION:
            raise EnvelopeError(
                f"header {HEADER_VERSION!r} is {version}; this relay reads version "
                f"{ENVELOPE_VERSION}: run a relay of the version that scheduled it",
                headers,
            )
        get = headers.get
        values: dict[str, Any] = {}
        for name, kind, required, attribute in _ENVELOPE_FIELDS:  # one pass: read every hop
            value = get(name)
            if type(value) is kind:
                values[attribute] = value
            elif value is not None or required:  # a subclass, a bool for an int, wrong, missing
                values[attribute] = _field(headers, name, kind, required=required)
        envelope = cls(**values)
        if named := _feature_names(_field(headers, HEADER_FEATURES, str, required=False)):
            envelope = replace(envelope, features=named - envelope.required_features)
        if min(envelope.due_us, envelope.hops, envelope.retries, envelope.occurrence) < 0:
            raise EnvelopeError(
                f"headers {HEADER_DUE!r}, {HEADER_HOPS!r}, {HEADER_RETRIES!r} and "
                f"{HEADER_OCCURRENCE!r} must be >= 0",
                headers,
            )
        if envelope.due_us > MAX_DUE_US:  # it would hop on the top step for ever
            looks = unit_hint(envelope.due_us)
            hint = f": it looks like {looks}, it must be microseconds" if looks else ""
            raise EnvelopeError(f"header {HEADER_DUE!r} is after year 9999{hint}", headers)
        if len(envelope.routing_key.encode()) > 255 or len(envelope.exchange.encode()) > 255:
            raise EnvelopeError("target exchange and routing key are limited to 255 bytes", headers)
        return envelope


def _feature_names(value: str | None) -> frozenset[str]:
    """The names in an ``x-hopsched-features`` value (``"recurring, x"``: commas, spaces
    around a name ignored)."""
    return frozenset(name.strip() for name in (value or "").split(",") if name.strip())


class Death(NamedTuple):
    """The latest ``x-death`` entry's time and reason (``latest_death``)."""

    #: when the broker dead-lettered the message, µs since the epoch by the broker's
    #: clock, to the whole second; None if not given
    time_us: int | None
    #: ``expired``, ``maxlen``, ``rejected``, ``delivery_limit``; None if not given
    reason: str | None


NO_DEATH = Death(None, None)


def latest_death(headers: Mapping[str, Any]) -> Death:
    """The first ``x-death`` entry's time and reason: the broker puts the latest first
    (https://www.rabbitmq.com/docs/dlx#effects). ``NO_DEATH`` without a well-formed one.
    From a ``Table``, only that entry is decoded: the whole array, decoded on each read,
    had cost a relay receiving a burst over a third of its CPU (read four times each)."""
    if isinstance(headers, Table):
        death: Mapping[str, Any] | None = headers.first_table("x-death")
    else:
        deaths = headers.get("x-death")
        valid = isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping)
        death = deaths[0] if valid else None  # type: ignore[index]
    if death is None:
        return NO_DEATH
    died, reason = death.get("time"), death.get("reason")
    return Death(
        int(died.timestamp()) * 1_000_000 if isinstance(died, datetime) else None,
        reason if isinstance(reason, str) else None,
    )


#: The envelope's headers as ``Envelope.from_headers`` reads them: (header, type,
#: required, attribute); a missing optional one leaves the attribute's default.
_ENVELOPE_FIELDS: tuple[tuple[str, type, bool, str], ...] = (
    (HEADER_ID, str, True, "schedule_id"),
    (HEADER_DUE, int, True, "due_us"),
    (HEADER_EXCHANGE, str, True, "exchange"),
    (HEADER_ROUTING_KEY, str, True, "routing_key"),
    (HEADER_HOPS, int, True, "hops"),
    (HEADER_EXPIRATION, str, False, "expiration"),
    (HEADER_DELIVERY_MODE, int, False, "delivery_mode"),
    (HEADER_RETRIES, int, False, "retries"),
    (HEADER_RETRY_SINCE, int, False, "retry_since_us"),
    (HEADER_CREATED, int, False, "created_us"),
    (HEADER_SIGNATURE, str, False, "signature"),
    (HEADER_RULE, str, False, "rule"),
    (HEADER_OCCURRENCE, int, False, "occurrence"),
    (HEADER_LINEAGE, str, False, "lineage"),
    (HEADER_OWNER, str, False, "user"),
)


def _field(headers: Mapping[str, Any], name: str, kind: type, *, required: bool = True) -> Any:
    value = headers.get(name)
    if value is None:
        if required:
            raise EnvelopeError(f"header {name!r} is missing", headers)
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise EnvelopeError(
            f"header {name!r} must be {kind.__name__}, got {type(value).__name__} {value!r:.80}",
            headers,
        )
    return value


@dataclass(frozen=True, slots=True)
class DeliveryInfo:
    """What a delivered message says of its schedule (for consumers).

    Attributes:
        schedule_id: de-duplicate on it: delivery is at-least-once.
        due_us: the due time, integer microseconds since the Unix epoch (UTC);
            lateness = receive instant - due_us.
        hops: passes through a step queue the message took.
    """

    schedule_id: str
    due_us: int
    hops: int

    @classmethod
    def from_headers(cls, headers: Mapping[str, Any] | None) -> DeliveryInfo:
        """Read them from a delivered message's headers.

        Raises:
            EnvelopeError: the message was not delivered by hopsched.
        """
        headers = headers or {}
        return cls(
            schedule_id=_field(headers, HEADER_ID, str),
            due_us=_field(headers, HEADER_DUE, int),
            hops=_field(headers, HEADER_HOPS, int),
        )


# --- headers at each step -----------------------------------------------------------------


def _table(headers: Mapping[str, Any] | None) -> Table:
    if isinstance(headers, Table):
        return headers
    return Table.from_dict(headers)


def _without(headers: Mapping[str, Any] | None, names: Iterable[str]) -> Table:
    return _table(headers).without(names)


def callers_headers(headers: Mapping[str, Any] | None) -> Table:
    """A caller's headers for ``schedule()``, encoded: less any ``x-hopsched-*`` (so a
    received message can be scheduled again as it is) and the broker's bookkeeping.

    Raises:
        TypeError, ValueError: a value pamqp cannot encode (``validate.check_headers``
            refuses them first, naming them).
    """
    return Table.from_dict(
        {
            key: value
            for key, value in (headers or {}).items()
            if not key.startswith(HEADER_PREFIX) and key not in _BROKER_HEADERS
        }
    )


def first_hop_headers(
    callers: Table, envelope: Envelope, *, hop_expires_us: int | None, producer: str
) -> Table:
    """Headers for ``schedule()``'s publish: the caller's (``callers_headers``) plus the
    envelope and, for a hop, when it expires by ``producer``'s clock."""
    values = envelope.to_headers()
    if hop_expires_us is not None:
        values[HEADER_HOP_EXPIRES] = hop_expires_us
        values[HEADER_HOP_CLOCK] = producer
    return callers.update(values)


def hop_headers(
    headers: Mapping[str, Any] | None,
    hops: int,
    expires_us: int | None = None,
    due_us: int | None = None,
    signature: str | None = None,
) -> Table:
    """Headers for the relay's next hop: the broker's bookkeeping removed, the hop
    counted, (when given) the instant the hop's TTL runs out by the relay's clock, and
    the due time and signature (a reschedule moves the one and signs it again)."""
    values: dict[str, Any] = {HEADER_HOPS: hops}
    if expires_us is not None:
        values[HEADER_HOP_EXPIRES] = expires_us
        values[HEADER_HOP_CLOCK] = RELAY_CLOCK
    if due_us is not None:
        values[HEADER_DUE] = due_us
    if signature is not None:
        values[HEADER_SIGNATURE] = signature
    return _without(headers, _HOP_DROPS).update(values)


def delivery_headers(headers: Mapping[str, Any] | None) -> Table:
    """Headers for the final publish: the caller's own, plus id, due time and hops."""
    return _without(headers, _BROKER_HEADERS | _ROUTING_HEADERS)


def parked_headers(
    headers: Mapping[str, Any] | None, reason: str, kind: str, parked_at_us: int
) -> Table:
    """Headers for a parked message: everything it had (target, due time) plus why (the
    free-text ``reason`` and its ``hopsched.ParkKind`` value ``kind``) and when."""
    return _without(headers, _BROKER_HEADERS).update(
        {HEADER_PARKED_REASON: reason, HEADER_PARKED_KIND: kind, HEADER_PARKED_AT: parked_at_us}
    )


def unparked_headers(headers: Mapping[str, Any] | None) -> Table:
    """Headers for replaying a parked message: the parking reason, time and user_id gone,
    its last hop's expiry (measured against it, the replay would look like a hop late by
    the time it was parked) and its retry count (the replay starts afresh)."""
    return _without(
        headers,
        _PARKED_HEADERS
        | _BROKER_HEADERS
        | {HEADER_HOP_EXPIRES, HEADER_HOP_CLOCK, HEADER_RETRIES, HEADER_RETRY_SINCE},
    )


# --- properties at each step --------------------------------------------------------------


def first_hop_properties(
    properties: Properties,
    envelope: Envelope,
    *,
    headers: Table,
    hop_expires_us: int | None,
    producer: str,
) -> Properties:
    """The caller's properties (and headers, from ``callers_headers``) for
    ``schedule()``'s publish: the envelope in the headers, persistent, no ``expiration``
    (the envelope keeps it for the final publish), and the schedule id as
    ``message_id`` if the caller set none (not for a recurring schedule: each occurrence
    gets its own, ``delivery_properties``)."""
    return properties.replace(
        headers=first_hop_headers(
            headers, envelope, hop_expires_us=hop_expires_us, producer=producer
        ),
        expiration=None,
        delivery_mode=PERSISTENT,
        # Left unset, AMQP clients fill message_id with a random id; the schedule id is
        # as unique and lets consumers de-duplicate on either.
        message_id=properties.message_id
        or (None if envelope.rule is not None else envelope.schedule_id),
    )


def hop_properties(properties: Properties, envelope: Envelope, expires_us: int) -> Properties:
    """A delivery's properties for its next hop (expiring at ``expires_us``)."""
    return properties.replace(
        headers=hop_headers(
            properties.headers, envelope.hops + 1, expires_us, envelope.due_us, envelope.signature
        ),
        expiration=None,
        delivery_mode=PERSISTENT,
    )


def next_occurrence_properties(
    properties: Properties, envelope: Envelope, expires_us: int | None
) -> Properties:
    """A recurring occurrence's properties for the next one (``envelope``, which carries
    the rule, the next due time and occurrence number, signed anew): the caller's
    properties and headers, the broker's bookkeeping and the retry counts gone, stamped
    with the first hop's expiry by the relay's clock (``expires_us``; None: it goes to
    the relay queue)."""
    values = envelope.to_headers()
    if expires_us is not None:
        values[HEADER_HOP_EXPIRES] = expires_us
        values[HEADER_HOP_CLOCK] = RELAY_CLOCK
    drops = _HOP_DROPS | {HEADER_RETRIES, HEADER_RETRY_SINCE, HEADER_SIGNATURE}
    return properties.replace(
        headers=_without(properties.headers, drops).update(values),
        expiration=None,
        delivery_mode=PERSISTENT,
    )


def lineage_properties(properties: Properties, envelope: Envelope) -> Properties:
    """A recurring occurrence's properties once a relay claimed a lineage for it: the
    lineage and the signature of ``envelope``."""
    values: dict[str, Any] = {HEADER_LINEAGE: envelope.lineage}
    if envelope.signature is not None:
        values[HEADER_SIGNATURE] = envelope.signature
    return properties.replace(headers=_table(properties.headers).update(values))


def without_rule(properties: Properties, envelope: Envelope) -> Properties:
    """A recurring occurrence's properties once its successor is scheduled: no rule (a
    retry or a replay of it must not schedule the successor again), and the due time and
    signature of ``envelope`` (the occurrence it is delivered as)."""
    values: dict[str, Any] = {HEADER_DUE: envelope.due_us, HEADER_OCCURRENCE: envelope.occurrence}
    if envelope.signature is not None:
        values[HEADER_SIGNATURE] = envelope.signature
    return properties.replace(headers=_without(properties.headers, {HEADER_RULE}).update(values))


def retry_properties(
    properties: Properties, envelope: Envelope, expires_us: int, refused_at_us: int
) -> Properties:
    """A delivery's properties for a hop that waits before the final publish is tried
    again: the hop plus the count of refusals and the instant of the first."""
    since = envelope.retry_since_us if envelope.retry_since_us is not None else refused_at_us
    hopped = hop_properties(properties, envelope, expires_us)
    assert hopped.headers is not None
    return hopped.replace(
        headers=hopped.headers.update(
            {HEADER_RETRIES: envelope.retries + 1, HEADER_RETRY_SINCE: since}
        )
    )


def delivery_properties(properties: Properties, envelope: Envelope) -> Properties:
    """A delivery's properties for the final publish: the caller's headers (plus id, due
    time and hops), and the caller's own ``expiration`` and delivery mode. An occurrence
    of a recurring schedule also gets its occurrence number and key, and the key as
    ``message_id`` if the caller set none (one id for every occurrence would make a
    consumer that de-duplicates on it drop all but the first)."""
    if envelope.delivery_mode is None:
        delivery_mode: int | None = PERSISTENT
    else:
        delivery_mode = envelope.delivery_mode or None  # 0: the caller left it unset
    headers = delivery_headers(properties.headers)
    if headers.get(HEADER_DUE) != envelope.due_us:  # rescheduled, or a recurring catch-up
        headers = headers.update({HEADER_DUE: envelope.due_us})
    message_id = properties.message_id
    if envelope.occurrence:
        key = f"{envelope.schedule_id}@{envelope.due_us}"
        headers = headers.update({HEADER_OCCURRENCE: envelope.occurrence, HEADER_KEY: key})
        message_id = message_id or key
    return properties.replace(
        headers=headers,
        expiration=envelope.expiration,
        delivery_mode=delivery_mode,
        message_id=message_id,
    )


def parked_properties(
    properties: Properties, reason: str, kind: str, parked_at_us: int
) -> Properties:
    """A delivery's properties for the parking queue. Its ``user_id`` moves to header
    ``x-hopsched-user-id``: the broker refuses a publish whose user_id is not the
    relay's own login (https://www.rabbitmq.com/docs/validated-user-id)."""
    headers = parked_headers(properties.headers, reason, kind, parked_at_us)
    if properties.user_id is not None:
        headers = headers.update({HEADER_PARKED_USER_ID: properties.user_id})
    return properties.replace(
        headers=headers, user_id=None, expiration=None, delivery_mode=PERSISTENT
    )


def unparked_properties(properties: Properties) -> Properties:
    """A parked message's properties for its replay: its ``user_id`` back in place."""
    headers = properties.headers
    user_id = headers.get(HEADER_PARKED_USER_ID) if headers is not None else None
    return properties.replace(
        headers=unparked_headers(headers),
        user_id=user_id if isinstance(user_id, str) else properties.user_id,
    )
