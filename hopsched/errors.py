"""One exception tree: everything hopsched raises on purpose is a HopschedError."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AccessRefusedError",
    "BrokerUnavailableError",
    "EnvelopeError",
    "HopschedError",
    "InvalidScheduleError",
    "PublishRejectedError",
    "TopologyMismatchError",
]


class HopschedError(Exception):
    """Base class of every error hopsched raises on purpose."""


class InvalidScheduleError(HopschedError, ValueError):
    """A `schedule()` call or a setting was given a value it cannot use.

    Also a `ValueError`, so callers that validate input generically catch it.
    """


class EnvelopeError(HopschedError, ValueError):
    """A message's hopsched headers are missing, of the wrong type or version.

    Attributes:
        headers: the raw AMQP headers as received (for the parked message and logs).
    """

    def __init__(self, reason: str, headers: Mapping[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.headers = dict(headers or {})


class TopologyMismatchError(HopschedError):
    """A queue already exists on the broker with other arguments (AMQP 406).

    RabbitMQ refuses to redeclare a queue with different arguments
    (PRECONDITION_FAILED, https://www.rabbitmq.com/docs/queues#property-equivalence).
    Retrying cannot help, so this is raised once and never retried.
    """

    def __init__(
        self,
        queue: str,
        argument: str,
        wanted: str,
        existing: str,
        broker_text: str,
        *,
        kind: str = "queue",
    ) -> None:
        self.queue = queue
        self.argument = argument
        self.wanted = wanted
        self.existing = existing
        self.broker_text = broker_text
        super().__init__(
            f"{kind} {queue!r} already exists with {argument}={existing}, but this "
            f"configuration declares {argument}={wanted}. Fix: use the same settings as "
            f"the processes already running on this prefix (queue type, ladder), or pick "
            f"another --prefix, or delete the {kind} once it is empty"
            + (
                f" (rabbitmqctl delete_queue {queue}; its messages are lost)"
                if kind == "queue"
                else ""
            )
            + f". Broker said: {broker_text}"
        )


class AccessRefusedError(HopschedError):
    """The broker refused this user an operation (AMQP 403 ACCESS_REFUSED)."""


class BrokerUnavailableError(HopschedError, ConnectionError):
    """The broker could not be reached or refused the login. The URL is shown masked."""


class PublishRejectedError(HopschedError):
    """The broker did not accept a publish (negative confirm, or no route to the queue)."""
