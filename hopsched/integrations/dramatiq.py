"""Dramatiq delays delivered by hopsched (``hopsched[dramatiq]``).

``HopschedBroker`` is Dramatiq's ``RabbitmqBroker`` whose delayed messages
(``send_with_options(delay=…)``, the ``Retries`` middleware's back-off, anything
``broker.enqueue(message, delay=…)``) are scheduled on hopsched instead of the
queue's ``.DQ``: hopsched delivers each to the actor's queue when due, encoded as
Dramatiq's worker would have re-enqueued it from ``.DQ``, so no worker holds it in
memory meanwhile. The schedule id is the message id: ``broker.cancel(message_id)``
cancels it durably. docs/dramatiq.md.
"""

from __future__ import annotations

from typing import Any

import aio_pika
from dramatiq import Message
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import current_millis, dq_name

from hopsched.client.scheduler import Cancelled
from hopsched.core.clock import us_to_datetime
from hopsched.errors import HopschedError
from hopsched.integrations.sync import SyncScheduler, fall_back_or_raise
from hopsched.settings import Settings

__all__ = ["HopschedBroker"]


class HopschedBroker(RabbitmqBroker):
    """A ``RabbitmqBroker`` whose delayed messages go through hopsched.

    Args:
        hopsched_settings: hopsched's broker, prefix and ladder; a relay must serve the
            prefix.
        declare: declare the prefix's topology if it does not exist.
        fallback: when hopsched cannot take a delayed message (its broker unreachable,
            the prefix not declared, a publish unconfirmed), enqueue it on ``.DQ`` as
            ``RabbitmqBroker`` would, with a WARNING, rather than raise: a ``Retries``
            back-off that raised in a worker was acked and lost. False: raise.
        kwargs: ``RabbitmqBroker``'s own (``url``, ``middleware``, ``max_priority``,
            ``confirm_delivery``, ...).

    Attributes:
        hopsched: the ``SyncScheduler`` delayed messages are scheduled on.
    """

    def __init__(
        self,
        *,
        hopsched_settings: Settings,
        declare: bool = False,
        fallback: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.hopsched = SyncScheduler(hopsched_settings, declare=declare)
        self.fallback = fallback

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Enqueue ``message``; with a ``delay`` (ms), schedule it on hopsched.

        Returns:
            The message as ``RabbitmqBroker.enqueue`` returns it (with ``delay``: a copy
            on the ``.DQ`` name carrying ``eta``, ms since the epoch, as middleware
            expects), once the broker confirmed it.

        Raises:
            As ``RabbitmqBroker.enqueue``; with ``delay``, hopsched's errors of the
            caller's making (``InvalidScheduleError``, ...), and, without ``fallback``,
            as ``Scheduler.schedule`` (``BrokerUnavailableError``,
            ``PublishTimeoutError``, ``PrefixNotDeclaredError``, ...).
        """
        if delay is None or delay <= 0:
            return super().enqueue(message, delay=delay)
        eta_ms = current_millis() + delay
        queue_name = message.queue_name
        # What middleware sees and what send() returns, as RabbitmqBroker makes it.
        delayed = message.copy(queue_name=dq_name(queue_name), options={"eta": eta_ms})
        self.declare_queue(queue_name, ensure=True)  # as RabbitmqBroker does before sending
        self.emit_before("enqueue", delayed, delay)
        # Delivered as the worker would re-enqueue it from .DQ: its queue, no eta.
        try:
            self.hopsched.schedule(
                aio_pika.Message(
                    message.encode(),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    priority=message.options.get("broker_priority"),
                ),
                at=us_to_datetime(eta_ms * 1000),
                routing_key=queue_name,
                schedule_id=message.message_id,
            )
        except HopschedError as error:
            fall_back_or_raise(
                error,
                enabled=self.fallback,
                what=f"message {message.message_id}",
                instead=f"it goes on {dq_name(queue_name)}, held by a worker until due",
                notes=self,
            )
            # Middleware sees before_enqueue again, as on RabbitmqBroker's own retries.
            return super().enqueue(message, delay=delay)
        self.emit_after("enqueue", delayed, delay)
        return delayed

    def cancel(self, message_id: str) -> Cancelled:
        """Cancel a delayed message durably (and every retry of it scheduled so far):
        hopsched will not deliver it. A message already delivered is not stopped.

        Returns:
            ``Cancelled``, once the broker confirmed the cancel.

        Raises:
            As ``Scheduler.cancel``: BrokerUnavailableError, PublishTimeoutError, ...
        """
        return self.hopsched.cancel(message_id)

    def close(self) -> None:
        """Close Dramatiq's connections and hopsched's."""
        super().close()
        self.hopsched.close()
