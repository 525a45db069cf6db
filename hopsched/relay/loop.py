"""The relay: consume ``{prefix}.relay``; decide; publish a hop, a final delivery at the
due time, or a parked copy; ack once the broker confirms.

Reliability: a delivery is acked only after the publish it leads to is confirmed and
the journal record it leads to (an ingress message's, a refresh, a delivery, a park)
is written, so a crash duplicates, never loses, and the journal never misses what a
crash left unrecorded. The relay never returns a delivery to its queue: what it
cannot deliver is parked with a reason, a target that refuses a message gets it
again after a back-off hop, and a message it cannot even park is handed back with
``basic.nack(requeue=false)``, which ``{prefix}.relay`` dead-letters into the parking
queue. Nothing waits unacked longer than the hold window, so RabbitMQ's
``consumer_timeout`` is never reached.

Deliveries are handled by callbacks inside the read that brought them (``hopsched.amqp``)
and held ones by one timer (``Holds``), so a relayed message costs about 100 µs of CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from pamqp import commands

from hopsched import amqp
from hopsched.amqp.acks import Ackers
from hopsched.amqp.publisher import LADDER_LANE, Publisher, target_lane
from hopsched.broker.policy_watch import PolicyWatch
from hopsched.connect import RECONNECT_FIRST_S, RECONNECT_MAX_S, Connector, RetryLog
from hopsched.core.cancel import CANCEL, Cancellations
from hopsched.core.clock import now_us
from hopsched.core.decide import Cancel, Decider, Linked, Park, ParkKind, Wait
from hopsched.core.envelope import (
    HEADER_RULE,
    NO_DEATH,
    Envelope,
    delivery_properties,
    hop_properties,
    latest_death,
    lineage_properties,
    next_occurrence_properties,
    retry_properties,
    without_rule,
)
from hopsched.core.ingress import NotIngested, ingest
from hopsched.core.ladder import (
    STEP_SILENCE_S,
    US_PER_MS,
    AvoidedSteps,
    Hold,
    Hop,
    refresh_step_ms,
)
from hopsched.core.overshoot import OvershootTracker
from hopsched.core.recurring import MISSED_AFTER_US
from hopsched.errors import (
    AccessRefusedError,
    BrokerConnectionLost,
    BrokerUnavailableError,
    ChannelClosedError,
    HopschedError,
    PrefixNotDeclaredError,
)
from hopsched.journal.cancels import CancelReader
from hopsched.journal.lookups import LookupServer
from hopsched.journal.records import (
    JournalRecord,
    delivered_record,
    ingested_record,
    next_occurrence_record,
    refreshed_record,
)
from hopsched.journal.stream import JournalWriter
from hopsched.relay.broker_clock import BrokerClock
from hopsched.relay.detours import (
    HOP_NACK_WAITS_S,
    Declarer,
    Outcome,
    Parking,
    Refusals,
    Retries,
)
from hopsched.relay.holds import Holds
from hopsched.relay.hop_timing import HopTiming
from hopsched.relay.ingress_consumer import (
    CONSUME_TIMEOUT_S,
    WATCH_S,
    IngressConsumer,
    unconsumed,
)
from hopsched.relay.new_prefix import new_prefix_warning
from hopsched.relay.stats import RelayStats
from hopsched.settings import Settings
from hopsched.topology import (
    CANCEL_RETENTION_US,
    DEAD_LETTER_ROUTING_KEY,
    RELAY_CONSUMER_ARGUMENTS,
    Topology,
    stream_down_hint,
)
from hopsched.version import __version__

if TYPE_CHECKING:
    from hopsched.relay.metrics import MetricsServer

__all__ = ["Relay"]

log = logging.getLogger("hopsched.relay")

#: What a deleted ``{prefix}.ingress`` took with it: the routes from the ingresses.
_BINDINGS_LOST = (
    "the bindings of the prefix's ingress exchanges to it (if any) went with the old one: "
    "x-delay messages published to them are unroutable until `hopsched ingress declare "
    "EXCHANGE --type TYPE` binds each again (`hopsched ingress list` names them)"
)

#: Bytes a held message costs beyond its body and properties (objects, timer entry).
_HELD_OVERHEAD = 600
#: Publishes sent and not yet confirmed at most per lane (the ladder's, each target
#: exchange's): what a relay killed mid-burst can duplicate, per busy lane (F35: 6,000
#: due at once, killed 0.1 s after, had duplicated 3,800). 256 in flight still keep a
#: lane at the broker's pace (see docs/guarantees.md for the figures).
LANE_WINDOW = 256
#: Deliveries and parks confirmed and not yet acked, each waiting for its journal record
#: (a crash before it delivers it again, never leaves it "held" in the journal): with
#: this many on a lane, it sends no more. A crash duplicates fewer than LANE_WINDOW +
#: LANE_HELD per busy lane; counted in LANE_WINDOW instead, they slowed a burst of 10,000
#: by a quarter (docs/guarantees.md).
LANE_HELD = 128

#: A relay that held half its prefetch unacked (its queue may back up) takes no clock
#: sample from a producer's hop for this long after, s (``HopTiming.observe_broker``).
CROWDED_MEMORY_S = 60.0


def event_loop_name() -> str:
    """The running event loop, as the relay's start line names it: ``"uvloop 0.21.0"``
    or ``"asyncio event loop"``."""
    module = type(asyncio.get_running_loop()).__module__.split(".")[0]
    if module == "uvloop":
        from importlib.metadata import version

        return f"uvloop {version('uvloop')}"
    return f"{module} event loop"


class Relay:
    """The relay daemon. ``await relay.run()`` until ``await relay.stop()``.

    Args:
        settings: the broker (one URL or a cluster's), prefix and limits.
        shutdown_timeout_s: how long ``run()`` may take to return once stopping, s.
        clock: the time now, µs since the epoch (tests replace it).
        first_url: index in ``settings.urls`` of the node to try first (default
            random; then round-robin, see ``hopsched.connect``).

    Attributes:
        stats: counters and measurements (``RelayStats``); ``totals`` is the same.
        metrics: the metrics endpoint while ``run()`` serves one (``settings.metrics_port``).

    Raises (from ``run``):
        BrokerUnavailableError: the first connection fails (later losses are retried
            with back-off, 0.5 s doubling to 5 s, each attempt logged with the URL masked).
        TopologyMismatchError: the prefix's queues exist with other arguments.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        shutdown_timeout_s: float = 10.0,
        clock: Callable[[], int] = now_us,
        first_url: int | None = None,
    ) -> None:
        self.settings = settings = settings or Settings()
        self.ladder = settings.ladder
        self.topology = Topology.from_settings(settings)
        self.stats = RelayStats(held_now=self._held_now, in_flight_now=self._in_flight_now)
        #: the relay's clock less its offset from the broker's once that is past +2 s
        #: (``hopsched.relay.broker_clock``): every decision reads it; ``raw_clock`` is ``clock``.
        self.raw_clock = clock
        self.broker_clock = BrokerClock(clock)
        self.clock: Callable[[], int] = self.broker_clock
        self.decider = Decider(
            self.ladder,
            settings.login,
            settings.target_policy,
            int(settings.target_retry_s * 1_000_000),
            settings.signatures,
        )
        self.overshoot = OvershootTracker()
        self.hop_timing = HopTiming(
            self.stats, self.overshoot, settings.hold_window_ms * US_PER_MS, self.broker_clock
        )
        #: Steps whose queues nacked a hop lately (a leader election): routed around.
        self.avoided = AvoidedSteps()
        # Its own login's restores and lineage claims keep the scope they name (``own``).
        owner = settings.owner
        self.cancellations = Cancellations(
            CANCEL_RETENTION_US,
            trusted=settings.trusted_users,
            relays=() if owner is None else (owner,),
        )
        self.cancel_reader = CancelReader(
            self.topology.cancel_stream,
            self.cancellations,
            self.clock,
            settings.signatures,
            self.stats.record_tally,
            journal=settings,
            user_id=settings.owner,
        )
        self._shutdown_timeout_s = shutdown_timeout_s
        self._stop_by = math.inf  # time.monotonic() by which run() returns once stopping
        self._stopping = asyncio.Event()
        self._consuming = asyncio.Event()
        self._ended: asyncio.Future[None] | None = None
        self._reported_at = time.monotonic()
        self._session: _Session | None = None
        self.metrics: MetricsServer | None = None
        #: Its answering of look-ups while ``run()`` does (``settings.lookups``).
        self.lookups: LookupServer | None = None
        # random by default: relays started with one URL list spread over the nodes
        self._connector = Connector(settings, name="hopsched-relay", start=first_url)

    @property
    def totals(self) -> RelayStats:
        return self.stats

    @property
    def node(self) -> str | None:
        """``host:port`` of the node the relay consumes from, None while not consuming."""
        return self._connector.node if self._consuming.is_set() else None

    async def wait_consuming(self) -> None:
        """Return once the relay is connected and consuming.

        Raises:
            the error that ended ``run()`` before it consumed (e.g. BrokerUnavailableError:
            a refused login), or RuntimeError if it returned without consuming.
        """
        consuming: asyncio.Future[Any] = asyncio.ensure_future(self._consuming.wait())
        ended: asyncio.Future[Any] = self._ended_future()
        try:
            await asyncio.wait({consuming, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            consuming.cancel()
        if not self._consuming.is_set():
            if not ended.cancelled():
                ended.result()  # raises run()'s error
            raise RuntimeError("the relay stopped before it consumed")

    def _ended_future(self) -> asyncio.Future[None]:
        """Done when ``run()`` is: its error, or cancelled when it returned."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    async def stop(self) -> None:
        """Ask ``run()`` to stop: it stops consuming, releases what it holds when due,
        and returns within the shutdown timeout; the rest stays unacked for the broker
        to deliver again."""
        if not self._stopping.is_set():
            self._stop_by = time.monotonic() + self._shutdown_timeout_s
        self._stopping.set()

    async def run(self) -> None:
        """Consume until ``stop()``, reconnecting after a lost connection; with
        ``settings.metrics_port``, serve metrics meanwhile (see ``hopsched.relay.metrics``).

        Raises:
            MetricsEndpointError: the metrics endpoint cannot listen (before connecting).
        """
        if self.settings.metrics_port:
            from hopsched.relay.metrics import serve_metrics  # prometheus_client only when used

            self.metrics = serve_metrics(
                self.stats,
                self.settings.metrics_port,
                self.settings.metrics_address,
                loop=asyncio.get_running_loop(),
            )
            log.info(
                "metrics at http://%s:%d/metrics", self.settings.metrics_address, self.metrics.port
            )
        try:
            await self._run()
        except Exception as error:
            ended = self._ended_future()
            if not ended.done():
                ended.set_exception(error)
                ended.exception()  # retrieved: run()'s caller has it too
            raise
        finally:
            ended = self._ended_future()
            if not ended.done():
                ended.cancel()  # returned (stopped) or cancelled
            if self.metrics is not None:
                await asyncio.to_thread(self.metrics.close)
                self.metrics = None

    async def _run(self) -> None:
        reporter = asyncio.create_task(self._report_periodically())
        watcher = asyncio.create_task(self._watch_policies())
        lookups = asyncio.create_task(self._answer_lookups())
        connections: AsyncIterator[amqp.Connection] = aiter(self._connector)
        served = 0
        delay = RECONNECT_FIRST_S  # before trying again a session that never consumed
        not_yet = RetryLog(self.settings.log_interval_s)  # such sessions, in a row
        try:
            while (connection := await self._unless_stopping(anext(connections))) is not None:
                served += 1
                if served > 1:
                    self.stats.reconnects += 1
                try:
                    self._session = _Session(self, connection)
                    await self._serve(self._session)
                except (BrokerUnavailableError, ChannelClosedError) as error:
                    if self._consuming.is_set():  # lost mid-way: reconnect at once
                        delay = RECONNECT_FIRST_S
                        not_yet.reset()
                        log.warning(
                            "lost the connection to %s (%s); reconnecting",
                            self._connector.node,
                            error,
                        )
                    else:  # connected but could not start (e.g. a queue is down)
                        said, more = not_yet.say()
                        if said:
                            log.error(
                                "cannot relay yet: %s; trying again in %.1f s%s", error, delay, more
                            )
                        await connection.close(timeout_s=self._time_left(1.0))
                        await self._unless_stopping(asyncio.sleep(delay))
                        delay = min(delay * 2, RECONNECT_MAX_S)
                finally:
                    self._consuming.clear()
                    await connection.close(timeout_s=self._time_left(1.0))
        finally:
            # Awaited, within the shutdown's time: a watch cancelled and left running
            # would close its own connection after run() returned, once the event loop
            # closes (uvloop's close waited on it forever in a CI run).
            for task in (reporter, watcher, lookups):
                task.cancel()
            await asyncio.wait({reporter, watcher, lookups}, timeout=max(self._time_left(2.0), 0.1))
            if served:
                self._report()
                log.info("relay stopped")

    async def _serve(self, session: _Session) -> None:
        """``session.serve()``, within the shutdown timeout in every state: ``stop()``
        while the session starts (declaring, reading the cancel stream: nothing held yet)
        ends it at once; once it consumes, it drains until the timeout, then is ended."""
        serving = asyncio.ensure_future(session.serve())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not serving.done() and self._consuming.is_set():
                await asyncio.wait({serving}, timeout=self._time_left(math.inf))
        finally:
            stopping.cancel()
            if not serving.done():
                serving.cancel()
                await asyncio.wait({serving})
        if not serving.cancelled():
            serving.result()

    async def _watch_policies(self) -> None:
        """The policies in force (``hopsched.broker.policy_watch``), once the relay consumes (a
        refused login is said once, by ``run()``)."""
        await self._consuming.wait()
        await PolicyWatch(self.settings, self.stats).run()

    async def _answer_lookups(self) -> None:
        """With ``settings.lookups``, answer look-ups (``hopsched.journal.lookups``) once
        the relay consumes, on a connection of their own."""
        if self.settings.lookups:
            await self._consuming.wait()
            self.lookups = LookupServer(
                self.settings, self.clock, on_journal_missing=self._journal_missing
            )
            await self.lookups.run()

    def _journal_missing(self) -> None:
        """The look-ups found no journal: the session declares it again if it is gone."""
        if self._session is not None:
            self._session.check_journal()

    async def _unless_stopping(self, work: Awaitable[Any]) -> Any:
        """``await work``, unless ``stop()`` comes first: then cancel it and return None."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            result = await task
            if isinstance(result, amqp.Connection):  # it connected just as we cancelled
                await result.close(timeout_s=self._time_left(1.0))
        return None

    def _time_left(self, at_most: float) -> float:
        """Seconds a step of stopping may take: what the shutdown timeout leaves."""
        return max(0.0, min(at_most, self._stop_by - time.monotonic()))

    async def _report_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.log_interval_s)
            try:
                self._report()
            except Exception:  # a bug must not end the reports unseen
                log.exception("the relay's report failed")

    def _held_now(self) -> int:
        return len(self._session.holds) if self._session is not None else 0

    def _in_flight_now(self) -> int:
        return self._session.publisher.in_flight if self._session is not None else 0

    def _report(self) -> None:
        now = time.monotonic()
        since, self._reported_at = self._reported_at, now
        self.cancellations.forget(self.clock())
        for line in self.stats.report(now - since):
            log.info("%s", line)
        if refused := self.stats.refused_report():
            log.warning("%s", refused)
        self.hop_timing.new_interval()


class _Final:
    """A delivery ready for its final publish: its properties encoded when it arrived,
    so that releasing a burst costs only the publishes."""

    __slots__ = ("arrived_us", "delivery", "done", "envelope", "properties")

    def __init__(self, delivery: amqp.Delivery, envelope: Envelope, arrived_us: int) -> None:
        assert delivery.properties is not None
        self.delivery = delivery
        self.envelope = envelope
        self.arrived_us = arrived_us
        self.properties = delivery_properties(delivery.properties, envelope).encode()
        self.done = False  # released (a reschedule may have queued it twice)


class _Session:
    """One connection's worth of relaying. Each delivery goes consume (``_received``) →
    decide (``_route``) → publish (``_hop``, or ``_hold`` until due then ``_deliver``) →
    ack (in the publish's confirm). What cannot go that way (parking, a nacked hop tried
    again, a step that returned it early, a queue to declare again) is for the small
    handlers of ``hopsched.relay.detours``: ``Parking``, ``Retries``, ``Declarer`` and
    ``Refusals``."""

    parking: Parking
    retries: Retries

    def __init__(self, relay: Relay, connection: amqp.Connection) -> None:
        self.relay = relay
        self.settings = relay.settings
        self.topology = relay.topology
        self.stats = relay.stats
        self.clock = relay.clock
        self.connection = connection
        self.publisher = Publisher(connection, lane_window=LANE_WINDOW, lane_held=LANE_HELD)
        #: ingested, delivered, parked and refreshed records (``hopsched.journal.records``)
        self.journal = JournalWriter(
            self.publisher,
            self.topology.journal_stream,
            self.stats.record_journal,
            user_id=self.settings.owner,
            on_returned=self._journal_returned,
        )
        self._returned: list[JournalRecord] = []  # records a gone journal returned
        self._journal_suspect = False  # checked whether it is gone since? (check_journal)
        self._journal_check: asyncio.Task[None] | None = None
        self.refresh_ms = refresh_step_ms(relay.ladder.max_step_ms)
        broker_clock = relay.broker_clock
        self.holds = Holds(
            self.clock,
            self._release,
            wall_timer=relay.raw_clock is now_us,
            wall_lag=lambda: broker_clock.correction_us,
        )
        self.held_bytes = 0
        #: deliveries from ``{prefix}.relay`` still to come of those there when consuming
        #: began (``HopTiming.observe_broker``'s ``backlog``)
        self.backlog = 0
        #: when it last held half its prefetch unacked (time.monotonic()): its queue may
        #: have backed up since, and a producer's hop waited there
        self.crowded_at = -math.inf
        prefetch = self.settings.prefetch
        self.held_limit = max(1, prefetch - max(1, prefetch // 10))
        self.held_bytes_limit = self.settings.hold_memory_mb * 2**20
        self.held_by_id: dict[str, list[_Final]] = {}
        # a 403 for the prefix's own objects: the session ends, the relay exits
        self.refusals = Refusals(self.topology, self.settings)
        self.declarer = Declarer(self.settings, relay._connector.url)
        #: the acks of the relay queue's consumer and the ingress's (``IngressConsumer``)
        self.acks = Ackers()

    # --- the session's life ----------------------------------------------------------

    async def serve(self) -> None:
        """Consume until the relay stops (then drain) or the connection goes (raised).

        Raises:
            PrefixNotDeclaredError: the prefix was torn down under the relay (its cancel
                stream deleted): the relay stops, declaring nothing again.
            AccessRefusedError: the relay's user may not read or write one of the
                prefix's objects (AMQP 403): not worth trying again.
        """
        channel, lost_stream = await self._start()
        cancelled = asyncio.Event()
        tags = await self._consume(channel, cancelled)
        ingress_cancelled = asyncio.Event()
        self.ingress = IngressConsumer(
            url=self.relay._connector.url or "",
            queue=self.topology.ingress_queue,
            prefetch=self.settings.prefetch,
            log_interval_s=self.settings.log_interval_s,
            acks=self.acks,
            on_delivery=self._ingested,
            on_cancel=ingress_cancelled.set,
            on_refused=self.refusals.refuse,
            session_closed=self.connection.closed,
        )
        try:
            self.ingress.start()
            await self._consuming(channel, tags, (cancelled, ingress_cancelled), lost_stream)
        finally:
            await self.ingress.close(timeout_s=self.relay._time_left(1.0))

    async def _consuming(
        self,
        channel: amqp.Channel,
        tags: list[str],
        cancels: tuple[asyncio.Event, asyncio.Event],
        lost_stream: asyncio.Future[Any],
    ) -> None:
        """Serve until stopped (then drain), the connection goes or a refusal (raised);
        ``cancels``: set when the broker cancels the relay queue's consumer, or the
        ingress's (or finds it gone): then the prefix is declared again."""
        relay, topology = self.relay, self.topology
        cancelled, ingress_cancelled = cancels
        relay._consuming.set()
        log.info(
            "relay consuming %s on node %s (hopsched %s, prefetch %d, %s ladder %s, %s)",
            topology.relay_queue,
            relay._connector.masked_url,
            __version__,
            self.settings.prefetch,
            self.settings.queue_type,
            relay.ladder.description,
            event_loop_name(),
        )
        torn_down: PrefixNotDeclaredError | None = None
        while True:
            reasons = await self._woken(channel, cancels, lost_stream)
            if not reasons:  # WATCH_S without news: is the relay queue there, and consumed?
                if await self._unconsumed(topology.relay_queue):
                    cancelled.set()  # as the broker's cancel would: declare, consume again
                continue
            if "lost" in reasons:
                if self.connection.closed.done():
                    raise self.connection.closed.result()
                raise channel.closed.result()
            if "refused" in reasons:
                self.holds.cancel()  # unacked: back in the queue once the connection closes
                raise self.refusals.future.result()
            if "stop" in reasons:
                break
            if await self._missing(topology.cancel_stream):
                torn_down = self._torn_down()
                break
            if "stream" in reasons:  # cancelled, but the stream is there: start over
                raise BrokerConnectionLost(
                    f"the broker cancelled the reading of {self.topology.cancel_stream}"
                )
            # The broker cancelled a consumer (e.g. the queue was deleted): declare the
            # topology again and consume anew; deliveries held so far stay ours to ack.
            log.warning(
                "the relay's consumer of %s was cancelled by the broker, or the queue is "
                "gone (deleted?); declaring the prefix's queues again and consuming again; "
                "the %d deliveries held are delivered when due",
                topology.relay_queue if cancelled.is_set() else topology.ingress_queue,
                len(self.holds),
            )
            await self.declarer.declare()
            if cancelled.is_set():
                cancelled.clear()
                for tag in tags:  # the consumer may be there still
                    with contextlib.suppress(ChannelClosedError):
                        await channel.cancel(tag)
                tags = await self._consume(channel, cancelled)
            if ingress_cancelled.is_set():
                ingress_cancelled.clear()
                log.warning("if %s was deleted, %s", topology.ingress_queue, _BINDINGS_LOST)
            self.ingress.consume_again()
        await self._drain(channel, tags)
        if torn_down is not None:
            raise torn_down

    async def _start(self) -> tuple[amqp.Channel, asyncio.Future[Any]]:
        """Declare the topology, follow the cancel stream, open the consuming channel."""
        relay_gone = await self._missing(self.topology.relay_queue)
        # a prefix whose relay queue alone went (an operator's deletion) is no new one:
        # the advice to tear it down would take its ladder's messages with it
        new = relay_gone and await self._missing(self.topology.parked_queue)
        journal_gone = not new and await self._missing(self.topology.journal_stream)
        ingress_gone = not new and await self._missing(self.topology.ingress_queue)
        await self.declarer.declare()
        if ingress_gone:  # deleted, or a prefix of a hopsched before ingresses
            log.warning(
                "%s was missing: declared it; %s", self.topology.ingress_queue, _BINDINGS_LOST
            )
        if new:
            log.warning("%s", new_prefix_warning(self.topology, self.settings.masked_url))
        elif relay_gone:
            log.warning(
                "%s was missing (deleted?): declared it again. What it held went with it "
                "(messages held or due: check `hopsched pending`), and step queues may "
                "hold their expired messages for minutes before they come (docs/operations."
                'md, "Running the relay")',
                self.topology.relay_queue,
            )
        if journal_gone:
            log.warning(
                "%s was missing (deleted, or the prefix declared by a hopsched before the "
                "journal): declared it; get() and pending() know a schedule made before "
                "only from its next record (its Scheduler's kept write, a refresh, its "
                "delivery), and say they know none meanwhile",
                self.topology.journal_stream,
            )
        try:
            lost_stream = await self.relay.cancel_reader.follow(
                self.connection, self.publisher, self._record_read
            )
        except AccessRefusedError as error:
            raise self.refusals.error(str(error)) from None
        except BrokerConnectionLost as error:
            if "Stream not found" not in str(error):  # RabbitMQ 4.x: 506, its leader gone
                raise
            raise BrokerUnavailableError(
                f"{error}. {stream_down_hint(self.topology.cancel_stream)}"
            ) from None
        channel = await self.connection.channel()
        await channel.qos(self.settings.prefetch)
        self.acks.add(channel)
        self.parking = Parking(
            publisher=self.publisher,
            acks=self.acks,
            topology=self.topology,
            stats=self.stats,
            notices=self.relay.cancel_reader,
            journal=self.journal,
            clock=self.clock,
            declarer=self.declarer,
            refusals=self.refusals,
        )
        self.retries = Retries(
            stats=self.stats,
            avoided=self.relay.avoided,
            clock=self.clock,
            connection_closed=self.connection.closed,
            guard=self.parking.guarded_call,
        )
        return channel, lost_stream

    async def _woken(
        self,
        channel: amqp.Channel,
        cancels: tuple[asyncio.Event, asyncio.Event],
        lost_stream: asyncio.Future[Any],
    ) -> set[str]:
        """Wait until something ends or disturbs consuming; say what (one or more of
        ``stop``, ``cancelled``, ``lost``, ``stream``, ``refused``); none after
        ``WATCH_S`` without any."""
        waits: dict[asyncio.Future[Any], str] = {
            asyncio.ensure_future(self.relay._stopping.wait()): "stop",
            asyncio.ensure_future(cancels[0].wait()): "cancelled",
            asyncio.ensure_future(cancels[1].wait()): "cancelled",
            asyncio.ensure_future(asyncio.shield(self.connection.closed)): "lost",
            asyncio.ensure_future(asyncio.shield(channel.closed)): "lost",
            asyncio.ensure_future(asyncio.shield(lost_stream)): "stream",
            asyncio.ensure_future(asyncio.shield(self.refusals.future)): "refused",
        }
        done, pending = await asyncio.wait(
            waits, timeout=WATCH_S, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        return {waits[task] for task in done}

    async def _unconsumed(self, queue: str) -> bool:
        """Whether ``queue`` is gone or lists no consumer, though the session consumes it:
        a quorum queue whose member stops tells its consumers nothing, nor when it is
        deleted then (RabbitMQ forces that), and ladder messages dead-lettered to a
        deleted relay queue are dropped (``IngressConsumer._watch`` has the details)."""
        try:
            async with asyncio.timeout(CONSUME_TIMEOUT_S):
                declared = await self._declared(queue)
        except TimeoutError:  # a loaded broker: not worth ending the session for
            log.warning("%s did not answer a passive declare within %g s", queue, CONSUME_TIMEOUT_S)
            return False
        if declared is None:
            log.warning("%s is gone (deleted?)", queue)
            return True
        return unconsumed(queue, declared)

    async def _consume(self, channel: amqp.Channel, cancelled: asyncio.Event) -> list[str]:
        """Consume ``{prefix}.relay`` on ``channel``; its tag (``{prefix}.ingress`` has a
        connection of its own: ``IngressConsumer``)."""
        queue = self.topology.relay_queue
        # What waits in the relay queue already is a backlog: a hop from it that the relay
        # did not stamp cannot show whether it waited, so it is no sample of the clock.
        declared = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
        if isinstance(declared, commands.Queue.DeclareOk):
            self.backlog = declared.message_count or 0
        try:
            async with asyncio.timeout(CONSUME_TIMEOUT_S):
                tag = await channel.consume(
                    queue,
                    self._received,
                    lambda _: cancelled.set(),
                    arguments=RELAY_CONSUMER_ARGUMENTS,
                )
        except TimeoutError:
            raise BrokerUnavailableError(
                f"{queue} did not answer basic.consume within {CONSUME_TIMEOUT_S:g} s "
                "(a quorum queue still starting after a broker restart?)"
            ) from None
        except ChannelClosedError as error:
            if error.reply_code == 403:
                refusal = f"the broker refused ({error}): this needs read permission on "
                raise self.refusals.error(refusal + queue) from None
            raise
        except BrokerConnectionLost as error:
            if error.reply_code == 541:  # RabbitMQ 3.10.8 for a quorum member that is down
                raise BrokerConnectionLost(
                    f"{error} at the basic.consume of {queue}: its quorum queue's member down? "
                    "(`rabbitmq-queues quorum_status`)",
                    error.reply_code,
                    error.reply_text,
                ) from None
            raise
        return [tag]

    async def _missing(self, queue: str) -> bool:
        """Whether ``queue`` is gone (a passive declare answers 404)."""
        return await self._declared(queue) is None

    async def _declared(self, queue: str) -> Any:
        """The broker's answer to a passive declare of ``queue`` (``Queue.DeclareOk``: its
        depth and consumers) on a channel of its own; None if it is gone (404)."""
        channel = await self.connection.channel()
        try:
            return await channel.call(commands.Queue.Declare(queue=queue, passive=True))
        except ChannelClosedError as error:
            if error.reply_code == 404:
                return None
            raise
        finally:
            await channel.close()

    def _journal_returned(self, records: list[JournalRecord]) -> None:
        """A batch of records came back unroutable: see whether the journal is gone."""
        self._returned.extend(records)
        self.check_journal()

    def check_journal(self) -> None:
        """See whether the journal is gone (a write of it came back unroutable, the
        look-ups found no stream), and if so declare it again."""
        self._journal_suspect = True
        if self._journal_check is None:
            self._journal_check = asyncio.ensure_future(self._declare_journal_again())

    async def _declare_journal_again(self) -> None:
        """The journal is gone while the prefix is not (an operator deleted it, or a
        policy): declare it again and write the returned records again; what it held
        went with it (docs/operations.md, "When the journal takes no writes"). A stream
        that is there but routed nothing (a node still recovering) or a teardown under
        way (the cancel stream gone too): the records stay lost, counted."""
        topology = self.topology
        try:
            while self._journal_suspect:
                self._journal_suspect = False
                gone = await self._missing(topology.journal_stream)
                torn_down = self.declarer.torn_down or (
                    gone and await self._missing(topology.cancel_stream)
                )
                records, self._returned = self._returned, []
                if torn_down:  # the session stops on its own (_torn_down)
                    break
                if not gone:
                    if records:
                        log.warning(
                            "%s returned %d journal records although it is there (a node "
                            "still recovering?): the messages they tell of are delivered "
                            "or parked all the same; get() and pending() may not know them",
                            topology.journal_stream,
                            len(records),
                        )
                    continue
                log.warning(
                    "%s is gone (deleted by an operator or a policy?): declaring it again; "
                    "the records it held went with it, so get() and pending() know a "
                    "schedule again only from its next record (its Scheduler's kept write, "
                    "a refresh, its delivery), and say they know none meanwhile",
                    topology.journal_stream,
                )
                await self.declarer.declare([topology.journal_stream])
                for record in records:
                    self.journal.add(record)
        except HopschedError as error:
            log.warning("could not declare %s again (%s)", topology.journal_stream, error)
        finally:
            self._journal_check = None
            self._returned.clear()

    def _torn_down(self) -> PrefixNotDeclaredError:
        """The prefix's cancel stream is gone: a teardown (``hopsched teardown`` deletes
        it first) or an operator. The relay stops rather than declare the prefix again
        behind the teardown's back; it declares nothing more meanwhile."""
        self.declarer.torn_down = True
        relay, topology = self.relay, self.topology
        if not relay._stopping.is_set():
            relay._stop_by = time.monotonic() + relay._shutdown_timeout_s
        text = (
            f"{topology.cancel_stream} was deleted under this relay (`hopsched teardown` "
            "deletes it first, or an operator did): it stops, declaring nothing again "
            "(`hopsched relay` exits with status 4). If the prefix is to stay, start it "
            "again: it declares the stream anew and restores its cancels and reschedules "
            f"from {topology.journal_stream} before it delivers anything"
        )
        if self.holds:
            text += (
                f". Of the {len(self.holds)} deliveries it holds, those due within the "
                f"shutdown timeout ({relay._shutdown_timeout_s:g} s) are delivered; the "
                f"others go back to {topology.relay_queue} unacked, lost only if that is "
                "deleted too (a teardown deletes it next, and counts them)"
            )
        log.error("%s", text)
        return PrefixNotDeclaredError(
            text, prefix=self.settings.prefix, queue=topology.cancel_stream
        )

    def _record_read(self, schedule_id: str) -> None:
        self.stats.records += 1
        for final in self.held_by_id.get(schedule_id, ()):
            self._recheck_held(final)

    async def _drain(self, channel: amqp.Channel, tags: list[str]) -> None:
        """Stop consuming and finish what is held and in flight, within the shutdown
        timeout (a broker blocking this connection reads nothing, not even the cancel)."""
        with contextlib.suppress(TimeoutError, BrokerConnectionLost, ChannelClosedError):
            async with asyncio.timeout(self.relay._time_left(math.inf)):
                for tag in tags:
                    await channel.cancel(tag)
                await self.ingress.stop_consuming()
                if len(self.acks):
                    log.info(
                        "finishing %d unacked deliveries (held until due within the "
                        "shutdown timeout, or being published)",
                        len(self.acks),
                    )
                await self.acks.settled()
                await self.journal.settled()
        self.acks.flush()
        self.holds.cancel()  # the rest stays unacked: the broker delivers it again

    # --- consume → decide → publish → ack ----------------------------------------------

    def _received(self, delivery: amqp.Delivery) -> None:
        """Consume: a delivery from ``{prefix}.relay``, in the read that brought it."""
        self.acks.received(delivery)
        self.parking.guarded_call(delivery, self._route, delivery)  # no closure per delivery

    def _ingested(self, delivery: amqp.Delivery) -> None:
        """Consume: a delivery from ``{prefix}.ingress`` (``hopsched.core.ingress``): made a
        scheduled message, then routed as one (acked once its hop or delivery is
        confirmed); what cannot be scheduled is parked."""
        self.acks.received(delivery)
        self.parking.guarded_call(delivery, self._ingest, delivery)

    def _ingest(self, delivery: amqp.Delivery) -> None:
        if delivery.properties is None:
            self.parking.park_as_is(delivery)
            return
        now = self.clock()
        ingested = ingest(
            prefix=self.settings.prefix,
            exchange=delivery.exchange,
            routing_key=delivery.routing_key,
            properties=delivery.properties,
            received_us=now,
        )
        if isinstance(ingested, NotIngested):
            delivery.properties = ingested.properties  # names it in parking
            park = Park(ingested.reason, ParkKind.MALFORMED, recorded_as=ingested.envelope)
            self.parking.park(delivery, park)
            return
        if not ingested.stamped and not self.stats.ingested_unstamped:
            log.info(
                "ingress messages are timed from this relay's receipt: the broker stamps no "
                "receipt time (RabbitMQ < 3.12, or no message_interceptors.incoming."
                "set_header_timestamp); those published while no relay runs are late by the "
                "outage, never early (docs/ingress.md)"
            )
        self.stats.record_ingested(delivery.exchange, stamped=ingested.stamped)
        delivery.properties = ingested.properties
        try:
            encoded = ingested.properties.encode()
        except (ValueError, TypeError) as error:
            self.parking.park(delivery, Park(f"cannot re-publish it: {error}", ParkKind.TOO_LARGE))
            return
        # Acked from the ingress only once this record is written too: a crash between
        # the ack and the write would leave the id unknown to look-ups.
        written = self.acks.ack_after(delivery)
        self.journal.add(ingested_record(ingested.envelope, encoded, delivery.body, now), written)
        self._route(delivery, again=True)

    def _enqueue(self, delivery: amqp.Delivery, envelope: Envelope) -> None:
        """An ingress message due within the hold window: onto ``{prefix}.relay``, its due
        time in its envelope, and acked from the ingress once confirmed. Held unacked
        from the ingress instead, a broker restart would deliver it again with no due
        time but a new receipt: its delay would start again (found by the plugin suite's
        node_restart_before_delay_expires)."""
        assert delivery.properties is not None
        topology = self.topology

        def enqueued(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.ACK:
                self.acks.done(delivery)
            else:
                self.parking.not_published(
                    delivery, f"ingress to {topology.relay_queue}", outcome, detail
                )

        self._publish(
            LADDER_LANE,
            topology.expired_exchange,
            DEAD_LETTER_ROUTING_KEY,
            delivery,
            delivery.properties.encode(),
            enqueued,
        )

    def _route(self, delivery: amqp.Delivery, *, nacks: int = 0, again: bool = False) -> None:
        """Decide: hop, hold, deliver, park or drop ``delivery``; ``nacks``: how often its
        hop was nacked already; ``again``: routed anew (e.g. held, then rescheduled).
        Either way its hop stamp was measured on arrival, not now. A delivery from
        ``{prefix}.ingress`` is never held from there (``_enqueue``)."""
        properties = delivery.properties
        if properties is None:
            self.parking.park_as_is(delivery)
            return
        headers: Mapping[str, Any] = properties.headers or {}
        fresh = not nacks and not again  # just received, not routed before
        death = latest_death(headers) if fresh else NO_DEATH  # read once: decoding costs
        if fresh:  # its x-death time first: the clock's offset, if new
            backlog = self.backlog > 0 or delivery.redelivered
            self.backlog -= 1
            if len(self.acks) >= max(1, self.settings.prefetch // 2):
                self.crowded_at = time.monotonic()
            crowded = time.monotonic() - self.crowded_at < CROWDED_MEMORY_S
            timing = self.relay.hop_timing
            if timing.observe_broker(headers, death=death, backlog=backlog, crowded=crowded):
                self.holds.rearm()  # the correction changed: the timer's instant too
        now = self.clock()
        if fresh:
            self.relay.hop_timing.measure(headers, now, death=death)
            if delivery.redelivered and HEADER_RULE in headers:
                self._claim(delivery, headers, now)
                return
        ladder = self.relay.ladder
        decision = self.relay.decider.decide(
            headers,
            properties.user_id,
            now,
            crowded=len(self.holds) + self.retries.waiting >= self.held_limit
            or self.held_bytes >= self.held_bytes_limit,
            margin_ms=self.relay.overshoot.margin_ms(
                now, floor_ms=ladder.hop_margin_ms, cap_ms=ladder.hold_window_ms
            ),
            body=delivery.body,
            cancellations=self.relay.cancellations,
            rerouted=bool(nacks or again),
            avoid=self.relay.avoided.avoided(now),
        )
        if isinstance(decision, Wait):
            route_again = functools.partial(self._route, delivery, again=True)
            self.retries.returned_early(delivery, decision, route_again)
        elif isinstance(decision, Park):
            self.parking.park(delivery, decision)
        elif isinstance(decision, Cancel):
            if decision.superseded:
                self._superseded(decision.envelope, delivery)
            else:
                self.stats.record_cancelled()
                if decision.envelope.rule is not None:  # a recurring chain ends here
                    self.stats.chains_ended["cancelled"] += 1
                self.acks.done(delivery)
        else:
            envelope = decision.envelope
            if envelope.owner is None and self.relay.decider.signatures.enabled:
                self.stats.unsigned += 1
            if isinstance(decision.plan, Hop):
                self._hop(delivery, envelope, decision.plan.step_ms, nacks=nacks)
            elif self.topology.via_ingress(delivery.exchange):
                self._enqueue(delivery, envelope)  # from an ingress exchange
            else:
                self._final(delivery, envelope, now)

    def _final(self, delivery: amqp.Delivery, envelope: Envelope, now: int) -> None:
        """Its last hop is over: hold it until due. One already due is released at the
        loop's next poll with whatever else is due by then, in due order: what a relay
        finds overdue after an outage goes out in the order it was due, as the
        delayed-message plugin delivers it (its suite's node_restart_before_delay_expires)."""
        try:
            final = _Final(delivery, envelope, now)
        except (ValueError, TypeError) as error:  # too large, or a value pamqp cannot write
            self.parking.park(delivery, Park(f"cannot re-publish it: {error}", ParkKind.TOO_LARGE))
            return
        self._hold(final)

    def _hold(self, final: _Final) -> None:
        self.held_bytes += _held_size(final.delivery)
        self.holds.hold(final.envelope.due_us, final)
        self.held_by_id.setdefault(final.envelope.schedule_id, []).append(final)
        self.publisher.open(target_lane(final.envelope.exchange))

    def _recheck_held(self, final: _Final) -> None:
        """A record came for a held message: cancelled, it is acked now; rescheduled
        earlier, it is held again for the new time (rescheduled later, its release finds
        the new time and routes it again)."""
        verdict = self.relay.decider.verdict(self.relay.cancellations, final.envelope)
        if verdict == CANCEL:
            self._release(final)
        elif isinstance(verdict, int) and verdict < final.envelope.due_us:
            self.holds.hold(verdict, final)

    def _release(self, final: _Final) -> None:
        """Its due time came (``Holds``' timer): deliver it, unless cancelled or moved."""
        if final.done:
            return
        final.done = True
        self.held_bytes -= _held_size(final.delivery)
        envelope = final.envelope
        held = self.held_by_id.get(envelope.schedule_id)
        if held is not None:
            held.remove(final)
            if not held:
                del self.held_by_id[envelope.schedule_id]
        verdict = self.relay.decider.verdict(self.relay.cancellations, envelope)
        if verdict is None:
            self._deliver(final)
        elif verdict == CANCEL:
            self.stats.record_cancelled()
            if envelope.rule is not None:  # a recurring chain ends here
                self.stats.chains_ended["cancelled"] += 1
            self.acks.done(final.delivery)
        else:  # rescheduled: route it again, for its new due time
            self._route(final.delivery, again=True)

    def _publish(
        self,
        lane: str,
        exchange: str,
        routing_key: str,
        delivery: amqp.Delivery,
        properties: bytes,
        outcome: Outcome,
        *,
        silence_s: float | None = None,
        hold: bool = False,
    ) -> None:
        """Publish: ``outcome`` runs on the confirm (acks, or takes a detour), or after
        ``silence_s`` of silence; with ``hold``, an ACKed one takes a ``LANE_HELD`` slot
        until ``outcome`` has it released (``Publisher.publish``)."""
        try:
            self.publisher.publish(
                lane,
                exchange,
                routing_key,
                delivery.body,
                properties,
                self.parking.guarded(delivery, outcome),
                silence_s=silence_s,
                hold=hold,
            )
        except BrokerConnectionLost:
            pass  # unacked: the broker delivers it again after the reconnect
        except (ValueError, TypeError) as error:  # too large, or a value pamqp cannot write
            self.parking.park(delivery, Park(f"cannot re-publish it: {error}", ParkKind.TOO_LARGE))

    def _hop(
        self,
        delivery: amqp.Delivery,
        envelope: Envelope,
        step_ms: int,
        *,
        retry: bool = False,
        redeclared: bool = False,
        nacks: int = 0,
    ) -> None:
        """Publish into the step queue of ``step_ms``; ack once confirmed. ``retry``: a
        target's back-off hop (the same step again after a nack)."""
        assert delivery.properties is not None
        now = self.clock()
        expires = now + step_ms * US_PER_MS
        try:
            if retry:
                properties = retry_properties(delivery.properties, envelope, expires, now)
            else:
                properties = hop_properties(delivery.properties, envelope, expires)
            encoded = properties.encode()
        except (ValueError, TypeError) as error:
            self.parking.park(delivery, Park(f"cannot re-publish it: {error}", ParkKind.TOO_LARGE))
            return
        queue = self.topology.step_queue(step_ms)

        def again() -> None:  # after a nack
            if retry:  # a target's back-off hop: same step (late at worst, never early)
                self._hop(delivery, envelope, step_ms, retry=True, nacks=nacks + 1)
            else:  # decide anew: the due time came closer meanwhile
                self._route(delivery, nacks=nacks + 1)

        # A long step's hop refreshes its journal record, which keeps it younger than
        # the journal's retention.
        refreshing = step_ms >= self.refresh_ms

        def hopped(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.ACK:
                self.stats.record_hop(retry=retry)
                if refreshing:  # acked once its record is written, as a delivery is
                    refreshed = refreshed_record(envelope, encoded, delivery.body, now)
                    self._ack_once_recorded(delivery, LADDER_LANE, refreshed)
                else:
                    self.acks.done(delivery)
            elif outcome is amqp.Outcome.RETURNED and not redeclared:
                # The step queue is gone (an operator, an expires policy): declare it again.
                self.declarer.redeclare(
                    queue,
                    lambda: self._hop(delivery, envelope, step_ms, retry=retry, redeclared=True),
                )
            elif outcome is amqp.Outcome.NACK and nacks < len(HOP_NACK_WAITS_S):
                self.retries.hop_nacked(delivery, step_ms, queue, nacks, again)
            elif outcome is amqp.Outcome.SILENT:
                self.retries.hop_silent(delivery, step_ms, queue, detail, again)
            else:
                self.parking.not_published(delivery, f"hop to {queue}", outcome, detail)

        # A retry hop goes to its step whatever the step does: no silence to act on.
        silence_s = None if retry else STEP_SILENCE_S
        self._publish(
            LADDER_LANE, "", queue, delivery, encoded, hopped, silence_s=silence_s, hold=refreshing
        )

    def _ack_once_recorded(self, delivery: amqp.Delivery, lane: str, record: JournalRecord) -> None:
        """Write ``record``; then ack ``delivery`` and give back the ``LANE_HELD`` slot its
        publish (``hold=True``) keeps on ``lane``."""

        def recorded() -> None:
            self.acks.done(delivery)
            self.publisher.release(lane)

        self.journal.add(record, recorded, hurry=self.publisher.waiting(lane))

    def _deliver(self, final: _Final) -> None:
        """Publish to its target; ack once confirmed and its journal record written. A
        target that refuses it gets it again after a back-off hop
        (``Decider.after_refusal``), until it is parked. A recurring occurrence schedules
        its successor first (``_link``)."""
        delivery, envelope, arrived = final.delivery, final.envelope, final.arrived_us
        if envelope.rule is not None:
            self._link(final)
            return
        target = f"exchange {envelope.exchange!r} routing key {envelope.routing_key!r}"
        lane = target_lane(envelope.exchange)

        def delivered(outcome: amqp.Outcome, detail: Any) -> None:
            now = self.clock()
            if outcome is amqp.Outcome.ACK:
                self.stats.record_delivery(now - envelope.due_us, arrived - envelope.due_us)
                if envelope.occurrence:  # a recurring schedule's occurrence
                    self.stats.recurring_delivered += 1
                # Acked once the record is written: a crash before then delivers it
                # again (one of the lane's window), never leaves it "held" for ever.
                record = delivered_record(envelope, len(delivery.body), now)
                self._ack_once_recorded(delivery, lane, record)
            elif outcome is amqp.Outcome.RETURNED:
                reason = f"unroutable: no queue is bound to {target} ({detail})"
                self.parking.park(delivery, Park(reason, ParkKind.UNROUTABLE))
            elif outcome is amqp.Outcome.NACK:
                refusal = f"the broker refused the publish to {target} (basic.nack: a full queue"
                refusal += " with x-overflow=reject-publish, or an unavailable one)"
                decision = self.relay.decider.after_refusal(envelope, now, refusal)
                if isinstance(decision, Park):
                    self.parking.park(delivery, decision)
                    return
                if self.stats.first_problem(target, "refused: trying again after a back-off"):
                    log.warning("%s; trying again in %d ms", refusal, decision.step_ms)
                self._hop(delivery, envelope, decision.step_ms, retry=True)
            elif isinstance(detail, ChannelClosedError):
                park = Park(_refused(detail, envelope.exchange), ParkKind.REFUSED)
                self.parking.park(delivery, park)
            elif not isinstance(detail, BrokerConnectionLost):  # never left unsettled
                park = Park(f"cannot publish it: {detail!r}", ParkKind.REFUSED)
                self.parking.park(delivery, park)
            # else: the connection is gone; unacked, the broker delivers it again

        self._publish(
            lane,
            envelope.exchange,
            envelope.routing_key,
            delivery,
            final.properties,
            delivered,
            hold=True,
        )

    # --- recurring schedules (docs/recurring.md) ------------------------------------

    def _link(self, final: _Final) -> None:
        """A recurring occurrence is due: schedule the next one (confirmed), then deliver
        this one without its rule (``Decider.link``). Acked once the delivery is done: a
        crash before repeats both, at most a duplicate. A next occurrence the broker
        refuses parks this one with its rule: its replay goes on."""
        delivery = final.delivery
        original = delivery.properties
        assert original is not None
        now = self.clock()
        linked = self.relay.decider.link(
            final.envelope, delivery.body, now, self.relay.cancellations
        )
        if isinstance(linked, Park):
            self.parking.park(delivery, linked)
            return
        if isinstance(linked, Cancel):  # a copy of a lineage replaced
            self._superseded(linked.envelope, delivery)
            return

        def deliver(linked: Linked = linked) -> None:
            stats = self.stats
            stats.skipped[linked.catch_up] += linked.skipped
            if linked.ended_by is not None:
                stats.chains_ended[linked.ended_by] += 1
            if linked.deliver is None:  # missed, under catch_up="none"
                stats.missed += 1
                self.acks.done(delivery)
                return
            if now - linked.deliver.due_us > MISSED_AFTER_US:
                stats.caught_up[linked.catch_up] += 1
            delivery.properties = without_rule(original, linked.deliver)
            try:
                this = _Final(delivery, linked.deliver, final.arrived_us)
            except (ValueError, TypeError) as error:
                park = Park(f"cannot re-publish it: {error}", ParkKind.TOO_LARGE)
                self.parking.park(delivery, park)
                return
            self._deliver(this)

        if linked.next is None:  # the chain ends (until, count)
            deliver()
            return
        if isinstance(linked.plan, Hop):
            expires: int | None = now + linked.plan.step_ms * US_PER_MS
            exchange = ""
            queue = routing_key = self.topology.step_queue(linked.plan.step_ms)
        else:
            assert isinstance(linked.plan, Hold)
            expires, exchange = None, self.topology.expired_exchange
            routing_key, queue = DEAD_LETTER_ROUTING_KEY, self.topology.relay_queue
        try:
            encoded = next_occurrence_properties(original, linked.next, expires).encode()
        except (ValueError, TypeError) as error:
            self.parking.park(delivery, Park(f"cannot re-publish it: {error}", ParkKind.TOO_LARGE))
            return

        def scheduled(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.ACK:
                self.stats.links += 1
                assert linked.next is not None
                record = next_occurrence_record(linked.next, len(delivery.body), self.clock())
                self.journal.add(record)
                deliver()
            else:
                self.parking.not_published(delivery, f"next occurrence to {queue}", outcome, detail)

        self._publish(LADDER_LANE, exchange, routing_key, delivery, encoded, scheduled)

    def _claim(self, delivery: amqp.Delivery, headers: Mapping[str, Any], now: int) -> None:
        """A recurring occurrence delivered again: its successor may exist already (a relay
        scheduled it, then died before its ack). Write a new lineage claim to the cancel
        stream, confirmed, then route it as that lineage: copies of lineages it replaced
        are dropped where they meet a relay (docs/recurring.md, "Never forked")."""
        cancellations = self.relay.cancellations
        claim = self.relay.decider.claim(
            headers, delivery.body, now, uuid.uuid4().hex[:12], cancellations
        )
        if claim is None:
            self._route(delivery, again=True)  # decide parks what does not verify
            return
        if isinstance(claim, Cancel):
            self._superseded(claim.envelope, delivery)
            return
        record, envelope = claim
        assert delivery.properties is not None
        properties = lineage_properties(delivery.properties, envelope)

        def claimed(outcome: amqp.Outcome, detail: Any) -> None:
            if outcome is amqp.Outcome.ACK:
                self.stats.lineages += 1
                cancellations.apply(record)  # in the stream: no need to wait to read it
                delivery.properties = properties
                self._route(delivery, again=True)
            elif not isinstance(detail, BrokerConnectionLost):
                log.warning(
                    "could not write a lineage claim for recurring schedule %s (%s %s); "
                    "relaying it without: its chain may run twice from here",
                    envelope.schedule_id,
                    outcome.value,
                    detail or "",
                )
                self._route(delivery, again=True)

        with contextlib.suppress(BrokerConnectionLost):  # unacked: delivered again
            self.relay.cancel_reader.claim(
                self.publisher, record, self.parking.guarded(delivery, claimed)
            )

    def _superseded(self, envelope: Envelope, delivery: amqp.Delivery) -> None:
        """Drop a copy of a recurring occurrence whose lineage another one replaced."""
        self.stats.superseded += 1
        log.info(
            "dropped a copy of recurring schedule %s (due %d, lineage %s): another lineage "
            "goes on (docs/recurring.md)",
            envelope.schedule_id,
            envelope.due_us,
            envelope.lineage,
        )
        self.acks.done(delivery)


def _held_size(delivery: amqp.Delivery) -> int:
    return len(delivery.body) + len(delivery.raw_properties) + _HELD_OVERHEAD


def _refused(error: ChannelClosedError, exchange: str) -> str:
    if error.reply_code == 404:
        what = f"target exchange {exchange!r} does not exist"
    elif error.reply_code == 403:
        what = f"access refused to exchange {exchange!r}"
    else:
        what = f"the broker refused the publish to exchange {exchange!r}"
    return f"undeliverable: {what} (broker: {error})"
