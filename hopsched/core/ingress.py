"""The ``x-delay`` ingress: what producers written for the delayed-message plugin publish,
turned into a hopsched envelope. Pure: no I/O; the clock comes in as ``received_us``.

A producer publishes to its exchange (``orders``) with an ``x-delay`` header in
milliseconds, as it did to the plugin's ``x-delayed-message`` exchange. hopsched declares
that exchange (a topic exchange bound with ``#`` to the prefix's quorum queue
``{prefix}.ingress``); the relay consumes the queue, schedules each message for its
receipt time + ``x-delay`` through the ladder, and when it is due publishes it to the
**due exchange** ``{prefix}.due.{exchange}``, of the plugin's ``x-delayed-type``
(direct, topic, fanout or headers), whose bindings are the consumers' (docs/ingress.md).

The plugin's rules for ``x-delay`` (rabbitmq-delayed-message-exchange,
``rabbit_delayed_message_utils:get_delay/1``): an integer, or a string or float
converted to one; absent, zero or negative means no delay. On delivery the header of a
delayed message reads ``-delay`` (``swap_delay_header/1``), so a message routed on to
another delayed exchange is not delayed again; an undelayed one keeps its header.
Unlike the plugin, a delay over 2^32 - 1 ms is kept, not sent at once (its issues #225,
#227), and a value that is no number is parked, not sent at once.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hopsched.amqp import Properties
from hopsched.core.clock import MAX_DUE_US
from hopsched.core.envelope import (
    HEADER_EXCHANGE,
    HEADER_ID,
    HEADER_INGRESS,
    HEADER_ROUTING_KEY,
    PERSISTENT,
    Envelope,
    callers_headers,
    first_hop_properties,
)
from hopsched.errors import InvalidSettingsError

__all__ = [
    "BROKER_TIMESTAMP_HEADER",
    "DELAYED_TYPES",
    "DELAY_HEADER",
    "DelayedType",
    "Ingested",
    "Ingress",
    "IngressRegistry",
    "NotIngested",
    "delay_ms",
    "ingest",
]

#: The plugin's header: the delay in milliseconds.
DELAY_HEADER = "x-delay"
#: The header RabbitMQ >= 3.12 adds to every message it receives with
#: ``message_interceptors.incoming.set_header_timestamp = true`` in rabbitmq.conf: the
#: broker's receipt time, ms since the epoch (https://www.rabbitmq.com/docs/configure,
#: "message_interceptors"). RabbitMQ 3.10 has no such stamp.
BROKER_TIMESTAMP_HEADER = "timestamp_in_ms"
DelayedType = Literal["direct", "topic", "fanout", "headers"]
#: The plugin's ``x-delayed-type`` values hopsched routes by (the built-in types).
DELAYED_TYPES: tuple[DelayedType, ...] = ("direct", "topic", "fanout", "headers")
#: A numeric string: what the plugin's ``rabbit_data_coercion:to_integer`` takes.
_INTEGER = re.compile(r"\s*[+-]?\d+\s*")
#: Exchange names RabbitMQ accepts: up to 255 bytes of letters, digits, '-', '_', '.', ':'.
_EXCHANGE = re.compile(r"[A-Za-z0-9_.:-]{1,255}")
#: The schedule id of a message without ``message_id``: this, then a random hex id.
GENERATED_ID_PREFIX = "ingress-"
US_PER_MS = 1000
MS_PER_YEAR = 365.25 * 86_400_000


@dataclass(frozen=True, slots=True)
class Ingress:
    """One ingress: producers publish to ``exchange`` with ``x-delay``; when due, the
    message goes to ``due_exchange(prefix)``, of type ``delayed_type``.

    Args:
        exchange: the name producers publish to (the plugin exchange's name).
        delayed_type: the plugin's ``x-delayed-type``: how the due exchange routes.
        keys: routing keys bound from ``exchange`` to the ingress queue besides ``#``:
            only for a migration from a ``direct`` plugin exchange, whose messages
            still pending in the plugin come out through the name's bindings by exact
            key (docs/migrating-from-the-delayed-message-plugin.md).

    Raises:
        InvalidSettingsError: a name RabbitMQ would refuse, one starting ``amq.``, or a
            type that is not one of ``DELAYED_TYPES``.
    """

    exchange: str
    delayed_type: DelayedType = "direct"
    keys: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not _EXCHANGE.fullmatch(self.exchange) or self.exchange.startswith("amq."):
            raise InvalidSettingsError(
                f"ingress exchange {self.exchange!r}: use 1-255 letters, digits, '-', '_', "
                "'.' or ':', not starting with 'amq.' (the name your producers publish to)"
            )
        if self.delayed_type not in DELAYED_TYPES:
            plugins = (
                ": give the x-delayed-type argument of the plugin's exchange (how it routed), "
                "not its type x-delayed-message"
                if str(self.delayed_type) == "x-delayed-message"  # a str at run time
                else ""
            )
            raise InvalidSettingsError(
                f"ingress {self.exchange!r}: x-delayed-type {self.delayed_type!r} is not one "
                f"of {', '.join(DELAYED_TYPES)}{plugins}"
            )

    def due_exchange(self, prefix: str) -> str:
        """``{prefix}.due.{exchange}``: where its messages go when due."""
        return due_exchange(prefix, self.exchange)

    def to_json(self) -> dict[str, Any]:
        return {"exchange": self.exchange, "type": self.delayed_type, "keys": list(self.keys)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Ingress:
        return cls(str(value["exchange"]), value["type"], tuple(value.get("keys", ())))


def due_exchange(prefix: str, exchange: str) -> str:
    """The due exchange of ingress ``exchange`` under ``prefix``."""
    return f"{prefix}.due.{exchange}"


def delay_ms(headers: Mapping[str, Any] | None) -> int:
    """The ``x-delay`` of ``headers``, ms, as the plugin reads it: an integer, a numeric
    string or a float (truncated); absent or not positive gives 0 (deliver now).

    Raises:
        ValueError: a value that is no number (the plugin would send it at once).
    """
    value = (headers or {}).get(DELAY_HEADER)
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ValueError(f"header {DELAY_HEADER!r} is a boolean ({value}); it must be ms")
    if isinstance(value, int):
        delay = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"header {DELAY_HEADER!r} is {value}; it must be a number of ms")
        delay = math.trunc(value)
    elif isinstance(value, (str, bytes)):
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if not _INTEGER.fullmatch(text):
            raise ValueError(f"header {DELAY_HEADER!r} is {text[:40]!r}: not a whole number of ms")
        delay = int(text)
    else:
        raise ValueError(
            f"header {DELAY_HEADER!r} is a {type(value).__name__}; it must be ms (an integer, "
            "a float, or a string of a whole number)"
        )
    return max(0, delay)


def received_ms(headers: Mapping[str, Any] | None) -> int | None:
    """The broker's receipt stamp (``BROKER_TIMESTAMP_HEADER``, ms), None without one."""
    value = (headers or {}).get(BROKER_TIMESTAMP_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True, slots=True)
class Ingested:
    """An ingress message made a scheduled one: ``properties`` carry ``envelope``."""

    envelope: Envelope
    properties: Properties
    delay_ms: int
    stamped: bool  # the due time counts from the broker's stamp, not the relay's clock


@dataclass(frozen=True, slots=True)
class NotIngested:
    """Why an ingress message cannot be scheduled: it is parked with ``reason`` and
    ``properties``, its own plus what names it (``HEADER_ID``, ``HEADER_EXCHANGE`` and
    ``HEADER_ROUTING_KEY``: its due exchange and key) and ``HEADER_INGRESS`` (the
    exchange it was published to, where ``hopsched parked replay`` sends it back)."""

    reason: str
    properties: Properties
    #: what the journal records it as once parked, so that get() knows its id: due at
    #: its receipt (the plugin would have delivered it at once); None without an id
    envelope: Envelope | None = None


def ingest(
    *,
    prefix: str,
    exchange: str,
    routing_key: str,
    properties: Properties,
    received_us: int,
) -> Ingested | NotIngested:
    """Turn a delivery from ``{prefix}.ingress`` into a scheduled message.

    Args:
        prefix: the relay's prefix.
        exchange: the exchange it was published to (``basic.deliver``'s, set by the
            broker: a producer cannot choose another ingress's due exchange).
        routing_key: its routing key: the due exchange routes it by this key.
        properties: its properties as published (plus the broker's stamp, if any).
        received_us: the relay's receipt time, µs since the epoch: the start of the
            delay when the broker stamped none. Later than the broker's receipt (by
            any outage of the relays), so late, never early.

    Returns:
        ``Ingested`` (the envelope: due at start + ``x-delay``, the start being the
        end of the broker's stamp's millisecond, or ``received_us``; target the due
        exchange and ``routing_key``; schedule id the ``message_id``, else
        ``ingress-`` and a random id; created at the start), or ``NotIngested``.
    """
    schedule_id = properties.message_id or f"{GENERATED_ID_PREFIX}{uuid.uuid4().hex}"

    def refused(reason: str) -> NotIngested:
        named = {HEADER_ROUTING_KEY: routing_key, HEADER_INGRESS: exchange}
        named[HEADER_EXCHANGE] = due_exchange(prefix, exchange) if exchange else ""
        envelope = None
        if len(schedule_id.encode()) <= 255:
            named[HEADER_ID] = schedule_id
            envelope = Envelope(
                schedule_id=schedule_id,
                due_us=received_us,
                exchange=named[HEADER_EXCHANGE],
                routing_key=routing_key,
                created_us=received_us,
            )
        headers = callers_headers(properties.headers).update(named)
        return NotIngested(reason, properties.replace(headers=headers), envelope)

    if exchange == "":
        return refused(
            f"published straight to {prefix}.ingress (default exchange): publish to an "
            "ingress exchange (`hopsched ingress list`) with an x-delay header"
        )
    headers = properties.headers
    try:
        delay = delay_ms(headers)
    except ValueError as error:
        return refused(f"{error}: hopsched cannot tell when to deliver it")
    stamp_ms = received_ms(headers)
    # The stamp is whole ms, truncated: the receipt was up to 1 ms after it (counted from
    # the stamp itself, a benchmark saw 7 of 10,000 delivered up to 0.16 ms early).
    start_us = (stamp_ms + 1) * US_PER_MS if stamp_ms is not None else received_us
    if len(schedule_id.encode()) > 255:
        return refused("message_id is over 255 bytes: it cannot be its schedule id")
    if start_us + delay * US_PER_MS > MAX_DUE_US:
        return refused(
            f"header {DELAY_HEADER!r} is {delay} ms ({delay / MS_PER_YEAR:.3g} years): that "
            "puts its due time after the year 9999, the latest hopsched keeps (the "
            "delayed-message plugin would have delivered it at once, as any delay over "
            "2^32-1 ms)"
        )
    envelope = Envelope(
        schedule_id=schedule_id,
        due_us=start_us + delay * US_PER_MS,
        exchange=due_exchange(prefix, exchange),
        routing_key=routing_key,
        expiration=properties.expiration,
        delivery_mode=_delivery_mode(properties.delivery_mode),
        created_us=start_us,
    )
    callers = callers_headers(headers)
    # As the plugin delivers a delayed message: x-delay -delay, not delayed again
    # downstream; one it did not delay (0 or negative) it routes with x-delay untouched.
    if delay > 0 and DELAY_HEADER in callers:
        callers = callers.update({DELAY_HEADER: -delay})
    scheduled = first_hop_properties(
        properties, envelope, headers=callers, hop_expires_us=None, producer=""
    )
    return Ingested(envelope, scheduled, delay, stamp_ms is not None)


def _delivery_mode(mode: int | None) -> int | None:
    """The envelope's delivery mode: None for persistent (the default), 0 for unset."""
    if mode == PERSISTENT:
        return None
    return mode or 0


class IngressRegistry:
    """The ingresses of a prefix, folded from the records of ``{prefix}.ingresses``:
    ``{"op": "declare", "ingress": {...}}`` and ``{"op": "remove", "exchange": ...}``
    (JSON, one per stream message; a later record wins)."""

    def __init__(self) -> None:
        self.ingresses: dict[str, Ingress] = {}

    @staticmethod
    def declared(ingress: Ingress) -> bytes:
        return json.dumps({"op": "declare", "ingress": ingress.to_json()}).encode()

    @staticmethod
    def removed(exchange: str) -> bytes:
        return json.dumps({"op": "remove", "exchange": exchange}).encode()

    @staticmethod
    def marker(marker: str) -> bytes:
        return json.dumps({"op": "marker", "marker": marker}).encode()

    def apply(self, body: bytes) -> str | None:
        """Fold one record; return a marker record's marker (None otherwise). A record
        that does not parse is skipped: the stream is hopsched's own."""
        try:
            record = json.loads(body)
            op = record["op"]
            if op == "declare":
                ingress = Ingress.from_json(record["ingress"])
                self.ingresses[ingress.exchange] = ingress
            elif op == "remove":
                self.ingresses.pop(str(record["exchange"]), None)
            elif op == "marker":
                return str(record["marker"])
        except (ValueError, KeyError, TypeError, InvalidSettingsError):
            return None
        return None

    def sorted(self) -> list[Ingress]:
        return [self.ingresses[name] for name in sorted(self.ingresses)]
