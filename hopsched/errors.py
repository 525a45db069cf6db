"""One exception tree: everything hopsched raises on purpose is a HopschedError."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AccessRefusedError",
    "BrokerConnectionLost",
    "BrokerUnavailableError",
    "ChannelClosedError",
    "EnvelopeError",
    "HopschedError",
    "InvalidScheduleError",
    "InvalidSettingsError",
    "LadderMismatchError",
    "ManagementAPIError",
    "MessageTooLargeError",
    "MetricsEndpointError",
    "PrefixNotDeclaredError",
    "PublishRejectedError",
    "PublishTimeoutError",
    "TargetCheckError",
    "TargetRefused",
    "TopologyMismatchError",
    "Unroutable",
    "UnroutableTargetError",
]


class HopschedError(Exception):
    """Base class of every error hopsched raises on purpose."""


class InvalidScheduleError(HopschedError, ValueError):
    """A ``schedule()`` call was given a value it cannot use; nothing was sent.

    Also a ``ValueError``, so callers that validate input generically catch it.
    """


class InvalidSettingsError(HopschedError, ValueError):
    """A ``Settings`` field (or its ``HOPSCHED_*`` variable) has a value hopsched cannot use."""


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
        fix: str | None = None,
    ) -> None:
        self.queue = queue
        self.argument = argument
        self.wanted = wanted
        self.existing = existing
        self.broker_text = broker_text
        if fix is None:
            fix = (
                "use the same settings as the processes already running on this prefix "
                f"(queue type, ladder), or pick another --prefix, or delete the {kind} once "
                "it is empty"
                + (
                    f" (rabbitmqctl delete_queue {queue}; its messages are lost)"
                    if kind == "queue"
                    else ""
                )
            )
        super().__init__(
            f"{kind} {queue!r} already exists with {argument}={existing}, but this "
            f"configuration declares {argument}={wanted}. Fix: {fix}. Broker said: "
            f"{broker_text}"
        )


class LadderMismatchError(TopologyMismatchError):
    """The prefix's step queues are another ladder's: this process would publish into
    steps nothing else declares (``hopsched.broker.objects.check_ladder``). Not worth retrying.

    Attributes:
        prefix: the prefix.
        wanted: this process's ladder, as settings (``Ladder.description``).
        existing: the steps found on the broker, as settings where they form a ladder.
        missing: the step queues this ladder has and the broker does not.
    """

    def __init__(self, prefix: str, wanted: str, existing: str, missing: list[str]) -> None:
        self.prefix = prefix
        self.queue = missing[0]
        self.argument = "ladder"
        self.wanted = wanted
        self.existing = existing
        self.missing = missing
        self.broker_text = ""
        shown = ", ".join(missing[:3])
        if len(missing) > 3:
            shown += f" and {len(missing) - 3} more"
        HopschedError.__init__(
            self,
            f"prefix {prefix!r} was declared with another ladder: the broker has {existing}, "
            f"this process's settings give {wanted}, whose step queues {shown} do not "
            "exist (its hops would go into queues the prefix's relays did not declare). "
            "Fix: give every Scheduler and relay of the prefix the same ladder "
            "(HOPSCHED_STEP_RATIO, HOPSCHED_MIN_STEP_MS, HOPSCHED_MAX_STEP_MS; Settings."
            "step_ratio, min_step_ms, max_step_ms), here the broker's; to change the "
            "prefix's ladder, use a new prefix, or stop its relays once it is empty and "
            f"run `hopsched teardown --prefix {prefix}` first",
        )


class PrefixNotDeclaredError(HopschedError):
    """The prefix's queues are not on the broker (a mistyped prefix, or never declared):
    nothing was sent, declared or deleted.

    Attributes:
        prefix: the prefix asked for.
        queue: the queue that was looked for and is missing, e.g. ``{prefix}.relay``.
    """

    def __init__(self, message: str, *, prefix: str, queue: str) -> None:
        super().__init__(message)
        self.prefix = prefix
        self.queue = queue


class AccessRefusedError(HopschedError):
    """The broker refused this user an operation (AMQP 403 ACCESS_REFUSED)."""


class MetricsEndpointError(HopschedError, OSError):
    """The metrics endpoint cannot listen (its port is in use, or the address is not
    this machine's); the message names the port and how to fix it."""


class ManagementAPIError(HopschedError):
    """RabbitMQ's management HTTP API did not answer, or refused (``hopsched.broker.management``).

    Attributes:
        status: the last HTTP status received (401/403: the user lacks the tag; 404: no
            such object), None if no base URL answered at all.
    """

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.status = status


class BrokerUnavailableError(HopschedError, ConnectionError):
    """No broker answered, or it refused the login. The URL is shown masked."""


class BrokerConnectionLost(BrokerUnavailableError):
    """The connection went while a call was in progress: the broker closed it (then
    ``reply_code`` and ``reply_text`` say why), the network dropped it, or the broker
    stopped answering (missed heartbeats).

    A publish that was in flight may or may not have reached the broker.
    """

    def __init__(self, reason: str, reply_code: int = 0, reply_text: str = "") -> None:
        super().__init__(reason)
        self.reply_code = reply_code
        self.reply_text = reply_text


class ChannelClosedError(HopschedError):
    """The broker closed an AMQP channel (``channel.close``): e.g. 404 NOT_FOUND for a
    missing exchange, 403 ACCESS_REFUSED, 406 PRECONDITION_FAILED
    (https://www.rabbitmq.com/amqp-0-9-1-reference#constants)."""

    def __init__(self, reply_code: int, reply_text: str, class_id: int = 0, method_id: int = 0):
        super().__init__(f"{reply_code} {reply_text}")
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.class_id = class_id
        self.method_id = method_id


class PublishRejectedError(HopschedError):
    """The broker did not accept a publish (negative confirm, or no route to the queue)."""


class Unroutable(PublishRejectedError):
    """The broker returned the message (``mandatory``): no queue is bound for its routing key."""


class UnroutableTargetError(InvalidScheduleError, Unroutable):
    """``schedule(check_target=True)`` found that the target would not take the message:
    its exchange does not exist or is internal, or no binding routes its routing key to
    a queue. Nothing was scheduled."""


class TargetCheckError(HopschedError):
    """``schedule(check_target=True)`` could not tell whether the target routes (no
    management API answered, or an exchange type it cannot follow); nothing was
    scheduled."""


class TargetRefused(PublishRejectedError):
    """The broker closed the channel for this publish (missing exchange, access refused,
    a property it refuses); the text gives the broker's reply."""


class MessageTooLargeError(InvalidScheduleError, TargetRefused):
    """The broker refused the message for its size (a body over its ``max_message_size``:
    406 PRECONDITION_FAILED, https://www.rabbitmq.com/docs/configure#config-items): bad
    input, so an ``InvalidScheduleError``, though only the broker could tell; nothing was
    scheduled."""


class PublishTimeoutError(HopschedError, TimeoutError):
    """No publisher confirm came within ``Settings.publish_timeout_s``: the broker is
    blocking publishers (a memory or disk alarm), frozen, or unreachable.

    The message may still be delivered: the broker may have taken it before the
    deadline passed. Consumers de-duplicate on ``x-hopsched-id``.
    """
