"""Which targets a relay may publish to: ``EXCHANGE/ROUTING-KEY`` glob patterns. Pure.

RabbitMQ's own permissions cannot say this: a user who may write to the default
exchange (``amq.default``, which hops need) may publish to every queue of the vhost,
and topic permissions apply to topic exchanges only
(https://www.rabbitmq.com/docs/access-control#topic-authorisation). So the relay
checks each message's target against an allow list before it publishes anything.

Whatever the allow list, hopsched's own namespace is never a target: an exchange named
``{prefix}.…``, or the default exchange with a routing key ``{prefix}.…`` (a step, the
relay or parking queue, the cancel stream), is refused by ``schedule()`` and parked by
the relay, so that nothing reaches hopsched's own queues and stream except through its
own code paths (F30: a message scheduled to the cancel stream was a forged cancel).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache

from hopsched.errors import InvalidSettingsError

__all__ = ["TargetPattern", "TargetPolicy"]


@dataclass(frozen=True, slots=True)
class TargetPattern:
    """One ``EXCHANGE/ROUTING-KEY`` pattern; both halves are shell-style globs
    (``*``, ``?``, ``[seq]``, case-sensitive). The text splits at its first ``/``, so
    ``/orders.*`` is the default exchange with routing keys ``orders.*`` and ``*/*``
    allows everything.
    """

    exchange: str
    routing_key: str

    @classmethod
    def parse(cls, text: str) -> TargetPattern:
        """Raises InvalidSettingsError: ``text`` has no ``/``."""
        exchange, sep, routing_key = text.partition("/")
        if not sep:
            raise InvalidSettingsError(
                f"allowed target {text!r}: write EXCHANGE/ROUTING-KEY globs, e.g. "
                "'orders/timeout.*', or '/reminders' for the default exchange"
            )
        return cls(exchange, routing_key)

    def matches(self, exchange: str, routing_key: str) -> bool:
        return fnmatchcase(exchange, self.exchange) and fnmatchcase(routing_key, self.routing_key)

    def __str__(self) -> str:
        return f"{self.exchange}/{self.routing_key}"


class TargetPolicy:
    """An allow list of targets; an empty one allows every target outside the prefix's
    own namespace (``internal``).

    Args:
        patterns: ``EXCHANGE/ROUTING-KEY`` globs (``TargetPattern``).
        prefix: the ladder's prefix, whose objects are never a target; None: no such
            check (a policy for tests of the allow list alone).
    """

    def __init__(self, patterns: Iterable[str], prefix: str | None = None) -> None:
        self.patterns = tuple(TargetPattern.parse(text) for text in patterns)
        self.prefix = prefix
        self._own = None if prefix is None else f"{prefix}."
        # Targets repeat: remember answers (bounded, so odd traffic cannot grow it).
        self.allows = lru_cache(maxsize=4096)(self._allows)

    def _allows(self, exchange: str, routing_key: str) -> bool:
        """True if some pattern matches, or there are no patterns."""
        if not self.patterns:
            return True
        return any(pattern.matches(exchange, routing_key) for pattern in self.patterns)

    def internal(self, exchange: str, routing_key: str) -> str | None:
        """Why the target is one of hopsched's own objects (an exchange ``{prefix}.…``,
        or the default exchange with routing key ``{prefix}.…``), or None if it is not.

        Bindings an operator added from another exchange to hopsched's queues cannot be
        seen over AMQP 0-9-1; a message relayed through one into the cancel stream is
        ignored by every relay (``hopsched.journal.cancels``).
        """
        own = self._own
        if own is None or not (
            exchange.startswith(own) or (exchange == "" and routing_key.startswith(own))
        ):
            return None
        if exchange.startswith(f"{own}due."):  # an ingress's due exchange: consumers' own
            return None
        return (
            f"target exchange {exchange!r} routing key {routing_key!r} is inside hopsched's own "
            f"namespace {own}* (its step, relay and parking queues, cancel stream and "
            "exchange): hopsched never delivers there. Give a target of your own; to cancel "
            "or reschedule, use Scheduler.cancel() or reschedule() (hopsched cancel, hopsched "
            "reschedule)"
        )

    def refusal(self, exchange: str, routing_key: str) -> str | None:
        """Why the target is not allowed (``internal``, or not in the allow list), or None
        if it is."""
        if internal := self.internal(exchange, routing_key):
            return internal
        if self._own is not None and exchange.startswith(f"{self._own}due."):
            return None  # an ingress delivers only to its own due exchange (basic.deliver's)
        if self.allows(exchange, routing_key):
            return None
        allowed = ", ".join(repr(str(pattern)) for pattern in self.patterns)
        return (
            f"target exchange {exchange!r} routing key {routing_key!r} is not allowed "
            f"(allowed targets: {allowed}; relay option --allow-target)"
        )
