"""Celery tasks with a countdown or an eta, delivered by hopsched (``hopsched[celery]``).

``install(app, settings)`` once where the app is made (producers and workers import
it): from then on every task message Celery sends with an eta still in the future
(``apply_async(countdown=…, eta=…)``, ``self.retry(countdown=…)``, ``send_task``,
signatures, chains' delayed links) is serialized by Celery and kombu as usual, then
handed to hopsched instead of the broker: it reaches its queue when due, without its
``eta`` header, so the worker runs it at once and holds nothing in memory. The
schedule id is the task id: ``cancel(app, task_id)`` cancels it durably. docs/celery.md.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import cached_property
from typing import Any
from zoneinfo import ZoneInfo

import aio_pika
from celery import Celery
from celery.app.amqp import AMQP
from celery.canvas import Signature
from celery.result import AsyncResult
from kombu import compression, serialization
from kombu.entity import DELIVERY_MODES, Exchange

from hopsched.client.scheduler import Cancelled
from hopsched.core.clock import now_us, us_to_datetime
from hopsched.errors import HopschedError, InvalidScheduleError, InvalidSettingsError
from hopsched.integrations.sync import SyncScheduler, fall_back_or_raise
from hopsched.settings import Settings

__all__ = ["HopschedAMQP", "cancel", "install", "schedule_signature", "scheduler"]

#: Celery's native delayed delivery (quorum queues, 5.5+) sends a delayed task to this
#: exchange (``PREFIX_`` first, with a prefix); its delivery exchange forwards it to the
#: task's exchange by the routing key's ``#.KEY`` binding, with no further delay.
_NATIVE_DELAYED = "celery_delayed_27"
_NATIVE_DELIVERY = "celery_delayed_delivery"
#: The basic properties Celery may set that the delivered message keeps; ``expiration``
#: is not kept (it would count from the scheduling instant): the worker enforces the
#: task's own ``expires`` header instead.
_KEPT_PROPERTIES = (
    "priority",
    "correlation_id",
    "reply_to",
    "message_id",
    "type",
    "app_id",
    "user_id",
)


class HopschedAMQP(AMQP):  # type: ignore[misc]  # celery has no type information
    """``app.amqp`` of an app ``install()`` was called on: task messages whose eta is
    still to come are scheduled on ``hopsched_scheduler``, the rest sent as usual."""

    hopsched_scheduler: SyncScheduler
    hopsched_fallback: bool = True

    @cached_property
    def send_task_message(self) -> Callable[..., Any]:
        send: Callable[..., Any] = self._create_task_sender()
        app, scheduler, fallback = self.app, self.hopsched_scheduler, self.hopsched_fallback

        def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
            due = _due(app, message.headers)
            if due is None:
                return send(producer, name, message, **options)
            diverted = _Diverted(producer, scheduler, message.headers, due, fallback)
            return send(diverted, name, message, **options)

        return send_task_message


def install(
    app: Celery, settings: Settings, *, declare: bool = False, fallback: bool = True
) -> SyncScheduler:
    """Send ``app``'s delayed tasks through hopsched (see the module's docstring).

    Call it where the app is configured, before it sends a task (producers and
    workers alike: a worker's ``retry(countdown=…)`` sends a delayed task too).

    Args:
        app: the Celery app; task protocol 2 (Celery's default).
        settings: hopsched's broker, prefix and ladder; a relay must serve the prefix.
        declare: declare the prefix's topology if it does not exist.
        fallback: when hopsched cannot take a task (its broker unreachable, the prefix
            not declared, a publish unconfirmed), send it with its eta as Celery would
            without hopsched, with a WARNING, rather than raise: a ``retry`` that raised
            in a worker was rejected and lost. False: raise.

    Returns:
        The ``SyncScheduler`` the app now uses (also ``scheduler(app)``).

    Raises:
        InvalidSettingsError: ``app`` is not a Celery app.
    """
    if not isinstance(app, Celery):
        raise InvalidSettingsError(f"install() needs a Celery app, not {type(app).__name__}")
    bridge = SyncScheduler(settings, declare=declare)
    app.amqp_cls = type(
        "HopschedAMQP",
        (HopschedAMQP,),
        {"hopsched_scheduler": bridge, "hopsched_fallback": fallback},
    )
    app.__dict__.pop("amqp", None)  # an app.amqp made before uses the new class from now
    return bridge


def scheduler(app: Celery) -> SyncScheduler:
    """The ``SyncScheduler`` ``install()`` gave ``app`` (for ``get``, ``cancel``).

    Raises:
        InvalidSettingsError: ``install()`` was not called on ``app``.
    """
    amqp = app.amqp
    if not isinstance(amqp, HopschedAMQP):
        raise InvalidSettingsError(
            f"Celery app {app.main!r} does not send through hopsched: call "
            "hopsched.integrations.celery.install(app, settings) where it is configured"
        )
    return amqp.hopsched_scheduler


def cancel(app: Celery, task_id: str, *, due: datetime | None = None) -> Cancelled:
    """Cancel a delayed task durably: hopsched will not deliver it (nor any of its
    retries scheduled so far). Celery's ``revoke`` only tells the workers running now,
    in memory; this survives restarts. A task already delivered is not stopped by it:
    call ``app.control.revoke(task_id)`` as well for that.

    Args:
        app: the app ``install()`` was called on.
        task_id: the task's id (its schedule id).
        due: its due time, if known: ``Cancelled.in_time`` then says whether the cancel
            came at least ``hopsched.client.scheduler.CANCEL_LEAD_S`` (50 ms) before it.

    Returns:
        ``Cancelled``, once the broker confirmed the cancel.

    Raises:
        InvalidSettingsError: ``install()`` was not called on ``app``.
        As ``Scheduler.cancel``: BrokerUnavailableError, PublishTimeoutError, ...
    """
    return scheduler(app).cancel(task_id, due=due)


def schedule_signature(
    sig: Signature, *, at: datetime, schedule_id: str | None = None, **options: Any
) -> AsyncResult:
    """Run a signature at ``at`` through hopsched: ``sig.apply_async(eta=at,
    task_id=schedule_id, **options)`` on an app ``install()`` was called on.

    Args:
        sig: the signature (its app must have hopsched installed).
        at: the due time, a timezone-aware datetime.
        schedule_id: the task id, and so the schedule id (default: a new one).
        options: further ``apply_async`` options (queue, priority, headers, ...).

    Returns:
        The task's ``AsyncResult`` (its ``id`` is the schedule id), once the broker
        confirmed the scheduled message.

    Raises:
        InvalidScheduleError: ``at`` is naive.
        InvalidSettingsError: the signature's app does not send through hopsched.
    """
    if at.tzinfo is None:
        raise InvalidScheduleError(f"at={at.isoformat()}: give a timezone-aware datetime")
    scheduler(sig.app)
    result: AsyncResult = sig.apply_async(eta=at, task_id=schedule_id, **options)
    return result


def _due(app: Celery, headers: dict[str, Any]) -> datetime | None:
    """The task message's eta if still to come, else None (sent at once).

    Raises:
        InvalidSettingsError: a task protocol other than 2 (its eta is in the body).
    """
    if app.conf.task_protocol != 2:
        raise InvalidSettingsError(
            f"task_protocol={app.conf.task_protocol}: hopsched needs Celery's task "
            "protocol 2 (the default): remove the task_protocol setting"
        )
    eta = headers.get("eta")
    if not eta:
        return None
    due = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
    if due.tzinfo is None:  # as the worker reads a naive eta: in the app's time zone
        zone = app.timezone
        due = due.replace(tzinfo=zone if zone is not None else ZoneInfo("UTC"))
    return due if due > us_to_datetime(now_us()) else None


class _Diverted:
    """Stands in for the producer while one task message is sent: that message (the
    one whose headers are ``headers``) is scheduled on hopsched; anything else (the
    ``task-sent`` event) and every other attribute go to the real producer. With
    ``fallback``, a message hopsched cannot take goes to the real producer too."""

    def __init__(
        self,
        producer: Any,
        scheduler: SyncScheduler,
        headers: dict[str, Any],
        due: datetime,
        fallback: bool,
    ) -> None:
        self._producer = producer
        self._scheduler = scheduler
        self._headers = headers
        self._due = due
        self._fallback = fallback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **options: Any) -> None:
        if options.get("headers") is not self._headers:
            self._producer.publish(body, **options)
            return
        try:
            self._schedule(body, **options)
        except HopschedError as error:
            task = f"task {self._headers.get('id')}"
            fall_back_or_raise(
                error,
                enabled=self._fallback,
                what=task,
                instead="sent with its eta, held by a worker until due",
                notes=self._scheduler,
            )
            self._producer.publish(body, **options)

    def _schedule(
        self,
        body: Any,
        *,
        exchange: str | Exchange | None,
        routing_key: str | None,
        serializer: str | None = None,
        compression: str | None = None,
        headers: dict[str, Any],
        delivery_mode: int | str | None = None,
        declare: list[Any] | None = None,
        retry: bool = False,
        retry_policy: dict[str, Any] | None = None,
        **properties: Any,
    ) -> None:
        # The queue exists from now on, as when Celery publishes the task itself.
        for entity in declare or ():
            self._producer.maybe_declare(entity, retry=retry, **(retry_policy or {}))
        data, content_type, content_encoding, headers = _serialize(
            body, serializer or self._producer.serializer, compression, headers
        )
        exchange_name = exchange.name if isinstance(exchange, Exchange) else exchange or ""
        if exchange_name.endswith(_NATIVE_DELAYED):
            exchange_name = exchange_name.removesuffix(_NATIVE_DELAYED) + _NATIVE_DELIVERY
        mode = DELIVERY_MODES[delivery_mode] if isinstance(delivery_mode, str) else delivery_mode
        message = aio_pika.Message(
            data,
            headers={key: value for key, value in headers.items() if key != "eta"},
            content_type=content_type,
            content_encoding=content_encoding,
            delivery_mode=aio_pika.DeliveryMode(mode or 2),
            **{key: properties[key] for key in _KEPT_PROPERTIES if properties.get(key)},
        )
        self._scheduler.schedule(
            message,
            at=self._due,
            exchange=exchange_name,
            routing_key=routing_key or "",
            schedule_id=headers["id"],
        )


def _serialize(
    body: Any, serializer: str, compress_with: str | None, headers: dict[str, Any]
) -> tuple[bytes, str, str, dict[str, Any]]:
    """As kombu's ``Producer.publish`` encodes a body: (bytes, content type, content
    encoding, headers with ``compression`` if compressed)."""
    # kombu's serialization and compression carry no type information.
    dumped = serialization.dumps(body, serializer=serializer)  # type: ignore[no-untyped-call]
    content_type, content_encoding, data = dumped
    if isinstance(data, str):  # kombu's text serializers: bytes in the declared encoding
        data = data.encode(content_encoding)
    if compress_with:
        data, compressed_as = compression.compress(data, compress_with)  # type: ignore[no-untyped-call]
        headers = {**headers, "compression": compressed_as}
    return data, content_type, content_encoding, headers
