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
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from typing import Any

from hopsched import amqp
from hopsched.amqp.wire import check_content_header
from hopsched.errors import BrokerConnectionLost, ChannelClosedError

__all__ = ["LADDER_LANE", "Publisher", "target_lane"]

log = logging.getLogger("hopsched.publisher")

#: The lane of hops, parking and ``schedule()``'s publishes (all to the default
#: exchange or ``{prefix}.expired``).
LADDER_LANE = "ladder"
_BASIC_PUBLISH = (60, 40)
_REOPEN_DELAY_S = 0.1
_CLOSE_TIMEOUT_S = 5.0  # a broker blocking the connection (an alarm) answers nothing


def target_lane(exchange: str) -> str:
    """The lane of final publishes to ``exchange``."""
    return f"target:{exchange}"


class _Item:
    __slots__ = ("body", "callback", "exchange", "properties", "routing_key")

    def __init__(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: bytes,
        callback: amqp.ConfirmCallback,
    ) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.body = body
        self.properties = properties
        self.callback = callback


class _Lane:
    __slots__ = (
        "channel",
        "in_flight",
        "key",
        "last_used",
        "opening",
        "probing",
        "suspects",
        "waiting",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.channel: amqp.Channel | None = None
        self.opening = False
        self.waiting: deque[_Item] = deque()
        self.in_flight: dict[int, _Item] = {}
        self.suspects: deque[_Item] = deque()
        self.probing: _Item | None = None
        self.last_used = time.monotonic()

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.in_flight or self.suspects or self.probing)


class Publisher:
    """Publishes on ``connection`` with publisher confirms and ``mandatory`` set.

    Args:
        max_lanes: channels it keeps open at most; the least recently used idle lane
            is closed to open another.
    """

    def __init__(self, connection: amqp.Connection, *, max_lanes: int = 512) -> None:
        self.connection = connection
        self._lanes: dict[str, _Lane] = {}
        self._max_lanes = min(max_lanes, connection.channel_max - 8)
        self._ids = 0
        self._tasks: set[asyncio.Task[None]] = set()
        connection.closed.add_done_callback(self._connection_closed)

    @property
    def in_flight(self) -> int:
        """Publishes not yet confirmed, waiting ones included."""
        return sum(
            len(lane.waiting) + len(lane.in_flight) + len(lane.suspects) + bool(lane.probing)
            for lane in self._lanes.values()
        )

    def publish(
        self,
        lane: str,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: bytes,
        callback: amqp.ConfirmCallback,
    ) -> None:
        """Publish on ``lane``; ``callback(outcome, detail)`` runs once the broker has
        answered (``amqp.Outcome``: ACK, NACK, RETURNED with a ``Returned``, or CLOSED
        with the error: a ``ChannelClosedError`` for this publish alone, or
        ``BrokerConnectionLost``).

        Args:
            properties: encoded (``amqp.Properties.encode()``).

        Raises:
            ValueError: the properties do not fit in one frame (nothing was sent).
            BrokerConnectionLost: the connection is gone (nothing was sent).
        """
        if self.connection.closed.done():
            lost = self.connection.closed.result()
            raise BrokerConnectionLost(str(lost), lost.reply_code, lost.reply_text)
        check_content_header(properties, self.connection.frame_max)
        item = _Item(exchange, routing_key, body, properties, callback)
        state = self._lanes.get(lane) or self._new_lane(lane)
        state.last_used = time.monotonic()
        channel = state.channel
        if (
            channel is not None
            and channel.is_open
            and not state.waiting
            and not state.suspects
            and state.probing is None
        ):
            self._send(state, item)
        else:
            state.waiting.append(item)
            self._open(state)

    def open(self, lane: str) -> None:
        """Open ``lane``'s channel now, in the background, if it is not open: a publish
        held for a due time then finds it ready (opening one takes two round trips)."""
        state = self._lanes.get(lane)
        if state is None:
            state = self._new_lane(lane)
        if state.channel is None and not self.connection.closed.done():
            self._open(state)

    async def close(self) -> None:
        """Stop: lanes still opening are cancelled (closing the connection closes the rest)."""
        for task in list(self._tasks):
            task.cancel()

    # --- lanes -----------------------------------------------------------------------------

    def _new_lane(self, key: str) -> _Lane:
        if len(self._lanes) >= self._max_lanes:
            idle = sorted(
                (lane for lane in self._lanes.values() if lane.idle and not lane.opening),
                key=lambda lane: lane.last_used,
            )
            for lane in idle[: max(1, len(self._lanes) - self._max_lanes + 1)]:
                del self._lanes[lane.key]
                if lane.channel is not None:
                    self._spawn(asyncio.wait_for(lane.channel.close(), _CLOSE_TIMEOUT_S))
        lane = _Lane(key)
        self._lanes[key] = lane
        return lane

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _open(self, lane: _Lane) -> None:
        if not lane.opening:
            lane.opening = True
            self._spawn(self._open_channel(lane))

    async def _open_channel(self, lane: _Lane) -> None:
        while True:
            try:
                channel = await self.connection.channel()
                await channel.confirm_select()
                break
            except BrokerConnectionLost as error:
                lane.opening = False
                self._fail(lane, error)
                return
            except ChannelClosedError as error:  # not a publish's doing: try again
                log.warning("opening a channel for lane %s failed (%s)", lane.key, error)
                await asyncio.sleep(_REOPEN_DELAY_S)
        lane.opening = False
        lane.channel = channel
        self._resume(lane)

    def _resume(self, lane: _Lane) -> None:
        """Send what waits: suspects one at a time first, then the rest pipelined."""
        if lane.channel is None or not lane.channel.is_open:
            if lane.suspects or lane.waiting:
                self._open(lane)
            return
        if lane.suspects:
            if lane.probing is None:
                self._probe(lane)
            return
        while lane.waiting and lane.channel is not None and not lane.suspects:
            self._send(lane, lane.waiting.popleft())

    def _send(self, lane: _Lane, item: _Item) -> None:
        assert lane.channel is not None
        self._ids += 1
        key = self._ids
        lane.in_flight[key] = item
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
            lane.channel = None
            lane.waiting.appendleft(item)
            self._open(lane)

    def _settled(self, lane: _Lane, key: int, outcome: amqp.Outcome, detail: Any) -> None:
        item = lane.in_flight.pop(key, None)
        if item is None:
            return  # already a suspect
        if outcome is amqp.Outcome.CLOSED and isinstance(detail, ChannelClosedError):
            suspects = [item, *lane.in_flight.values()]
            lane.in_flight.clear()
            lane.channel = None
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
            return
        item.callback(outcome, detail)

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
            lane.channel = None
            self._open(lane)

    def _probed(self, lane: _Lane, item: _Item, outcome: amqp.Outcome, detail: Any) -> None:
        lane.probing = None
        if outcome is amqp.Outcome.CLOSED and isinstance(detail, ChannelClosedError):
            lane.channel = None
            if (detail.class_id, detail.method_id) != _BASIC_PUBLISH:
                lane.suspects.appendleft(item)  # not its fault: try it again
                self._resume(lane)
                return
        item.callback(outcome, detail)
        if not isinstance(detail, BrokerConnectionLost):
            self._resume(lane)

    # --- connection loss -------------------------------------------------------------------

    def _fail(self, lane: _Lane, error: BaseException) -> None:
        items = [*lane.suspects, *lane.waiting]
        lane.suspects.clear()
        lane.waiting.clear()
        for item in items:
            item.callback(amqp.Outcome.CLOSED, error)

    def _connection_closed(self, closed: asyncio.Future[BrokerConnectionLost]) -> None:
        error = closed.result()
        for lane in self._lanes.values():
            self._fail(lane, error)
