"""Confirmed, mandatory publishing in which one refused message never takes others down.

Shared by the Scheduler and the Relay. RabbitMQ answers some publishes by closing the
channel they came on: 404 for a missing exchange, 403 for one the user may not write
to, 406 for a property it refuses (an ``expiration`` it cannot parse, a ``user_id``
that is not the login, a body above ``max_message_size``). Every other publish in
flight on that channel then fails too, and the broker gives no way to tell which one
caused the close.

So publishes go through *lanes*, one channel each: the relay uses one lane for its
hops and parking and one per target exchange, so a problem with one target cannot
touch the ladder or another target. When the broker closes a lane's channel because
of a publish (``channel.close`` naming ``basic.publish``), the publishes that were in
flight on it are *suspects*: the lane sends them again one at a time on fresh
channels until the one the broker refuses again is found. That one alone ends
``CLOSED`` with the broker's reply; the others end as the broker confirms them
(possibly a second copy of one that had reached its queue: consumers de-duplicate on
``x-hopsched-id``). Publishes made meanwhile wait their turn.

Lanes never need more channels than the connection has (its negotiated
``channel_max``, 2,047 by default on RabbitMQ), however many targets are busy: a
publisher keeps ``max_lanes`` channels at most. A lane that needs one takes a free
number, else the channel of the least recently used idle lane, else it waits for the
next lane whose publishes are all confirmed; a lane's turn on a channel ends once its
publishes are confirmed while others wait, so none waits for ever. Lanes the broker
has confirmed a publish of go first, for a channel and for room in the window (every
``_UNPROVEN_TURN``-th turn goes to the others): thousands of lanes to missing
exchanges, each refused at its first publish, do not hold back a healthy target's.
With ``window``,
at most that many publishes are sent and unconfirmed at once, all lanes together; with
``lane_window``, at most that many per lane. What is sent and unconfirmed is what a
crash of the publishing process can duplicate (the broker may have routed it, and the
delivery that led to it is delivered again); a window per lane bounds that without
letting one slow target hold back the others' publishes. The publishes a confirm lets
go are sent after its callbacks have run, in the next step of the event loop, so the
acks those callbacks queued reach the socket no later than, and before, those
publishes: a crash in between duplicates at most the window, not the window twice.
A publish made with ``hold`` takes a slot of ``lane_held`` at its confirm, until the
caller ``release``s it: the relay acks a delivery only once its journal record is
written, and the deliveries waiting for that are what a crash duplicates too, so they
are bounded as well.

A publish given ``silence_s`` (a step queue's, which another step can stand in for) that
has no answer after that long ends ``SILENT`` if the broker answers a later publish on
its channel: a ping to a queue that does not exist, answered at once. So a queue that
neither confirms nor nacks (its quorum leader's node frozen) is told from a broker that
is slow (the ping waits too) or blocks the connection (no ping is sent). Its message may
still reach the queue later: the caller that routes it around makes a second copy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from typing import Any

from hopsched import amqp
from hopsched.amqp.wire import check_content_header
from hopsched.errors import BrokerConnectionLost, ChannelClosedError

__all__ = [
    "LADDER_LANE",
    "SILENCE_RECHECK_S",
    "SILENCE_RESOLUTION_S",
    "Publisher",
    "silence_look_after",
    "target_lane",
]

log = logging.getLogger("hopsched.publisher")

#: The lane of hops, parking and ``schedule()``'s publishes (all to the default
#: exchange or ``{prefix}.expired``).
LADDER_LANE = "ladder"
_BASIC_PUBLISH = (60, 40)
_REOPEN_DELAY_S = 0.1
_REOPEN_MAX_S = 5.0
#: Channels of a connection a publisher leaves to others (a consumer, the cancel reader).
_RESERVED_CHANNELS = 8
_CLOSE_TIMEOUT_S = 5.0  # a broker blocking the connection (an alarm) answers nothing
#: The shortest wait before a silence deadline is looked at again: asyncio runs a timer
#: up to its clock resolution early, and a wait of 0 would spin.
SILENCE_RESOLUTION_S = 0.001
#: The wait before looking again while a ping is unanswered or the connection blocked.
SILENCE_RECHECK_S = 1.0
#: The queue a silence ping is routed to: none (a client cannot declare ``amq.`` names),
#: so the broker answers it at once, without a queue: ``basic.ack`` (not mandatory).
_PING_QUEUE = "amq.hopsched.ping"
_PING_PROPERTIES = amqp.Properties().encode()
#: Of the turns on a channel, one in this many goes to a lane never confirmed, while
#: confirmed ones wait too: they come first, but the others are never starved.
_UNPROVEN_TURN = 4
#: Idle channels of confirmed lanes that lanes never confirmed do not take (at most
#: half of ``max_lanes``).
_PROVEN_IDLE_KEPT = 64
#: Lanes remembered as confirmed (most recently confirmed kept): enough for every
#: target a relay keeps busy.
_PROVEN_KEPT = 4096


def silence_look_after(until_deadline_s: float, waiting: bool) -> float | None:
    """Seconds until a lane's silence watch looks again, or None: ping now.

    Args:
        until_deadline_s: the earliest unanswered publish's deadline less now (s).
        waiting: a ping is unanswered or the connection is blocked: nothing can be
            told before ``SILENCE_RECHECK_S``, and not before the deadline.
    """
    if waiting:
        return max(until_deadline_s, SILENCE_RECHECK_S)
    if until_deadline_s > 0:  # woken a hair early: the deadline, not a second later
        return max(until_deadline_s, SILENCE_RESOLUTION_S)
    return None


def target_lane(exchange: str) -> str:
    """The lane of final publishes to ``exchange``."""
    return f"target:{exchange}"


class _Item:
    __slots__ = (
        "body",
        "callback",
        "exchange",
        "hold",
        "properties",
        "routing_key",
        "sent_at",
        "silence_s",
    )

    def __init__(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: bytes,
        callback: amqp.ConfirmCallback,
        silence_s: float | None = None,
        hold: bool = False,
    ) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.body = body
        self.properties = properties
        self.callback = callback
        self.silence_s = silence_s
        self.hold = hold
        self.sent_at = 0.0  # loop time of its last send


class _Lane:
    __slots__ = (
        "blocked",
        "channel",
        "held",
        "in_flight",
        "key",
        "last_used",
        "opening",
        "pinging",
        "probing",
        "silence_watch",
        "suspects",
        "waiting",
        "wanting",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.channel: amqp.Channel | None = None
        self.opening = False
        self.wanting = False  # in Publisher._wanting: waits for a channel
        self.blocked = False  # in Publisher._blocked: waits for the window
        self.waiting: deque[_Item] = deque()
        self.in_flight: dict[int, _Item] = {}
        self.held = 0  # confirmed publishes made with hold, not yet released
        self.suspects: deque[_Item] = deque()
        self.probing: _Item | None = None
        self.last_used = time.monotonic()
        self.silence_watch: asyncio.TimerHandle | None = None
        self.pinging = False  # a silence ping is in flight

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.in_flight or self.suspects or self.probing)


class Publisher:
    """Publishes on ``connection`` with publisher confirms and ``mandatory`` set.

    Args:
        max_lanes: channels it keeps at most (None: as many as the connection's
            ``channel_max`` less 8 for others, 2,039 with RabbitMQ's default of 2,047;
            never more, at least 1); lanes beyond take turns (see the module's doc). A
            burst to thousands of missing exchanges is parked fastest with every
            channel in use: each is refused by a channel close.
        window: publishes sent and not yet confirmed at most, all lanes together (None:
            no limit); the rest wait in order.
        lane_window: publishes sent and not yet confirmed at most on one lane (None: no
            limit); the rest wait in order, sent as confirms come back.
        lane_held: with this many publishes made with ``hold`` confirmed and not yet
            released on one lane, it sends no more there until ``release`` (None: no
            limit). Sent and unconfirmed, and held, a lane has fewer than ``lane_window
            + lane_held`` publishes: what a crash can duplicate.
    """

    def __init__(
        self,
        connection: amqp.Connection,
        *,
        max_lanes: int | None = None,
        window: int | None = None,
        lane_window: int | None = None,
        lane_held: int | None = None,
    ) -> None:
        self.connection = connection
        self._lanes: dict[str, _Lane] = {}
        allowed = connection.channel_max - _RESERVED_CHANNELS
        self._max_lanes = max(1, allowed if max_lanes is None else min(max_lanes, allowed))
        self._channels = 0  # lanes with a channel or opening one
        self._idle: dict[str, _Lane] = {}  # lanes with a channel and no work, oldest first
        self._wanting = _Turns()
        self._proven: dict[str, None] = {}  # lanes with a confirmed publish, oldest first
        self._proven_kept = min(_PROVEN_IDLE_KEPT, self._max_lanes // 2)
        self._window = window if window is not None else math.inf
        self._lane_window = lane_window if lane_window is not None else math.inf
        self._lane_held = lane_held if lane_held is not None else math.inf
        self._unconfirmed = 0
        self._blocked = _Turns()
        self._purge_at = 2 * self._max_lanes
        self._ids = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._settled_lanes: dict[int, _Lane] = {}  # turned over in the next loop step
        connection.closed.add_done_callback(self._connection_closed)

    @property
    def unconfirmed(self) -> int:
        """Publishes sent and not yet confirmed (at most ``window``)."""
        return self._unconfirmed

    @property
    def channels(self) -> int:
        """Channels its lanes hold or are opening (at most ``max_lanes``)."""
        return self._channels

    @property
    def in_flight(self) -> int:
        """Publishes not yet confirmed, waiting ones included."""
        return sum(
            len(lane.waiting) + len(lane.in_flight) + len(lane.suspects) + bool(lane.probing)
            for lane in self._lanes.values()
        )

    async def answer(
        self,
        lane: str,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: bytes,
        timeout_s: float,
    ) -> tuple[amqp.Outcome, Any]:
        """Publish one message as ``publish`` does and return the broker's answer,
        ``(outcome, detail)`` (a marker record that must be in a stream before a reader
        reads it back).

        Raises:
            TimeoutError: no answer within ``timeout_s`` seconds.
            As ``publish``.
        """
        answered: asyncio.Future[tuple[amqp.Outcome, Any]] = (
            asyncio.get_running_loop().create_future()
        )

        def answer(outcome: amqp.Outcome, detail: Any) -> None:
            if not answered.done():
                answered.set_result((outcome, detail))

        self.publish(lane, exchange, routing_key, body, properties, answer)
        async with asyncio.timeout(timeout_s):
            return await answered

    def publish(
        self,
        lane: str,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: bytes,
        callback: amqp.ConfirmCallback,
        *,
        silence_s: float | None = None,
        hold: bool = False,
    ) -> None:
        """Publish on ``lane``; ``callback(outcome, detail)`` runs once the broker has
        answered (``amqp.Outcome``: ACK, NACK, RETURNED with a ``Returned``, or CLOSED
        with the error: a ``ChannelClosedError`` for this publish alone, or
        ``BrokerConnectionLost``), or, with ``silence_s``, once it is SILENT.

        Args:
            properties: encoded (``amqp.Properties.encode()``).
            silence_s: with no answer this many seconds after it was sent, and one to a
                later publish on its channel, it ends SILENT (see the module's doc).
            hold: once ACKed, it takes one of the lane's ``lane_held`` slots until
                ``release(lane)`` (the caller's own bookkeeping of it is not done yet:
                what a crash can duplicate stays within ``lane_window + lane_held``). A
                lost connection frees every slot.

        Raises:
            ValueError: the properties do not fit in one frame (nothing was sent).
            BrokerConnectionLost: the connection is gone (nothing was sent).
        """
        if self.connection.closed.done():
            lost = self.connection.closed.result()
            raise BrokerConnectionLost(str(lost), lost.reply_code, lost.reply_text)
        check_content_header(properties, self.connection.frame_max)
        item = _Item(exchange, routing_key, body, properties, callback, silence_s, hold)
        state = self._lanes.get(lane) or self._new_lane(lane)
        state.last_used = time.monotonic()
        self._idle.pop(lane, None)
        state.waiting.append(item)
        if state.in_flight and self._wanting:
            return  # its turn ends once these are confirmed: then others have theirs
        self._resume(state)

    def waiting(self, lane: str) -> bool:
        """Whether publishes on ``lane`` wait to be sent (for room in its window, or a
        channel)."""
        state = self._lanes.get(lane)
        return state is not None and bool(state.waiting)

    def release(self, lane: str) -> None:
        """Free the ``lane_held`` slot a publish made with ``hold`` took on ``lane`` at its
        ACK; what waits for room is sent after this loop step's callbacks have run (as
        after a confirm: the acks they queue are written first)."""
        state = self._lanes.get(lane)
        if state is not None and state.held:
            state.held -= 1
            self._turn_over_soon(state)

    def open(self, lane: str) -> None:
        """Open ``lane``'s channel now, in the background, if it has none and a channel
        is free: a publish held for a due time then finds it ready (opening one takes
        two round trips)."""
        state = self._lanes.get(lane)
        if state is None:
            state = self._new_lane(lane)
        if (
            state.channel is None
            and not state.opening
            and not state.wanting
            and self._channels < self._max_lanes
            and not self.connection.closed.done()
        ):
            self._open(state)

    async def close(self) -> None:
        """Stop: lanes still opening are cancelled (closing the connection closes the rest)."""
        for task in list(self._tasks):
            task.cancel()

    # --- lanes -----------------------------------------------------------------------------

    def _new_lane(self, key: str) -> _Lane:
        if len(self._lanes) >= self._purge_at:  # forget lanes with neither channel nor work
            for old in [lane for lane in self._lanes.values() if _forgettable(lane)]:
                del self._lanes[old.key]
            self._purge_at = 2 * max(self._max_lanes, len(self._lanes))
        lane = _Lane(key)
        self._lanes[key] = lane
        return lane

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._reaped)

    def _reaped(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a publisher task failed", exc_info=error)  # retrieved, said

    def _drop_channel(self, lane: _Lane) -> None:
        """``lane``'s channel is closed: its number is free again."""
        if lane.channel is not None:
            lane.channel = None
            self._channels -= 1
            self._idle.pop(lane.key, None)

    def _open(self, lane: _Lane) -> None:
        """Give ``lane`` a channel: a new one if a number is free, else the least
        recently used idle lane's, else its turn after the lanes already waiting."""
        if lane.opening or lane.wanting or self.connection.closed.done():
            return
        if self._channels < self._max_lanes:
            lane.opening = True
            self._channels += 1
            self._spawn(self._open_channel(lane))
            return
        # A lane never confirmed (a missing exchange, say) leaves the channels of the
        # most recently used confirmed lanes alone, up to half the channels: a burst of
        # refused targets does not make a healthy one wait, and there is always a
        # channel it can have or one that is handed on as publishes settle.
        lendable = math.inf
        if lane.key not in self._proven:
            lendable = sum(key in self._proven for key in self._idle) - self._proven_kept
        for key in list(self._idle):
            idle = self._idle[key]
            if not (idle.channel is not None and idle.channel.is_open and idle.idle):
                del self._idle[key]  # not idle with a channel any more
                continue
            if key in self._proven:
                if lendable <= 0:
                    continue
                lendable -= 1
            del self._idle[key]
            lane.channel, idle.channel = idle.channel, None
            del self._lanes[idle.key]
            self._resume(lane)
            return
        lane.wanting = True
        self._wanting.append(lane, lane.key in self._proven)

    async def _open_channel(self, lane: _Lane) -> None:
        delay = _REOPEN_DELAY_S
        while True:
            channel: amqp.Channel | None = None
            try:
                channel = await self.connection.channel()
                await channel.confirm_select()
                break
            except BrokerConnectionLost as error:
                lane.opening = False
                self._channels -= 1
                self._fail(lane, error)
                return
            except Exception as error:  # not a publish's doing (a channel error, no
                # number free: another user of the connection took it): try again
                log.warning("opening a channel for lane %s failed (%s)", lane.key, error)
                if channel is not None and channel.is_open:
                    self._spawn(asyncio.wait_for(channel.close(), _CLOSE_TIMEOUT_S))
                await asyncio.sleep(delay)
                delay = min(delay * 2, _REOPEN_MAX_S)
        lane.opening = False
        lane.channel = channel
        self._resume(lane)
        self._turn_over(lane)

    def _resume(self, lane: _Lane) -> None:
        """Send what waits: suspects one at a time first, then the rest pipelined, as
        far as the window allows."""
        if lane.channel is None or not lane.channel.is_open:
            self._drop_channel(lane)
            if lane.suspects or lane.waiting:
                self._open(lane)
            return
        if lane.suspects:
            if lane.probing is None:
                self._probe(lane)
            return
        while lane.waiting and lane.channel is not None and not lane.suspects:
            if len(lane.in_flight) >= self._lane_window or lane.held >= self._lane_held:
                return  # sent on as its confirms come back (``_turn_over``)
            if self._unconfirmed >= self._window:
                if not lane.blocked:
                    lane.blocked = True
                    self._blocked.append(lane, lane.key in self._proven)
                return
            self._send(lane, lane.waiting.popleft())

    def _turn_over(self, lane: _Lane) -> None:
        """After a publish on ``lane`` settled: once none is in flight, hand its channel
        to the next lane waiting for one (it queues again for what it still has), or
        note it idle; then let the window's next publishes go."""
        channel = lane.channel
        settled = not (lane.in_flight or lane.suspects or lane.probing)
        if channel is not None and channel.is_open and settled and self._wanting:
            following = self._wanting.popleft()
            following.wanting = False
            following.channel, lane.channel = channel, None
            if lane.waiting:
                lane.wanting = True
                self._wanting.append(lane, lane.key in self._proven)
            self._resume(following)
        elif lane.waiting and not self._wanting:
            self._resume(lane)  # what waited for others' turns
        elif channel is not None and lane.idle:
            self._idle.pop(lane.key, None)
            self._idle[lane.key] = lane  # the most recently used last
        while self._wanting and self._channels < self._max_lanes:  # a channel was closed
            waiting = self._wanting.popleft()
            waiting.wanting = False
            self._open(waiting)
        while self._blocked and self._unconfirmed < self._window:
            blocked = self._blocked.popleft()
            blocked.blocked = False
            self._resume(blocked)

    def _send(self, lane: _Lane, item: _Item) -> None:
        assert lane.channel is not None
        self._ids += 1
        key = self._ids
        lane.in_flight[key] = item
        self._unconfirmed += 1
        try:
            lane.channel.publish(
                item.exchange,
                item.routing_key,
                item.body,
                item.properties,
                callback=functools.partial(self._settled, lane, key),
            )
        except (ChannelClosedError, BrokerConnectionLost):
            # closed by the broker after the check above: wait for a fresh channel
            lane.in_flight.pop(key, None)
            self._unconfirmed -= 1
            self._drop_channel(lane)
            lane.waiting.appendleft(item)
            self._open(lane)
            return
        if item.silence_s is not None:
            loop = asyncio.get_running_loop()
            item.sent_at = loop.time()
            if lane.silence_watch is None:
                lane.silence_watch = loop.call_later(item.silence_s, self._watch_silence, lane)

    # --- silence ---------------------------------------------------------------------------

    def _watch_silence(self, lane: _Lane) -> None:
        """A publish with ``silence_s`` on ``lane`` may be overdue: ping the channel (the
        ping's answer decides, ``_pinged``), or look again at the next one's deadline."""
        lane.silence_watch = None
        channel = lane.channel
        if channel is None or not channel.is_open:
            return  # its publishes are sent again on a new channel: watched from there
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadlines = [
            item.sent_at + item.silence_s
            for item in lane.in_flight.values()
            if item.silence_s is not None
        ]
        if not deadlines:
            return
        # A blocked connection confirms nothing: no queue's silence is shown by it.
        waiting = lane.pinging or self.connection.blocked is not None
        later = silence_look_after(min(deadlines) - now, waiting)
        if later is not None:
            lane.silence_watch = loop.call_later(later, self._watch_silence, lane)
            return
        lane.pinging = True
        try:
            channel.publish(
                "",
                _PING_QUEUE,
                b"",
                _PING_PROPERTIES,
                mandatory=False,
                callback=functools.partial(self._pinged, lane, self._ids),
            )
        except (ChannelClosedError, BrokerConnectionLost):
            lane.pinging = False

    def _pinged(self, lane: _Lane, sent_before: int, outcome: amqp.Outcome, _: Any) -> None:
        """The broker answered a ping sent after publish ``sent_before``: the publishes
        up to it still unanswered past their ``silence_s`` end SILENT."""
        lane.pinging = False
        if outcome is amqp.Outcome.CLOSED:
            return  # the channel is gone: its publishes are settled by that
        now = asyncio.get_running_loop().time()
        silent = [
            key
            for key, item in lane.in_flight.items()
            if key <= sent_before
            and item.silence_s is not None
            and now - item.sent_at >= item.silence_s
        ]
        for key in silent:
            item = lane.in_flight.pop(key)
            self._unconfirmed -= 1
            waited = now - item.sent_at
            item.callback(
                amqp.Outcome.SILENT,
                f"no confirm from {item.routing_key or item.exchange} in {waited:.1f} s, "
                "while the broker answered a later publish",
            )
        if silent:
            self._turn_over_soon(lane)
        if lane.silence_watch is None and any(
            item.silence_s is not None for item in lane.in_flight.values()
        ):
            self._watch_silence(lane)

    def _settled(self, lane: _Lane, key: int, outcome: amqp.Outcome, detail: Any) -> None:
        item = lane.in_flight.pop(key, None)
        if item is None:
            return  # already a suspect
        self._unconfirmed -= 1
        if outcome is amqp.Outcome.CLOSED and isinstance(detail, ChannelClosedError):
            suspects = [item, *lane.in_flight.values()]
            self._unconfirmed -= len(lane.in_flight)
            lane.in_flight.clear()
            self._drop_channel(lane)
            if (detail.class_id, detail.method_id) != _BASIC_PUBLISH:
                lane.waiting.extendleft(reversed(suspects))  # not a publish's fault
            elif len(suspects) == 1 and not lane.suspects:
                item.callback(outcome, detail)  # it alone was in flight: it is the cause
            else:
                log.info(
                    "the broker closed lane %s's channel (%s) with %d publishes in flight; "
                    "sending them one at a time to find the one it refuses",
                    lane.key,
                    detail,
                    len(suspects),
                )
                lane.suspects.extend(suspects)
            self._resume(lane)
            self._turn_over(lane)
            return
        if outcome is amqp.Outcome.ACK:
            if lane.key not in self._proven:
                self._proven[lane.key] = None
                if len(self._proven) > _PROVEN_KEPT:
                    del self._proven[next(iter(self._proven))]
            if item.hold:
                lane.held += 1
        item.callback(outcome, detail)
        self._turn_over_soon(lane)

    def _turn_over_soon(self, lane: _Lane) -> None:
        """``_turn_over`` once this loop step's confirms have all run their callbacks:
        the acks they queued then go to the socket ahead of the publishes that take
        their room in the window (see the module's doc)."""
        if not self._settled_lanes:
            asyncio.get_running_loop().call_soon(self._turn_over_settled)
        self._settled_lanes[id(lane)] = lane

    def _turn_over_settled(self) -> None:
        lanes = list(self._settled_lanes.values())
        self._settled_lanes.clear()
        for lane in lanes:
            if self._lanes.get(lane.key) is lane:  # not handed its channel on meanwhile
                self._turn_over(lane)

    # --- suspects --------------------------------------------------------------------------

    def _probe(self, lane: _Lane) -> None:
        assert lane.channel is not None
        item = lane.suspects.popleft()
        lane.probing = item
        try:
            lane.channel.publish(
                item.exchange,
                item.routing_key,
                item.body,
                item.properties,
                callback=functools.partial(self._probed, lane, item),
            )
        except (ChannelClosedError, BrokerConnectionLost):
            lane.probing = None
            lane.suspects.appendleft(item)
            self._drop_channel(lane)
            self._open(lane)

    def _probed(self, lane: _Lane, item: _Item, outcome: amqp.Outcome, detail: Any) -> None:
        lane.probing = None
        if outcome is amqp.Outcome.CLOSED and isinstance(detail, ChannelClosedError):
            self._drop_channel(lane)
            if (detail.class_id, detail.method_id) != _BASIC_PUBLISH:
                lane.suspects.appendleft(item)  # not its fault: try it again
                self._resume(lane)
                return
        if outcome is amqp.Outcome.ACK and item.hold:
            lane.held += 1
        item.callback(outcome, detail)
        if not isinstance(detail, BrokerConnectionLost):
            self._resume(lane)
            self._turn_over(lane)

    # --- connection loss -------------------------------------------------------------------

    def _fail(self, lane: _Lane, error: BaseException) -> None:
        items = [*lane.suspects, *lane.waiting]
        lane.suspects.clear()
        lane.waiting.clear()
        for item in items:
            item.callback(amqp.Outcome.CLOSED, error)

    def _connection_closed(self, closed: asyncio.Future[BrokerConnectionLost]) -> None:
        error = closed.result()
        self._wanting.clear()
        self._blocked.clear()
        for lane in self._lanes.values():
            lane.wanting = lane.blocked = False
            lane.held = 0
            self._fail(lane, error)


def _forgettable(lane: _Lane) -> bool:
    return lane.idle and lane.channel is None and not (lane.opening or lane.wanting or lane.held)


class _Turns:
    """Lanes waiting for a channel or for room in the window, in order, those with a
    confirmed publish first but for every ``_UNPROVEN_TURN``-th turn."""

    __slots__ = ("_others", "_proven", "_turns")

    def __init__(self) -> None:
        self._proven: deque[_Lane] = deque()
        self._others: deque[_Lane] = deque()
        self._turns = 0

    def __bool__(self) -> bool:
        return bool(self._proven or self._others)

    def append(self, lane: _Lane, proven: bool) -> None:
        (self._proven if proven else self._others).append(lane)

    def popleft(self) -> _Lane:
        self._turns += 1
        if self._others and (not self._proven or self._turns % _UNPROVEN_TURN == 0):
            return self._others.popleft()
        return self._proven.popleft()

    def clear(self) -> None:
        self._proven.clear()
        self._others.clear()
