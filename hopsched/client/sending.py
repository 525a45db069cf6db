"""Publishing checked ``schedule()`` calls, and the Scheduler's stream writes, with
publisher confirms, all in flight together: the Scheduler's send engine.

Each publish ends in one result, in the order given, within ``Settings.publish_timeout_s``:

* confirmed (ack): ``Scheduled``;
* returned unroutable by its first queue (deleted at runtime): that queue is declared
  again, once, and the call published again;
* nacked by one of the prefix's step queues (a quorum leader election, after a node went
  down): published again at once by a smaller step (never early: it ends sooner and the
  relay hops it on), that step avoided a while (``AvoidedSteps``); with no smaller step,
  again after a back-off;
* unanswered by its step queue for ``STEP_SILENCE_S`` while the broker answered a later
  publish (a frozen quorum leader: ``amqp.Outcome.SILENT``): published again by a smaller
  step, that step avoided for ``AVOID_SILENT_FOR_US``; the first copy may still be
  delivered if the queue wakes (consumers de-duplicate on ``x-hopsched-id``);
* anything else: the hopsched error that says what happened.

The engine knows its Scheduler through three calls only: the open publisher (connecting
first), that publisher's connection was lost, and declare these queues again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hopsched import amqp
from hopsched.amqp.publisher import LADDER_LANE, Publisher
from hopsched.client.prepare import Checked, encode_properties, reroute
from hopsched.core.clock import us_to_datetime
from hopsched.core.ladder import AVOID_SILENT_FOR_US, STEP_SILENCE_S, AvoidedSteps
from hopsched.errors import (
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
    HopschedError,
    InvalidScheduleError,
    MessageTooLargeError,
    PublishRejectedError,
    PublishTimeoutError,
    TargetRefused,
    Unroutable,
)
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = ["Prepared", "Scheduled", "Sender"]

log = logging.getLogger("hopsched.scheduler")
#: ``schedule_many`` encodes and publishes this many, then lets the event loop send
#: them and read confirms while it goes on (the broker works meanwhile).
_SLICE = 500
#: Waits before publishing again what the broker nacked, s: doubling from the first to
#: the most, until ``Settings.publish_timeout_s``.
_NACK_FIRST_WAIT_S, _NACK_MAX_WAIT_S = 0.1, 2.0
#: How RabbitMQ words a body over its ``max_message_size`` (406), 3.10 and 4.0.
_TOO_LARGE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")


@dataclass(frozen=True, slots=True)
class Scheduled:
    """What ``schedule()`` returns.

    Attributes:
        schedule_id: the id carried in header ``x-hopsched-id`` on every hop and on
            delivery; consumers de-duplicate on it.
        due: the due time, an aware UTC datetime.
        due_us: the due time, integer microseconds since the Unix epoch.
        first_queue: the queue the message was published to (a step or the relay).
    """

    schedule_id: str
    due_us: int
    first_queue: str

    @property
    def due(self) -> datetime:
        return us_to_datetime(self.due_us)


@dataclass(slots=True)
class Prepared:
    """A checked ``schedule()`` call (or a stream write), encoded and ready to publish."""

    body: bytes
    properties: bytes
    exchange: str
    routing_key: str
    queue: str
    scheduled: Scheduled
    redeclared: bool = field(default=False)
    nacks: int = field(default=0)  # times the broker nacked it so far
    checked: Checked | None = field(default=None)  # what it was built from (to reroute)


class Sender:
    """Publishes batches of checked calls on the ladder lane of a Scheduler's publisher.

    Args:
        settings: the Scheduler's settings (``publish_timeout_s``, the URL for texts).
        topology: the prefix's names (a nacked step's detour).
        producer: ``x-hopsched-producer``'s value (host/pid).
        clock: µs since the Unix epoch.
        avoided: steps whose queues nacked lately, shared with the Scheduler's routing.
        publisher: the Scheduler's open publisher, connecting first.
            Raises as ``Scheduler``'s connect does.
        lost: the publisher's connection went (the next ``publisher()`` connects anew).
        redeclare: declares the named queues of the prefix again.
    """

    def __init__(
        self,
        settings: Settings,
        topology: Topology,
        *,
        producer: str,
        clock: Callable[[], int],
        avoided: AvoidedSteps,
        publisher: Callable[[], Awaitable[Publisher]],
        lost: Callable[[], None],
        redeclare: Callable[[Iterable[str]], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self.topology = topology
        self.producer = producer
        self._clock = clock
        self._ladder = settings.ladder
        self._avoided = avoided
        self._publisher = publisher
        self._lost = lost
        self._redeclare = redeclare
        self._last: Publisher | None = None  # the publisher of the last round (its blocked state)

    def build(self, checked: Checked) -> Prepared:
        """Encode a checked call's publish, or raise InvalidScheduleError."""
        envelope = checked.envelope
        return Prepared(
            checked.body,
            encode_properties(checked, self.producer),
            checked.exchange,
            checked.routing_key,
            checked.queue,
            Scheduled(envelope.schedule_id, envelope.due_us, checked.queue),
            checked=checked,
        )

    def _detour(self, item: Prepared, silent: str | None = None) -> Prepared | None:
        """A nacked step publish (or one ``silent``: the publisher's detail) built anew
        by a smaller step, its step avoided a while (``AvoidedSteps``); None if there is
        none to go by (send it again as it is)."""
        checked = item.checked
        if checked is None or checked.step_ms is None:
            return None  # the relay queue or the cancel stream: nothing to route around
        now = self._clock()
        for_us = self._avoided.for_us if silent is None else AVOID_SILENT_FOR_US
        why = "nacked a publish (a quorum leader election?)"
        if silent is not None:
            why = f"left a publish unanswered ({silent}: a frozen queue leader?)"
        log.log(  # once as a failover starts, not for every step it takes down
            logging.DEBUG if self._avoided.avoided(now) else logging.WARNING,
            "%s %s: routing by smaller steps for %.0f s",
            checked.queue,
            why,
            for_us / 1e6,
        )
        self._avoided.nacked(checked.step_ms, now, for_us)
        rerouted = reroute(
            checked,
            now_us=now,
            ladder=self._ladder,
            topology=self.topology,
            avoid=self._avoided.avoided(now),
        )
        if rerouted is checked:
            return None
        try:
            detour = self.build(rerouted)
        except InvalidScheduleError:  # it encoded before: cannot happen; send it as it was
            return None
        detour.nacks = item.nacks
        return detour

    async def send(self, checked: Sequence[Checked | Prepared]) -> list[Scheduled | HopschedError]:
        """Publish every checked call (encoding it in slices), confirms in flight
        together; the results (or errors) in order."""
        prepared: list[Checked | Prepared] = list(checked)
        timeout_s = self.settings.publish_timeout_s
        results: list[Scheduled | HopschedError | None] = [None] * len(prepared)
        try:
            async with asyncio.timeout(timeout_s):
                todo = list(range(len(prepared)))
                while todo:  # a second round for first queues declared again
                    todo = await self._round(prepared, todo, results)
        except TimeoutError:
            unsettled = [i for i, result in enumerate(results) if result is None]
            nacked = [i for i in unsettled if _nacked(prepared[i])]
            if not unsettled or len(nacked) < len(unsettled):
                raise self._timed_out(timeout_s) from None
            for index in nacked:  # nacked until the deadline: refused, not unanswered
                results[index] = self._failure(prepared[index].queue, amqp.Outcome.NACK, None)
        return [result for result in results if result is not None]

    async def _round(
        self,
        prepared: list[Checked | Prepared],
        todo: list[int],
        results: list[Scheduled | HopschedError | None],
    ) -> list[int]:
        """Publish ``prepared[i]`` for each ``i`` in ``todo`` and wait for every outcome;
        fills ``results``; returns the ones to publish again (their first queue was
        missing and is declared again)."""
        loop = asyncio.get_running_loop()
        outcomes: dict[int, tuple[amqp.Outcome, Any]] = {}
        settled = loop.create_future()

        def settle(index: int, outcome: amqp.Outcome, detail: Any) -> None:
            outcomes[index] = (outcome, detail)
            if len(outcomes) == len(todo) and not settled.done():
                settled.set_result(None)

        publisher = self._last = await self._publisher()
        for count, index in enumerate(todo, 1):
            if count % _SLICE == 0:  # let this slice leave while the next is encoded
                await asyncio.sleep(0)
            item = prepared[index]
            if isinstance(item, Checked):
                try:
                    item = prepared[index] = self.build(item)
                except InvalidScheduleError as error:
                    settle(index, amqp.Outcome.CLOSED, error)
                    continue
            what = (item.exchange, item.routing_key, item.body, item.properties)
            callback = functools.partial(settle, index)
            # Into a step: another can stand in for it if it is silent (a frozen leader).
            step = item.checked is not None and item.checked.step_ms is not None
            silence_s = STEP_SILENCE_S if step else None
            try:
                publisher.publish(LADDER_LANE, *what, callback, silence_s=silence_s)
            except ValueError as error:  # headers too large for one frame; nothing sent
                settle(index, amqp.Outcome.CLOSED, InvalidScheduleError(str(error)))
            except BrokerConnectionLost:  # nothing sent: on a new connection
                self._lost()
                publisher = self._last = await self._publisher()
                publisher.publish(LADDER_LANE, *what, callback, silence_s=silence_s)
        await settled
        again: list[int] = []
        redeclare: set[str] = set()
        nacks = 0
        for index, (outcome, detail) in outcomes.items():
            item = prepared[index]
            assert isinstance(item, Prepared) or outcome is amqp.Outcome.CLOSED
            if not isinstance(item, Prepared):
                results[index] = self._failure(item.queue, outcome, detail)
            elif outcome is amqp.Outcome.ACK:
                results[index] = item.scheduled
            elif outcome is amqp.Outcome.RETURNED and not item.redeclared:
                item.redeclared = True  # the first queue is gone: declare it again
                redeclare.add(item.queue)
                again.append(index)
            elif outcome is amqp.Outcome.NACK or outcome is amqp.Outcome.SILENT:
                # Our own step queue refused it: on a cluster, a quorum leader election
                # (a node went down), over in seconds; or left it unanswered while the
                # broker answered others (a frozen leader). Go by a smaller step at once,
                # or if there is none try again after a back-off until publish_timeout_s.
                item.nacks += 1
                again.append(index)
                silent = detail if outcome is amqp.Outcome.SILENT else None
                if (detour := self._detour(item, silent)) is not None:
                    prepared[index] = detour
                else:
                    nacks = max(nacks, item.nacks)
            else:
                results[index] = self._failure(item.queue, outcome, detail)
        for queue in redeclare:
            await self._redeclare([queue])
        if nacks:
            if nacks == 1:
                log.warning("the broker nacked a publish; trying again until publish_timeout_s")
            await asyncio.sleep(min(_NACK_FIRST_WAIT_S * 2 ** (nacks - 1), _NACK_MAX_WAIT_S))
        return again

    def _timed_out(self, timeout_s: float) -> PublishTimeoutError:
        publisher = self._last
        why = "the broker did not answer"
        if publisher is not None and publisher.connection.blocked:
            why = f"the broker blocks publishing ({publisher.connection.blocked})"
        return PublishTimeoutError(
            f"{self.settings.masked_url}: no publisher confirm within {timeout_s:g} s: {why}. "
            "The message may still be delivered (de-duplicate on x-hopsched-id); "
            "Settings.publish_timeout_s sets the deadline"
        )

    def _failure(self, queue: str, outcome: amqp.Outcome, detail: Any) -> HopschedError:
        if isinstance(detail, InvalidScheduleError):
            return detail
        if outcome is amqp.Outcome.RETURNED:
            return Unroutable(f"{queue} does not take the message ({detail}) even once declared")
        if outcome is amqp.Outcome.NACK:
            return PublishRejectedError(
                f"the broker nacked the publish to {queue} (a full queue with "
                "x-overflow=reject-publish, or an unavailable one)"
            )
        if isinstance(detail, ChannelClosedError):
            if detail.reply_code == 406 and (too_large := _TOO_LARGE.search(detail.reply_text)):
                return MessageTooLargeError(
                    f"the broker refused the message: its body ({too_large[1]} bytes) is "
                    f"larger than the broker's max_message_size ({too_large[2]} bytes); "
                    "nothing was scheduled. Store large data elsewhere and schedule a "
                    f"reference to it; Settings.max_message_size={too_large[2]} refuses such a "
                    f"body before sending ({detail})"
                )
            return TargetRefused(f"the broker refused the message: {detail}")
        if isinstance(detail, BrokerUnavailableError):
            self._lost()
            return BrokerConnectionLost(
                f"{detail}; the message may or may not have been scheduled: schedule it "
                "again with the same schedule_id"
            )
        return PublishRejectedError(f"{outcome.value}: {detail}")


def _nacked(item: Checked | Prepared) -> bool:
    return isinstance(item, Prepared) and item.nacks > 0
