"""What happens to a relay's delivery that cannot go the normal way (consume → decide →
publish → ack, in ``hopsched.relay.loop``): parked with a reason, handed back to its queue
as the last resort, a hop its step queue nacked tried again after a back-off, one a step
returned early routed again after a wait, and a queue deleted at runtime declared again.

Every path ends in an ack after a confirmed publish, a nack that dead-letters the
delivery into ``{prefix}.parked``, or nothing while the connection is gone (the broker
then delivers it again): a delivery is never dropped and never left unsettled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from hopsched import amqp
from hopsched.amqp.publisher import LADDER_LANE
from hopsched.core.decide import NOTICED, Park, ParkKind, Wait
from hopsched.core.envelope import (
    HEADER_EXCHANGE,
    HEADER_ID,
    HEADER_ROUTING_KEY,
    Envelope,
    parked_properties,
)
from hopsched.core.ladder import AVOID_SILENT_FOR_US
from hopsched.errors import (
    AccessRefusedError,
    BrokerConnectionLost,
    ChannelClosedError,
    EnvelopeError,
)
from hopsched.journal.records import parked_record

if TYPE_CHECKING:
    from hopsched.amqp.acks import Acker
    from hopsched.amqp.publisher import Publisher
    from hopsched.core.ladder import AvoidedSteps
    from hopsched.journal.cancels import CancelReader
    from hopsched.journal.stream import JournalWriter
    from hopsched.relay.stats import RelayStats

__all__ = ["HOP_NACK_WAITS_S", "Detours", "Outcome", "schedule_id"]

log = logging.getLogger("hopsched.relay")

#: What a publish's confirm leads to: called with its outcome and detail.
Outcome = Callable[[amqp.Outcome, Any], None]
#: A hop nacked by the relay's own step queue (a quorum leader election on a cluster, a
#: node going down) is tried again after these waits, s, then parked: about 64 s in all.
#: RabbitMQ 3.10.8's step queues nacked for over 30 s after their leader's node was
#: killed in 7 of 10 runs (docs/cluster.md); each try goes around the steps that nacked.
HOP_NACK_WAITS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0)


class Detours:
    """The detours of one session's deliveries.

    Args:
        publisher: the session's publisher (parking goes on the ladder lane).
        acker: acks and nacks the session's deliveries.
        stats: the relay's counters.
        cancel_reader: where notices of parked and handed-back messages are written.
        parked_queue, relay_queue: the prefix's queue names (for texts and parking).
        clock: the time now, µs since the epoch.
        connection_closed: the session's connection's closed future (a retry after it
            closed does nothing: the delivery is unacked, the broker delivers it again).
        declare: declares some of the prefix's queues again, by name.
        refused: set to the session's end on a 403 for the prefix's own objects.
        access_refused: builds that error from the refusal's text.
        avoided: steps whose queues nacked lately (routed around by the decision).
        journal: where a parked message's record goes once the park is confirmed.
    """

    def __init__(
        self,
        *,
        publisher: Publisher,
        acker: Acker,
        stats: RelayStats,
        cancel_reader: CancelReader,
        parked_queue: str,
        relay_queue: str,
        clock: Callable[[], int],
        connection_closed: asyncio.Future[Any],
        declare: Callable[[list[str]], Awaitable[None]],
        refused: asyncio.Future[AccessRefusedError],
        access_refused: Callable[[str], AccessRefusedError],
        avoided: AvoidedSteps,
        journal: JournalWriter,
    ) -> None:
        self.publisher = publisher
        self.acker = acker
        self.stats = stats
        self.cancel_reader = cancel_reader
        self.parked_queue = parked_queue
        self.relay_queue = relay_queue
        self.clock = clock
        self.connection_closed = connection_closed
        self.declare = declare
        self.refused = refused
        self.access_refused = access_refused
        self.avoided = avoided
        self.journal = journal
        self.waiting = 0  # deliveries that came back early, waiting to be routed anew
        self._redeclaring: dict[str, asyncio.Future[None]] = {}

    # --- a bug costs one message a detour, not a slot ----------------------------------

    def guarded(self, delivery: amqp.Delivery, outcome: Outcome) -> Outcome:
        """``outcome``, which hands the delivery back to be parked if it fails (a bug)."""
        return functools.partial(self._run_outcome, delivery, outcome)

    def _run_outcome(
        self, delivery: amqp.Delivery, outcome: Outcome, result: amqp.Outcome, detail: Any
    ) -> None:
        try:
            outcome(result, detail)
        except Exception as error:
            log.exception("the relay failed on a publish's outcome (%s)", result.value)
            self.reject(delivery, f"the relay failed on it: {error!r}")

    def guarded_call(self, delivery: amqp.Delivery, work: Callable[..., None], *args: Any) -> None:
        """Run ``work(*args)`` for ``delivery``; if it fails (a bug), hand the delivery back."""
        try:
            work(*args)
        except Exception as error:
            log.exception("the relay failed on a delivery (schedule id %s)", schedule_id(delivery))
            self.reject(delivery, f"the relay failed on it: {error!r}")

    # --- parking -----------------------------------------------------------------------

    def park(self, delivery: amqp.Delivery, park: Park) -> None:
        """Publish a copy to ``{prefix}.parked`` with ``park``'s reason; ack once confirmed."""
        assert delivery.properties is not None
        headers: Mapping[str, Any] = delivery.properties.headers or {}
        if HEADER_EXCHANGE in headers:
            target = f"{headers.get(HEADER_EXCHANGE)!r}/{headers.get(HEADER_ROUTING_KEY)!r}"
        else:
            target = "an unknown target (no envelope)"
        properties = parked_properties(delivery.properties, park.reason, park.kind, self.clock())
        self._publish_parked(delivery, properties.encode(), park, target)

    def park_as_is(self, delivery: amqp.Delivery) -> None:
        """Park a delivery whose properties cannot be decoded, with them as received."""
        park = Park(f"cannot decode its properties: {delivery.error}", ParkKind.UNDECODABLE)
        self._publish_parked(delivery, delivery.raw_properties, park, "an unknown target")

    def _publish_parked(
        self,
        delivery: amqp.Delivery,
        properties: bytes,
        park: Park,
        target: str,
        *,
        redeclared: bool = False,
    ) -> None:
        def parked(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.ACK:
                self.stats.record_parked(park.kind)
                self.acker.done(delivery.delivery_tag)
                self._journal_parked(delivery, park)
                if park.kind in NOTICED:
                    self.cancel_reader.note_parked(self.publisher, schedule_id(delivery), park.kind)
                if self.stats.first_problem(target, f"parked ({park.kind})"):
                    log.warning(
                        "parked a message for %s (schedule id %s): %s",
                        target,
                        schedule_id(delivery),
                        park.reason,
                    )
            elif outcome is amqp.Outcome.RETURNED and not redeclared:
                self.redeclare(  # the parking queue is gone: declare it again
                    self.parked_queue,
                    lambda: self._publish_parked(
                        delivery, properties, park, target, redeclared=True
                    ),
                )
            elif not isinstance(detail, BrokerConnectionLost) and not self.refused_own(detail):
                failure = f"{outcome.value} {detail or ''}".rstrip()
                self.reject(delivery, f"{park.reason}; and parking it failed: {failure}")

        try:
            self.publisher.publish(
                LADDER_LANE,
                "",
                self.parked_queue,
                delivery.body,
                properties,
                self.guarded(delivery, parked),
            )
        except BrokerConnectionLost:
            pass  # unacked: the broker delivers it again after the reconnect
        except (ValueError, TypeError) as error:
            self.reject(delivery, f"{park.reason}; and parking it failed: {error}")

    def _journal_parked(self, delivery: amqp.Delivery, park: Park) -> None:
        """Journal a parked message (one without a readable envelope has no id to find)."""
        headers = delivery.properties.headers if delivery.properties is not None else None
        try:
            envelope = Envelope.from_headers(headers)
        except EnvelopeError:
            return
        self.journal.add(parked_record(envelope, len(delivery.body), self.clock(), park.reason))

    def not_published(
        self, delivery: amqp.Delivery, what: str, outcome: amqp.Outcome, detail: Any
    ) -> None:
        """A publish (``what``) the broker refused: park it with the broker's refusal."""
        if isinstance(detail, BrokerConnectionLost) or self.refused_own(detail):
            return
        reason = f"the broker refused the {what}: {outcome.value} {detail or ''}".rstrip()
        self.park(delivery, Park(reason, ParkKind.REFUSED))

    def refused_own(self, detail: Any) -> bool:
        """Whether a publish to the prefix's own queues (a hop, parking) was refused for
        want of a permission (403): then the session ends and the relay exits, the
        delivery left unacked (the broker delivers it again), rather than park every
        message for ever."""
        if not isinstance(detail, ChannelClosedError) or detail.reply_code != 403:
            return False
        if not self.refused.done():
            refusal = f"the broker refused ({detail}): this needs write permission on amq.default"
            self.refused.set_result(self.access_refused(refusal + " (hops and parking)"))
        return True

    def reject(self, delivery: amqp.Delivery, reason: str) -> None:
        """The last resort: the broker dead-letters it into the parking queue."""
        self.stats.record_rejected()
        self.acker.rejected(delivery.delivery_tag)
        # its dead-lettered copy carries no reason: say it in the stream (parked list)
        self.cancel_reader.note_parked(self.publisher, schedule_id(delivery), "handed_back", reason)
        log.error(
            "could not park a message (schedule id %s): %s; handed back to %s to "
            "dead-letter into %s",
            schedule_id(delivery),
            reason,
            self.relay_queue,
            self.parked_queue,
        )

    # --- trying again later ------------------------------------------------------------

    def hop_nacked(
        self,
        delivery: amqp.Delivery,
        step_ms: int,
        queue: str,
        nacks: int,
        again: Callable[[], None],
    ) -> None:
        """A hop to ``queue`` was nacked for the ``nacks``-th time (from 0): run ``again``
        after a back-off. Our own queue refusing is a quorum leader election (or a node
        down), over within seconds, not a reason to park; meanwhile later hops go by a
        smaller step."""
        self.stats.hop_nacks += 1
        self.avoided.nacked(step_ms, self.clock())
        wait_s = HOP_NACK_WAITS_S[nacks]
        if self.stats.first_problem(queue, "nacked: trying again after a back-off"):
            log.warning("the broker nacked a hop to %s; trying again in %.2f s", queue, wait_s)
        self._later(delivery, wait_s, again)

    def hop_silent(
        self,
        delivery: amqp.Delivery,
        step_ms: int,
        queue: str,
        detail: str,
        again: Callable[[], None],
    ) -> None:
        """A hop to ``queue`` got no answer while the broker answered others (a frozen
        quorum leader, ``amqp.Outcome.SILENT``): route it anew at once, around that step
        (its silence was waited out already). The first copy may still come out of it."""
        self.stats.hop_silences += 1
        self.avoided.nacked(step_ms, self.clock(), AVOID_SILENT_FOR_US)
        if self.stats.first_problem(queue, "silent: routed around"):
            log.warning(
                "%s (a frozen queue leader?): routing by smaller steps; a message hopped "
                "again may be delivered twice if the queue wakes",
                detail,
            )
        self._later(delivery, 0.0, again)

    def returned_early(
        self, delivery: amqp.Delivery, wait: Wait, route_again: Callable[[], None]
    ) -> None:
        """A step returned it early (a policy limits the ladder): route it anew after the
        wait, not at once, which would bring it straight back (a hop storm)."""
        self.stats.record_returned_early()
        self.waiting += 1
        if self.stats.first_problem(wait.queue, "returned early: waiting to hop it again"):
            # the keep-alive's own doing on 4.x is expected: INFO; a policy's is a WARNING
            level = logging.INFO if wait.kept_alive else logging.WARNING
            log.log(level, "%s; waiting %.1f s to route it again", wait.reason, wait.wait_us / 1e6)

        def again() -> None:
            self.waiting -= 1
            if not self.connection_closed.done():  # else unacked: delivered again
                route_again()

        asyncio.get_running_loop().call_later(
            wait.wait_us / 1_000_000, functools.partial(self.guarded_call, delivery, again)
        )

    def _later(self, delivery: amqp.Delivery, wait_s: float, work: Callable[[], None]) -> None:
        def later() -> None:
            if not self.connection_closed.done():  # else unacked: delivered again
                work()

        asyncio.get_running_loop().call_later(
            wait_s, functools.partial(self.guarded_call, delivery, later)
        )

    def redeclare(self, queue: str, then: Callable[[], None]) -> None:
        """Declare ``queue`` again (deleted at runtime: an operator, an ``expires``
        policy), then run ``then``; one declare at a time per queue."""
        pending = self._redeclaring.get(queue)
        if pending is None:
            log.warning("queue %s is missing; declaring it again", queue)
            pending = asyncio.ensure_future(self.declare([queue]))
            self._redeclaring[queue] = pending
            pending.add_done_callback(functools.partial(self._redeclared, queue))
        pending.add_done_callback(lambda _: then())

    def _redeclared(self, queue: str, declared: asyncio.Future[None]) -> None:
        self._redeclaring.pop(queue, None)
        if not declared.cancelled() and (error := declared.exception()) is not None:
            log.warning("declaring %s again failed (%s)", queue, error)  # then: parked


def schedule_id(delivery: amqp.Delivery) -> str:
    """The delivery's schedule id, ``?`` if it has none (for texts)."""
    headers = delivery.properties.headers if delivery.properties is not None else None
    value = headers.get(HEADER_ID) if headers is not None else None
    return value if isinstance(value, str) else "?"
