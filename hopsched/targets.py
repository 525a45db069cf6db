"""Which targets a relay may publish to: ``EXCHANGE/ROUTING-KEY`` glob patterns. Pure.

RabbitMQ's own permissions cannot say this: a user who may write to the default
exchange (``amq.default``, which hops need) may publish to every queue of the vhost,
and topic permissions apply to topic exchanges only
(https://www.rabbitmq.com/docs/access-control#topic-authorisation). So the relay
checks each message's target against an allow list before it publishes anything.
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
    """An allow list of targets; an empty one allows every target."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(TargetPattern.parse(text) for text in patterns)
        # Targets repeat: remember answers (bounded, so odd traffic cannot grow it).
        self.allows = lru_cache(maxsize=4096)(self._allows)

    def _allows(self, exchange: str, routing_key: str) -> bool:
        """True if some pattern matches, or there are no patterns."""
        if not self.patterns:
            return True
        return any(pattern.matches(exchange, routing_key) for pattern in self.patterns)

    def refusal(self, exchange: str, routing_key: str) -> str | None:
        """Why the target is not allowed, or None if it is."""
        if self.allows(exchange, routing_key):
            return None
        allowed = ", ".join(repr(str(pattern)) for pattern in self.patterns)
        return (
            f"target exchange {exchange!r} routing key {routing_key!r} is not allowed "
            f"(allowed targets: {allowed}; relay option --allow-target)"
        )
