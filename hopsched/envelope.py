"""The envelope: hopsched's headers on a message in the ladder. Pure: no I/O, no clock.

Header values are kept to types that every AMQP 0-9-1 client encodes and decodes
the same way (long strings and signed integers). The due time is an integer count
of microseconds since the Unix epoch, never a float: a field-table float may be
32 bits wide (pamqp encodes Python floats as type ``f``), which would move an
epoch timestamp by minutes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hopsched.errors import EnvelopeError

__all__ = [
    "BROKER_DEAD_LETTER_HEADERS",
    "BROKER_DELIVERY_COUNT_HEADER",
    "ENVELOPE_VERSION",
    "HEADER_DELIVERY_MODE",
    "HEADER_DUE",
    "HEADER_EXCHANGE",
    "HEADER_EXPIRATION",
    "HEADER_HOPS",
    "HEADER_HOP_EXPIRES",
    "HEADER_ID",
    "HEADER_PARKED_AT",
    "HEADER_PARKED_REASON",
    "HEADER_PARKED_USER_ID",
    "HEADER_ROUTING_KEY",
    "HEADER_VERSION",
    "PERSISTENT",
    "DeliveryInfo",
    "Envelope",
    "delivery_headers",
    "hop_headers",
    "parked_headers",
    "unparked_headers",
]

ENVELOPE_VERSION = 1

#: AMQP delivery mode 2: every hop is persistent, whatever the caller chose.
PERSISTENT = 2

HEADER_VERSION = "x-hopsched-version"
HEADER_ID = "x-hopsched-id"
HEADER_DUE = "x-hopsched-due"  # int, microseconds since the Unix epoch, UTC
HEADER_EXCHANGE = "x-hopsched-exchange"
HEADER_ROUTING_KEY = "x-hopsched-routing-key"
HEADER_HOPS = "x-hopsched-hops"
# int, µs since the Unix epoch: when the current hop's step TTL runs out (its publish
# instant + the step); the relay measures each hop's overshoot against it.
HEADER_HOP_EXPIRES = "x-hopsched-hop-expires"
HEADER_EXPIRATION = "x-hopsched-expiration"  # the caller's own expiration, final publish only
HEADER_DELIVERY_MODE = "x-hopsched-delivery-mode"  # the caller's, when not persistent (2)
HEADER_PARKED_REASON = "x-hopsched-parked-reason"
HEADER_PARKED_AT = "x-hopsched-parked-at"  # int, microseconds since the Unix epoch, UTC
HEADER_PARKED_USER_ID = "x-hopsched-user-id"  # a parked message's user_id property

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
#: crash or a nack; https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling).
#: Carried on, it would tell the target's consumer that a first delivery was a redelivery
#: (a consumer rejecting "poison" messages by this count would count the relay's retries).
BROKER_DELIVERY_COUNT_HEADER = "x-delivery-count"
_BROKER_HEADERS = BROKER_DEAD_LETTER_HEADERS | {BROKER_DELIVERY_COUNT_HEADER}

# Only the relay needs these; the target consumer gets the id, due time and hop count.
_ROUTING_HEADERS = frozenset(
    {
        HEADER_VERSION,
        HEADER_EXCHANGE,
        HEADER_ROUTING_KEY,
        HEADER_EXPIRATION,
        HEADER_DELIVERY_MODE,
        HEADER_HOP_EXPIRES,
    }
)


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the relay needs to route one scheduled message.

    Attributes:
        schedule_id: stable across hops and redeliveries; consumers de-duplicate on it.
        due_us: due time, integer microseconds since the Unix epoch (UTC).
        exchange: target exchange ("" is the default exchange).
        routing_key: target routing key.
        hops: hops taken so far.
        expiration: the caller's per-message ``expiration`` (ms, as a string), applied
            to the final publish only: on a hop it would bring back head-of-line blocking.
        delivery_mode: the caller's delivery mode when it is not 2 (persistent);
            ``0`` means the caller left it unset. Hops are always persistent.
    """

    schedule_id: str
    due_us: int
    exchange: str
    routing_key: str
    hops: int = 0
    expiration: str | None = None
    delivery_mode: int | None = None

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
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, Any] | None) -> Envelope:
        """Read the envelope back from received AMQP headers.

        Raises:
            EnvelopeError: a header is missing, has the wrong type, or the version is
                not ``ENVELOPE_VERSION``; the error keeps the raw headers.
        """
        headers = headers or {}

        def field(name: str, kind: type, *, required: bool = True) -> Any:
            return _field(headers, name, kind, required=required)

        version = field(HEADER_VERSION, int)
        if version != ENVELOPE_VERSION:
            raise EnvelopeError(
                f"header {HEADER_VERSION!r} is {version}; this relay reads version "
                f"{ENVELOPE_VERSION}: run a relay of the version that scheduled it",
                headers,
            )
        envelope = cls(
            schedule_id=field(HEADER_ID, str),
            due_us=field(HEADER_DUE, int),
            exchange=field(HEADER_EXCHANGE, str),
            routing_key=field(HEADER_ROUTING_KEY, str),
            hops=field(HEADER_HOPS, int),
            expiration=field(HEADER_EXPIRATION, str, required=False),
            delivery_mode=field(HEADER_DELIVERY_MODE, int, required=False),
        )
        if envelope.due_us < 0 or envelope.hops < 0:
            raise EnvelopeError(f"headers {HEADER_DUE!r} and {HEADER_HOPS!r} must be >= 0", headers)
        if len(envelope.routing_key.encode()) > 255 or len(envelope.exchange.encode()) > 255:
            raise EnvelopeError("target exchange and routing key are limited to 255 bytes", headers)
        return envelope


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
        hops: ladder hops the message took.
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


_PARKED_HEADERS = frozenset({HEADER_PARKED_REASON, HEADER_PARKED_AT, HEADER_PARKED_USER_ID})


def _without(headers: Mapping[str, Any] | None, names: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in (headers or {}).items() if k not in names}


def hop_headers(
    headers: Mapping[str, Any] | None, hops: int, expires_us: int | None = None
) -> dict[str, Any]:
    """Headers for the next hop: the broker's bookkeeping removed, hop count set, and
    (when given) the instant the hop's TTL runs out, µs since the epoch."""
    result = _without(headers, _BROKER_HEADERS)
    result[HEADER_HOPS] = hops
    if expires_us is not None:
        result[HEADER_HOP_EXPIRES] = expires_us
    return result


def delivery_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Headers for the final publish: the caller's own, plus id, due time and hops."""
    return _without(headers, _BROKER_HEADERS | _ROUTING_HEADERS)


def parked_headers(
    headers: Mapping[str, Any] | None, reason: str, parked_at_us: int
) -> dict[str, Any]:
    """Headers for a parked message: everything it had (target, due time) plus why and when."""
    result = _without(headers, _BROKER_HEADERS)
    result[HEADER_PARKED_REASON] = reason
    result[HEADER_PARKED_AT] = parked_at_us
    return result


def unparked_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Headers for replaying a parked message: the parking reason, time and user_id gone,
    and its last hop's expiry (measured against it, the replay would look like a hop
    late by the time it was parked)."""
    return _without(headers, _PARKED_HEADERS | {HEADER_HOP_EXPIRES})
