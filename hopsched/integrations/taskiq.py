"""Taskiq delays delivered by hopsched (``hopsched[taskiq]``).

``HopschedBroker`` is taskiq-aio-pika's ``AioPikaBroker`` whose delayed tasks (the
``delay`` label: ``task.kicker().with_labels(delay=30).kiq(...)``, ``@broker.task(delay=…)``)
are scheduled on hopsched instead of its delay queue (a per-message TTL, which a queue
expires only at its head) or the delayed-message plugin (which RabbitMQ 4.3 cannot
run): hopsched publishes each to the broker's exchange with the task's routing key when
it is due, as ``AioPikaBroker.kick`` would have published it then. The schedule id is
the task id: ``broker.cancel(task_id)`` or ``hopsched cancel TASK_ID`` cancels it durably.
Tasks without a delay are sent as before. With ``fallback`` and a ``delay_queue`` (or the
plugin) configured, a delayed task hopsched cannot take goes that way instead, with a
WARNING. docs/taskiq.md.
"""

from __future__ import annotations

from typing import Any

import aio_pika
from taskiq import BrokerMessage
from taskiq_aio_pika import AioPikaBroker
from taskiq_aio_pika.exceptions import IncorrectRoutingKeyError

from hopsched.client.scheduler import Cancelled, Scheduler
from hopsched.errors import HopschedError, InvalidSettingsError
from hopsched.integrations.sync import fall_back_or_raise
from hopsched.settings import Settings

__all__ = ["HopschedBroker"]


class HopschedBroker(AioPikaBroker):
    """An ``AioPikaBroker`` whose delayed tasks go through hopsched.

    Args:
        hopsched_settings: hopsched's broker, prefix and ladder; a relay must serve the
            prefix.
        declare: declare the prefix's topology if it does not exist.
        fallback: when hopsched cannot take a delayed task (its broker unreachable, the
            prefix not declared, a publish unconfirmed), send it through
            ``AioPikaBroker``'s own delay, with a WARNING, rather than raise. Needs that
            delay configured: ``delay_queue=`` (or ``delayed_message_exchange_plugin``);
            taskiq-aio-pika has none by default. False: raise.
        kwargs: ``AioPikaBroker``'s own (``url``, ``exchange``, ``task_queues``, ``qos``,
            ...). Its ``delay_queue`` and ``delayed_message_exchange_plugin`` are used
            for delays only by ``fallback``: otherwise hopsched is.

    Raises:
        InvalidSettingsError: ``fallback`` without a delay of ``AioPikaBroker``'s own.

    Attributes:
        hopsched: the ``Scheduler`` delayed tasks are scheduled on (entered by
            ``startup()``, closed by ``shutdown()``).
    """

    def __init__(
        self,
        *,
        hopsched_settings: Settings,
        declare: bool = False,
        fallback: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if fallback and not (self._delay_queue or self._delayed_message_exchange_plugin):
            raise InvalidSettingsError(
                "fallback=True needs a delay of taskiq-aio-pika's own to fall back to: "
                "pass delay_queue=Queue(name=...) (or delayed_message_exchange_plugin=True), "
                "or fallback=False"
            )
        self.hopsched = Scheduler(hopsched_settings, declare=declare)
        self.fallback = fallback

    async def startup(self) -> None:
        """Start taskiq's side, then connect to hopsched's prefix.

        Raises:
            As ``AioPikaBroker.startup``; without ``fallback``, hopsched's
            ``BrokerUnavailableError``, ``PrefixNotDeclaredError`` (no relay ever served
            the prefix, and not ``declare``). With it, a WARNING: each delayed task
            tries hopsched again, and falls back while it cannot.
        """
        await super().startup()
        try:
            await self.hopsched.__aenter__()
        except HopschedError as error:
            fall_back_or_raise(
                error,
                enabled=self.fallback,
                what="this broker's delayed tasks for now",
                instead="they go through taskiq-aio-pika's own delay until it does",
            )

    async def shutdown(self) -> None:
        await self.hopsched.close()
        await super().shutdown()

    async def kick(self, message: BrokerMessage) -> None:
        """Send ``message``; with a ``delay`` label (seconds), schedule it on hopsched.

        Raises:
            As ``AioPikaBroker.kick``; with a delay, hopsched's errors of the caller's
            making (``InvalidScheduleError`` for a delay that is not a number, ...), and,
            without ``fallback``, as ``Scheduler.schedule`` (``BrokerUnavailableError``,
            ``PublishTimeoutError``, ``PrefixNotDeclaredError``, ...).
        """
        delay = message.labels.get("delay")
        if delay is None:
            await super().kick(message)
            return
        priority = message.labels.get(self._label_for_priority)
        task = aio_pika.Message(  # as AioPikaBroker.kick builds it, with the id as message_id
            body=message.message,
            headers={"task_id": message.task_id, "task_name": message.task_name, **message.labels},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            priority=None if priority is None else int(priority),
            message_id=message.task_id,
        )
        try:
            await self.hopsched.schedule(
                task,
                delay=float(delay),
                exchange=self._exchange.name,
                routing_key=self._routing_key(message),
                schedule_id=message.task_id,
            )
        except HopschedError as error:
            fall_back_or_raise(
                error,
                enabled=self.fallback,
                what=f"task {message.task_id}",
                instead="it goes through taskiq-aio-pika's own delay",
                notes=self,
            )
            await super().kick(message)

    async def cancel(self, task_id: str) -> Cancelled:
        """Cancel the delayed task ``task_id`` durably (``Scheduler.cancel``)."""
        return await self.hopsched.cancel(task_id)

    def _routing_key(self, message: BrokerMessage) -> str:
        """The routing key ``AioPikaBroker.kick`` gives ``message``: its one queue's, else
        the routing label's (checked against the queues for a direct exchange)."""
        if len(self._task_queues) == 1:
            queue = self._task_queues[0]
            return queue.routing_key or queue.name
        key = str(message.labels.get(self._label_for_routing) or "")
        known = {queue.routing_key or queue.name for queue in self._task_queues}
        if self._exchange.type == aio_pika.ExchangeType.DIRECT and key not in known:
            raise IncorrectRoutingKeyError(
                f"Routing key '{key}' is not valid. "
                "Check routing keys and queue names in broker queues."
            )
        return key
