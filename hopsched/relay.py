"""The relay: consume ``{prefix}.relay``, then hop, hold-and-deliver, or park.

Reliability (``shared/DESIGN.md``): a delivery is acked only after the publish it
leads to (next hop, final delivery or parking) is confirmed by the broker, so a
crash duplicates, never loses. Deliveries are handled concurrently (aiormq runs
each consumer callback as a task; ``prefetch`` bounds how many), and none waits
longer than the hold window, so RabbitMQ's ``consumer_timeout`` is never reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
from aiormq.abc import DeliveredMessage

from hopsched.clock import now_us
from hopsched.connect import connect
from hopsched.envelope import (
    HEADER_HOP_EXPIRES,
    HEADER_PARKED_USER_ID,
    PERSISTENT,
    Envelope,
    delivery_headers,
    hop_headers,
    parked_headers,
)
from hopsched.errors import BrokerUnavailableError, EnvelopeError
from hopsched.ladder import US_PER_MS, Hold, Hop
from hopsched.overshoot import OvershootTracker
from hopsched.publisher import ConfirmedPublisher, TargetRefused, Unroutable, with_properties
from hopsched.settings import Settings
from hopsched.stats import LatenessStats
from hopsched.topology import Topology

__all__ = ["Relay", "RelayTotals"]

log = logging.getLogger("hopsched.relay")

_CONNECTION_LOST = (aiormq.exceptions.AMQPConnectionError, ConnectionError, OSError)
# Capped at 5 s: messages due during a broker outage wait for the next attempt after the
# broker is back, so a 30 s cap made them up to 30 s late (F09); an attempt is one refused
# TCP connect, cheap for any number of relays.
_RECONNECT_FIRST_S, _RECONNECT_MAX_S = 0.5, 5.0
_PARK_RETRY_S = 1.0
_YIELD_US = 1_000  # the last stretch of a hold, waited by yielding (see _sleep_until)


@dataclass
class RelayTotals:
    """Counts since the relay started, and lateness of its final publishes.

    ``lateness`` is measured at the relay: publish confirmed - due time.
    ``overshoot``: arrival of a hop at the relay - the instant its step's TTL ran out.
    """

    delivered: int = 0
    hops: int = 0
    parked: int = 0
    lateness: LatenessStats = field(default_factory=LatenessStats)
    overshoot: LatenessStats = field(default_factory=LatenessStats)


class Relay:
    """The relay daemon's loop. ``await relay.run()`` until ``await relay.stop()``.

    Raises (from ``run``):
        BrokerUnavailableError: the first connection fails (later losses are retried
            with back-off, 0.5 s doubling to 5 s, each attempt logged with the URL masked).
        TopologyMismatchError: the prefix's queues exist with other arguments.
    """

    def __init__(
        self, settings: Settings | None = None, *, shutdown_timeout_s: float = 10.0
    ) -> None:
        self.settings = settings or Settings()
        self.topology = Topology.from_settings(self.settings)
        self.totals = RelayTotals()
        self._last_report = RelayTotals()  # counts at the last totals line, and its window
        self._last_report_at = time.monotonic()
        self._ladder = self.settings.ladder
        self._targets = self.settings.target_policy
        self._shutdown_timeout_s = shutdown_timeout_s
        self._stopping = asyncio.Event()
        self._consuming = asyncio.Event()
        self._ever_consumed = False
        self._handlers: set[asyncio.Task[Any]] = set()
        self._held = 0  # deliveries waiting in-process for their due time
        self._held_limit = max(1, self.settings.prefetch // 2)
        self._overshoot = OvershootTracker()

    async def wait_consuming(self) -> None:
        """Return once the relay is connected and consuming."""
        await self._consuming.wait()

    async def stop(self) -> None:
        """Ask ``run()`` to stop: it cancels the consumer, finishes what it holds, returns."""
        self._stopping.set()

    async def run(self) -> None:
        """Consume until ``stop()``, reconnecting after a lost connection."""
        reporter = asyncio.create_task(self._report_periodically())
        try:
            await self._run()
        finally:
            reporter.cancel()
            if self._ever_consumed:
                self._report()
                log.info("relay stopped")

    async def _run(self) -> None:
        delay, failures, connected_before = _RECONNECT_FIRST_S, 0, False
        while not self._stopping.is_set():
            try:
                connection = await self._unless_stopping(
                    connect(self.settings, name="hopsched-relay")
                )
            except BrokerUnavailableError as error:
                if not connected_before:
                    raise  # a wrong URL at start is an error to report, not to retry
                failures += 1
                log.warning(
                    "reconnect attempt %d failed: %s; next in %.1f s", failures, error, delay
                )
                await self._sleep_unless_stopping(delay)
                delay = min(delay * 2, _RECONNECT_MAX_S)
                continue
            if connection is None:
                return  # stopped while connecting
            if failures:
                log.info(
                    "reconnected to %s after %d failed attempt(s)",
                    self.settings.masked_url,
                    failures,
                )
            delay, failures, connected_before = _RECONNECT_FIRST_S, 0, True
            try:
                await self._serve(connection)
            except _CONNECTION_LOST as error:
                log.warning(
                    "lost the connection to %s (%s); reconnecting",
                    self.settings.masked_url,
                    error or type(error).__name__,
                )
            finally:
                self._consuming.clear()
                with contextlib.suppress(Exception):
                    await connection.close()

    async def _unless_stopping(
        self, work: Coroutine[Any, Any, aio_pika.abc.AbstractConnection]
    ) -> aio_pika.abc.AbstractConnection | None:
        """``await work``, unless ``stop()`` comes first: then cancel it, return None."""
        task = asyncio.create_task(work)
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            connection = await task
            await connection.close()  # it connected just as we were cancelling
        return None

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _serve(self, connection: aio_pika.abc.AbstractConnection) -> None:
        await self.topology.declare(connection)
        publisher = ConfirmedPublisher(connection)
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=self.settings.prefetch)
        consumer = await channel.get_underlay_channel()
        lost = asyncio.Event()
        connection.close_callbacks.add(lambda *_: lost.set())
        channel.close_callbacks.add(lambda *_: lost.set())

        async def on_delivery(delivered: DeliveredMessage) -> None:
            await self._handle(consumer, publisher, delivered)

        consume_ok = await consumer.basic_consume(self.topology.relay_queue, on_delivery)
        self._consuming.set()
        self._ever_consumed = True
        log.info(
            "relay consuming %s on %s (prefetch %d, %s ladder %d..%d ms)",
            self.topology.relay_queue,
            self.settings.masked_url,
            self.settings.prefetch,
            self.settings.queue_type,
            self.settings.min_step_ms,
            self.settings.max_step_ms,
        )
        stop_wait = asyncio.create_task(self._stopping.wait())
        lost_wait = asyncio.create_task(lost.wait())
        await asyncio.wait({stop_wait, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        lost_wait.cancel()
        if lost.is_set():
            raise ConnectionError("channel or connection closed by the broker")
        await consumer.basic_cancel(consume_ok.consumer_tag or "")
        await self._drain()
        await publisher.close()

    async def _drain(self) -> None:
        """Let in-flight deliveries finish (each waits at most the hold window)."""
        if not self._handlers:
            return
        log.info("finishing %d in-flight deliveries", len(self._handlers))
        _, pending = await asyncio.wait(set(self._handlers), timeout=self._shutdown_timeout_s)
        for task in pending:  # unacked: the broker redelivers them when the channel closes
            task.cancel()

    async def _handle(
        self,
        consumer: aiormq.abc.AbstractChannel,
        publisher: ConfirmedPublisher,
        delivered: DeliveredMessage,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._route(publisher, delivered)
            await consumer.basic_ack(delivered.delivery_tag or 0)
        except (*_CONNECTION_LOST, aiormq.exceptions.ChannelInvalidStateError):
            pass  # unacked: redelivered after reconnect (at-least-once)
        except Exception:
            if consumer.is_closed:
                return  # the connection went while this delivery was held: same as above
            log.exception(
                "could not relay or park a delivery; it stays on %s and comes back",
                self.topology.relay_queue,
            )
            await asyncio.sleep(_PARK_RETRY_S)  # no hot loop on a persistent failure
            with contextlib.suppress(Exception):
                await consumer.basic_nack(delivered.delivery_tag or 0, requeue=True)
        finally:
            self._handlers.discard(task)

    async def _route(self, publisher: ConfirmedPublisher, delivered: DeliveredMessage) -> None:
        """Publish ``delivered`` onward (hop, final delivery or parking), confirmed."""
        properties = delivered.header.properties
        try:
            envelope = Envelope.from_headers(properties.headers)
        except EnvelopeError as error:
            await self._park(publisher, delivered, f"malformed envelope: {error.reason}")
            return
        if properties.user_id is not None and properties.user_id != self.settings.login:
            await self._park(
                publisher,
                delivered,
                f"user_id {properties.user_id!r} is not this relay's login "
                f"{self.settings.login!r}: RabbitMQ refuses to publish it "
                "(https://www.rabbitmq.com/docs/validated-user-id); run the relay as that user",
            )
            return
        if refusal := self._targets.refusal(envelope.exchange, envelope.routing_key):
            await self._park(publisher, delivered, refusal)
            return
        arrived_us = now_us()
        self._note_overshoot(properties.headers, arrived_us)
        action = self._plan(envelope.due_us, arrived_us)
        try:
            if isinstance(action, Hop):
                await self._hop(publisher, delivered, envelope, action.step_ms)
            else:
                self._held += 1
                try:
                    await _sleep_until(envelope.due_us)
                finally:
                    self._held -= 1
                await self._deliver(publisher, delivered, envelope)
        except (Unroutable, TargetRefused) as error:
            await self._park(publisher, delivered, f"undeliverable: {error}")
        except (TypeError, ValueError) as error:  # a header value pamqp cannot encode
            await self._park(publisher, delivered, f"cannot re-encode the message: {error}")

    def _note_overshoot(self, headers: dict[str, Any] | None, arrived_us: int) -> None:
        """Record how late a hop came back (``x-hopsched-hop-expires``), if it was one."""
        expires_us = (headers or {}).get(HEADER_HOP_EXPIRES)
        if not isinstance(expires_us, int) or isinstance(expires_us, bool):
            return
        overshoot_us = arrived_us - expires_us
        self.totals.overshoot.record(overshoot_us)
        self._last_report.overshoot.record(overshoot_us)
        # The margin is capped at the hold window anyway; clamping the sample keeps one
        # absurd value (a relay down for hours) from pinning it there for minutes.
        cap_us = self._ladder.hold_window_ms * US_PER_MS
        self._overshoot.record(min(overshoot_us, cap_us), arrived_us)

    def _plan(self, due_us: int, now: int) -> Hop | Hold:
        """The ladder's plan, with the learned margin, unless half the prefetch is held."""
        if self._held >= self._held_limit:
            # Holding is free but takes a prefetch slot: hop whatever a step fits, with the
            # configured margin, so slots free up for deliveries due now. (The learned one
            # grows with the relay's own backlog and would keep them held.)
            return self._ladder.plan(now_us=now, due_us=due_us, hold_window_ms=0)
        margin_ms = self._overshoot.margin_ms(
            now, floor_ms=self._ladder.hop_margin_ms, cap_ms=self._ladder.hold_window_ms
        )
        return self._ladder.plan(now_us=now, due_us=due_us, hop_margin_ms=margin_ms)

    async def _hop(
        self,
        publisher: ConfirmedPublisher,
        delivered: DeliveredMessage,
        envelope: Envelope,
        step_ms: int,
    ) -> None:
        await _forward(
            publisher,
            delivered,
            exchange="",
            routing_key=self.topology.step_queue(step_ms),
            headers=hop_headers(
                delivered.header.properties.headers,
                envelope.hops + 1,
                expires_us=now_us() + step_ms * US_PER_MS,
            ),
            expiration=None,
            delivery_mode=PERSISTENT,
        )
        self.totals.hops += 1

    async def _deliver(
        self, publisher: ConfirmedPublisher, delivered: DeliveredMessage, envelope: Envelope
    ) -> None:
        await _forward(
            publisher,
            delivered,
            exchange=envelope.exchange,
            routing_key=envelope.routing_key,
            headers=delivery_headers(delivered.header.properties.headers),
            expiration=envelope.expiration,
            delivery_mode=_callers_delivery_mode(envelope),
        )
        lateness_us = now_us() - envelope.due_us
        self.totals.delivered += 1
        self.totals.lateness.record(lateness_us)
        self._last_report.lateness.record(lateness_us)

    async def _park(
        self, publisher: ConfirmedPublisher, delivered: DeliveredMessage, reason: str
    ) -> None:
        """Move a message to ``{prefix}.parked`` with the reason, target and due time.

        The parked copy's ``user_id`` moves to header ``x-hopsched-user-id``: the broker
        refuses a publish whose user_id is not the relay's own login.
        """
        properties = delivered.header.properties
        headers = parked_headers(properties.headers, reason, now_us())
        if properties.user_id is not None:
            headers[HEADER_PARKED_USER_ID] = properties.user_id
        await _forward(
            publisher,
            delivered,
            exchange="",
            routing_key=self.topology.parked_queue,
            headers=_encodable(headers),
            expiration=None,
            delivery_mode=PERSISTENT,
            user_id=None,
        )
        self.totals.parked += 1
        log.warning(
            "parked a message (schedule id %s): %s",
            (properties.headers or {}).get("x-hopsched-id", "?"),
            reason,
        )

    async def _report_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.log_interval_s)
            if self._ever_consumed:
                self._report()

    def _report(self) -> None:
        """Log the last interval's counts and lateness, and the totals since start."""
        now, last = self.totals, self._last_report
        log.info(
            "last %.0f s: delivered=%d hops=%d parked=%d %s, hop overshoot %s; "
            "since start: delivered=%d hops=%d parked=%d",
            time.monotonic() - self._last_report_at,
            now.delivered - last.delivered,
            now.hops - last.hops,
            now.parked - last.parked,
            last.lateness.summary(),
            last.overshoot.summary().removeprefix("lateness "),
            now.delivered,
            now.hops,
            now.parked,
        )
        self._last_report = RelayTotals(now.delivered, now.hops, now.parked)
        self._last_report_at = time.monotonic()


def _encodable(value: Any) -> Any:
    """``value`` with what pamqp cannot encode made encodable (bytes become byte arrays)."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {k: _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value


async def _forward(
    publisher: ConfirmedPublisher,
    delivered: DeliveredMessage,
    *,
    exchange: str,
    routing_key: str,
    **changes: Any,
) -> None:
    """Publish ``delivered``'s body and properties, with ``changes``, confirmed."""
    await publisher.publish(
        delivered.body,
        with_properties(delivered.header.properties, **changes),
        exchange=exchange,
        routing_key=routing_key,
    )


def _callers_delivery_mode(envelope: Envelope) -> int | None:
    """The delivery mode the caller gave: the envelope records it only when not 2."""
    if envelope.delivery_mode is None:
        return PERSISTENT
    return envelope.delivery_mode or None


async def _sleep_until(due_us: int) -> None:
    """Sleep until the wall clock reads ``due_us``; re-checked, so never early.

    asyncio's epoll wait rounds its timeout up to whole milliseconds (CPython's
    ``select.epoll.poll``), so a plain timer fires 0-1 ms late, and later still when the
    process has gone idle. The last ``_YIELD_US`` are waited by yielding to the event
    loop, which goes on serving other deliveries meanwhile. Measured with
    ``benchmarks/accuracy.py`` (300 held messages at 30/s): lateness p50 3.14 -> 2.20 ms,
    p99 8.2 -> 5.5 ms, for no measurable CPU; at 500/s the relay used 8 % more CPU.
    """
    while (wait_us := due_us - now_us()) > _YIELD_US:  # noqa: ASYNC110 - a timer, not a poll
        await asyncio.sleep((wait_us - _YIELD_US) / 1_000_000)
    while due_us > now_us():  # noqa: ASYNC110 - sub-millisecond: the timer is too coarse
        await asyncio.sleep(0)
