"""What happens to a relay's delivery that cannot go the normal way (consume → decide →
publish → ack, in ``hopsched.relay.loop``), as four small handlers, each given only what
it needs:

* ``Refusals``: a 403 on the prefix's own objects ends the session (the grant to give);
* ``Declarer``: the prefix's queues declared, and one deleted at runtime declared again;
* ``Parking``: parked with a reason, or handed back to its queue as the last resort;
* ``Retries``: a hop its step queue nacked or left silent tried again after a back-off,
  one a step returned early routed again after a wait.

Every path ends in an ack after a confirmed publish, a nack that dead-letters the
delivery into ``{prefix}.parked``, or nothing while the connection is gone (the broker
then delivers it again): a delivery is never dropped and never left unsettled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hopsched import amqp
from hopsched.amqp.publisher import LADDER_LANE
from hopsched.broker.objects import declare_topology
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
    from hopsched.amqp.acks import Ackers
    from hopsched.amqp.publisher import Publisher
    from hopsched.core.ladder import AvoidedSteps
    from hopsched.journal.cancels import CancelReader
    from hopsched.journal.stream import JournalWriter
    from hopsched.relay.stats import RelayStats
    from hopsched.settings import Settings
    from hopsched.topology import Topology

__all__ = [
    "HOP_NACK_WAITS_S",
    "Declarer",
    "Outcome",
    "Parking",
    "Refusals",
    "Retries",
    "schedule_id",
]

log = logging.getLogger("hopsched.relay")

#: What a publish's confirm leads to: called with its outcome and detail.
Outcome = Callable[[amqp.Outcome, Any], None]
#: A hop nacked by the relay's own step queue (a quorum leader election on a cluster, a
#: node going down) is tried again after these waits, s, then parked: about 64 s in all.
#: RabbitMQ 3.10.8's step queues nacked for over 30 s after their leader's node was
#: killed in 7 of 10 runs (docs/cluster.md); each try goes around the steps that nacked.
HOP_NACK_WAITS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0)


class Refusals:
    """A 403 for the prefix's own objects: the session ends (``future`` gets the error)
    and the relay exits, rather than park every message for ever.

    Args:
        topology: the prefix (its relay grant is named in the error).
        settings: the relay's login and vhost (for the ``rabbitmqctl`` line).
    """

    def __init__(self, topology: Topology, settings: Settings) -> None:
        self.topology = topology
        self.settings = settings
        self.future: asyncio.Future[AccessRefusedError] = asyncio.get_running_loop().create_future()

    def error(self, refusal: str) -> AccessRefusedError:
        """The error for a 403 on one of the prefix's own objects (``refusal`` names the
        permission): the grant to give, and the command that gives it."""
        settings, topology = self.settings, self.topology
        grant = topology.permissions("relay").command(settings.login, settings.vhost)
        return AccessRefusedError(
            f"{topology.prefix}'s relay, user {settings.login!r}: {refusal}. Give "
            f"it the relay's grant (`hopsched permissions --prefix {settings.prefix} "
            f"--role relay`, with --target-exchange for each target exchange): {grant}"
        )

    def refuse(self, refusal: str) -> None:
        """End the session with ``error(refusal)`` (from a task of its own)."""
        if not self.future.done():
            self.future.set_result(self.error(refusal))

    def own(self, detail: Any) -> bool:
        """Whether a publish to the prefix's own queues (a hop, parking) was refused for
        want of a permission (403): then the session ends, the delivery left unacked
        (the broker delivers it again)."""
        if not isinstance(detail, ChannelClosedError) or detail.reply_code != 403:
            return False
        if not self.future.done():
            refusal = f"the broker refused ({detail}): this needs write permission on amq.default"
            self.future.set_result(self.error(refusal + " (hops and parking)"))
        return True


class Declarer:
    """Declares the prefix's queues on the node the session is on (if it answers), and
    again one deleted at runtime (an operator, an ``expires`` policy); nothing once the
    prefix was torn down (``torn_down``).

    Args:
        settings: the relay's settings (``declare_topology`` connects with them).
        node_url: the session's node, tried first.
    """

    def __init__(self, settings: Settings, node_url: str | None) -> None:
        self.settings = settings
        self.node_url = node_url
        self.torn_down = False
        self._redeclaring: dict[str, asyncio.Future[None]] = {}

    async def declare(self, names: list[str] | None = None) -> None:
        """Declare the prefix's objects (or only the queues ``names``)."""
        if not self.torn_down:
            await declare_topology(self.settings, names, first=self.node_url)

    def redeclare(self, queue: str, then: Callable[[], None]) -> None:
        """Declare ``queue`` again, then run ``then``; one declare at a time per queue."""
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


class Parking:
    """Parks a session's deliveries: a copy, with its reason, published to
    ``{prefix}.parked`` and the delivery acked once that is confirmed; as the last resort
    (a bug, parking refused) the delivery handed back, which its queue dead-letters there.

    Args:
        publisher: the session's publisher (parking goes on the ladder lane; notices too).
        acks: acks and nacks the session's deliveries (of each channel it reads).
        topology: the prefix's queue names.
        stats: the relay's counters.
        notices: the cancel stream's writer: notices of parked and handed-back messages.
        journal: where a parked message's record goes once the park is confirmed.
        clock: the time now, µs since the epoch.
        declarer: declares ``{prefix}.parked`` again if it is gone.
        refusals: a 403 for the parking queue ends the session.
    """

    def __init__(
        self,
        *,
        publisher: Publisher,
        acks: Ackers,
        topology: Topology,
        stats: RelayStats,
        notices: CancelReader,
        journal: JournalWriter,
        clock: Callable[[], int],
        declarer: Declarer,
        refusals: Refusals,
    ) -> None:
        self.publisher = publisher
        self.acks = acks
        self.topology = topology
        self.stats = stats
        self.notices = notices
        self.journal = journal
        self.clock = clock
        self.declarer = declarer
        self.refusals = refusals

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
        """Publish a copy to ``{prefix}.parked`` with ``park``'s reason; ack once confirmed
        and its journal record written."""
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

    def not_published(
        self, delivery: amqp.Delivery, what: str, outcome: amqp.Outcome, detail: Any
    ) -> None:
        """A publish (``what``) the broker refused: park it with the broker's refusal."""
        if isinstance(detail, BrokerConnectionLost) or self.refusals.own(detail):
            return
        reason = f"the broker refused the {what}: {outcome.value} {detail or ''}".rstrip()
        self.park(delivery, Park(reason, ParkKind.REFUSED))

    def _publish_parked(
        self,
        delivery: amqp.Delivery,
        properties: bytes,
        park: Park,
        target: str,
        *,
        redeclared: bool = False,
    ) -> None:
        parked_queue = self.topology.parked_queue

        def parked(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.ACK:
                self._parked(delivery, park, target)
            elif outcome is amqp.Outcome.RETURNED and not redeclared:
                self.declarer.redeclare(  # the parking queue is gone: declare it again
                    parked_queue,
                    lambda: self._publish_parked(
                        delivery, properties, park, target, redeclared=True
                    ),
                )
            elif not isinstance(detail, BrokerConnectionLost) and not self.refusals.own(detail):
                failure = f"{outcome.value} {detail or ''}".rstrip()
                self.reject(delivery, f"{park.reason}; and parking it failed: {failure}")

        try:
            self.publisher.publish(
                LADDER_LANE,
                "",
                parked_queue,
                delivery.body,
                properties,
                self.guarded(delivery, parked),
                hold=True,
            )
        except BrokerConnectionLost:
            pass  # unacked: the broker delivers it again after the reconnect
        except (ValueError, TypeError) as error:
            self.reject(delivery, f"{park.reason}; and parking it failed: {error}")

    def _parked(self, delivery: amqp.Delivery, park: Park, target: str) -> None:
        """The parked copy is confirmed: count it, journal it, say it; ack the delivery
        and free its held slot once its record is written (as a delivery's)."""
        self.stats.record_parked(park.kind)

        def recorded() -> None:
            self.acks.done(delivery)
            self.publisher.release(LADDER_LANE)

        headers = delivery.properties.headers if delivery.properties is not None else None
        try:  # one without a readable envelope has no id to find in the journal
            envelope = park.recorded_as or Envelope.from_headers(headers)
        except EnvelopeError:
            recorded()
        else:
            record = parked_record(envelope, len(delivery.body), self.clock(), park.reason)
            self.journal.add(record, recorded, hurry=self.publisher.waiting(LADDER_LANE))
        if park.kind in NOTICED:
            self.notices.note_parked(self.publisher, schedule_id(delivery), park.kind)
        if self.stats.first_problem(target, f"parked ({park.kind})"):
            log.warning(
                "parked a message for %s (schedule id %s): %s",
                target,
                schedule_id(delivery),
                park.reason,
            )

    def reject(self, delivery: amqp.Delivery, reason: str) -> None:
        """The last resort: the broker dead-letters it into the parking queue."""
        self.stats.record_rejected()
        self.acks.rejected(delivery)
        # its dead-lettered copy carries no reason: say it in the stream (parked list)
        self.notices.note_parked(self.publisher, schedule_id(delivery), "handed_back", reason)
        topology = self.topology
        via_ingress = topology.via_ingress(delivery.exchange)
        came_from = topology.ingress_queue if via_ingress else topology.relay_queue
        log.error(
            "could not park a message (schedule id %s): %s; handed back to %s to "
            "dead-letter into %s",
            schedule_id(delivery),
            reason,
            came_from,
            topology.parked_queue,
        )


class Retries:
    """Deliveries tried again later: a hop its step queue nacked or left silent, one a
    step returned early. Each goes through ``guard`` (a bug parks that one delivery);
    a retry after the connection closed does nothing (the delivery is unacked: the
    broker delivers it again).

    Args:
        stats: the relay's counters.
        avoided: steps whose queues nacked lately (routed around by the decision).
        clock: the time now, µs since the epoch.
        connection_closed: the session's connection's closed future.
        guard: runs a delivery's work, parking it if that fails (``Parking.guarded_call``).
    """

    def __init__(
        self,
        *,
        stats: RelayStats,
        avoided: AvoidedSteps,
        clock: Callable[[], int],
        connection_closed: asyncio.Future[Any],
        guard: Callable[[amqp.Delivery, Callable[[], None]], None],
    ) -> None:
        self.stats = stats
        self.avoided = avoided
        self.clock = clock
        self.connection_closed = connection_closed
        self.guard = guard
        self.waiting = 0  # deliveries that came back early, waiting to be routed anew

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

        wait_s = wait.wait_us / 1_000_000
        asyncio.get_running_loop().call_later(
            wait_s, functools.partial(self.guard, delivery, again)
        )

    def _later(self, delivery: amqp.Delivery, wait_s: float, work: Callable[[], None]) -> None:
        def later() -> None:
            if not self.connection_closed.done():  # else unacked: delivered again
                work()

        asyncio.get_running_loop().call_later(
            wait_s, functools.partial(self.guard, delivery, later)
        )


def schedule_id(delivery: amqp.Delivery) -> str:
    """The delivery's schedule id, ``?`` if it has none (for texts)."""
    headers = delivery.properties.headers if delivery.properties is not None else None
    value = headers.get(HEADER_ID) if headers is not None else None
    return value if isinstance(value, str) else "?"
