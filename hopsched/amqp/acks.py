"""Acknowledging deliveries that finish out of order, with as few ``basic.ack`` as can be.

Deliveries on a channel carry increasing tags, but the relay finishes them out of
order (a held message waits up to the hold window; a hop is done at its confirm). Once
per event-loop iteration, the finished run at the front of the outstanding tags is
acked with one ``multiple=true`` ack, and any finished tag behind an unfinished one is
acked alone, so no finished delivery keeps its prefetch slot. A relay's acks go
lazily: with the connection's next write, 5 ms later at the latest
(``hopsched.amqp.connection.LAZY_SEND_S``), so that a paced relay's ack rides with its
next publish instead of costing a write. A consumer with a small prefetch that publishes
nothing (the journal's reader) acks at once: its window would wait for each lazy ack.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from hopsched import amqp

__all__ = ["Acker", "Ackers"]


class Acker:
    """Acks deliveries of one consumer channel.

    Call ``received(tag)`` for every delivery in order, then ``done(tag)`` or
    ``rejected(tag)`` once each. ``ack_after(tag)`` defers a delivery's ack further.

    Args:
        channel: the consumer's channel.
        lazy: send the acks with the connection's next write (see above); False: at once.
    """

    def __init__(self, channel: amqp.Channel, *, lazy: bool = True) -> None:
        self._channel = channel
        self._lazy = lazy
        self._loop = asyncio.get_running_loop()
        self._outstanding: deque[int] = deque()
        self._finished: set[int] = set()
        self._sent: set[int] = set()  # settled alone while an older tag is outstanding
        self._deferred: dict[int, int] = {}  # tag -> calls of ack_after's functions to come
        self._done_deferred: set[int] = set()  # done, its ack deferred
        self._scheduled = False
        self._settled = asyncio.Event()
        self._settled.set()

    def __len__(self) -> int:
        """Deliveries received and not yet settled."""
        return len(self._outstanding) - len(self._finished) - len(self._sent)

    def received(self, delivery_tag: int) -> None:
        self._outstanding.append(delivery_tag)
        self._settled.clear()

    async def settled(self) -> None:
        """Return once every delivery received so far is settled and its ack sent."""
        await self._settled.wait()

    def ack_after(self, delivery_tag: int) -> Callable[[], None]:
        """Defer ``delivery_tag``'s ack until the returned function is called too, as well
        as ``done``: for a record its delivery must not be acked without (a crash
        between the ack and the record's write would lose the record)."""
        self._deferred[delivery_tag] = self._deferred.get(delivery_tag, 0) + 1

        def happened() -> None:
            left = self._deferred.pop(delivery_tag) - 1
            if left:
                self._deferred[delivery_tag] = left
            elif delivery_tag in self._done_deferred:
                self._done_deferred.discard(delivery_tag)
                self.done(delivery_tag)

        return happened

    def done(self, delivery_tag: int) -> None:
        """Ack ``delivery_tag`` (in this loop iteration's batch), or once every function
        ``ack_after`` gave for it was called."""
        if delivery_tag in self._deferred:
            self._done_deferred.add(delivery_tag)
            return
        self._finished.add(delivery_tag)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def rejected(self, delivery_tag: int) -> None:
        """Hand ``delivery_tag`` back to the broker to dead-letter (``basic.nack``,
        requeue=false): ``{prefix}.relay`` dead-letters into the parking queue."""
        self._channel.nack(delivery_tag, requeue=False)
        self._sent.add(delivery_tag)

    def dropped(self) -> None:
        """Its channel closed: the broker gave back what was unacked; nothing is left to
        settle (``settled()`` returns)."""
        self._outstanding.clear()
        self._finished.clear()
        self._sent.clear()
        self._deferred.clear()
        self._done_deferred.clear()
        self._settled.set()

    def flush(self) -> None:
        self._scheduled = False
        outstanding, finished, sent = self._outstanding, self._finished, self._sent
        last = None
        while outstanding:
            front = outstanding[0]
            if front in finished:
                finished.discard(front)
                last = front
            elif front in sent:
                sent.discard(front)
            else:
                break
            outstanding.popleft()
        if last is not None:
            self._channel.ack(last, multiple=True, lazy=self._lazy)
        for tag in finished:
            self._channel.ack(tag, lazy=self._lazy)
        sent.update(finished)
        finished.clear()
        if not len(self):
            self._settled.set()


class Ackers:
    """The ``Acker`` of each consumer channel a relay session reads, found by a
    delivery's channel: a delivery from one consumer may be finished by a publish on
    another connection (an ingress message's, ``hopsched.relay.ingress_consumer``).

    A delivery whose channel was dropped (``discard``) is ignored: the broker gave it
    back to its queue when the channel closed.
    """

    def __init__(self) -> None:
        self._of: dict[amqp.Channel, Acker] = {}

    def add(self, channel: amqp.Channel) -> Acker:
        acker = self._of[channel] = Acker(channel)
        return acker

    def discard(self, channel: amqp.Channel) -> None:
        """``channel`` closed: forget its deliveries (see above)."""
        acker = self._of.pop(channel, None)
        if acker is not None:
            acker.dropped()

    def __len__(self) -> int:
        """Deliveries received and not yet settled, on every channel."""
        return sum(map(len, self._of.values()))

    def received(self, delivery: amqp.Delivery) -> None:
        self._of[delivery.channel].received(delivery.delivery_tag)

    def done(self, delivery: amqp.Delivery) -> None:
        acker = self._of.get(delivery.channel)
        if acker is not None:
            acker.done(delivery.delivery_tag)

    def rejected(self, delivery: amqp.Delivery) -> None:
        acker = self._of.get(delivery.channel)
        if acker is not None:
            acker.rejected(delivery.delivery_tag)

    def ack_after(self, delivery: amqp.Delivery) -> Callable[[], None]:
        """``Acker.ack_after`` for ``delivery``."""
        acker = self._of.get(delivery.channel)
        if acker is None:
            return _nothing
        return acker.ack_after(delivery.delivery_tag)

    async def settled(self) -> None:
        """Return once every delivery received so far, on every channel still read, is
        settled and its ack sent."""
        for acker in list(self._of.values()):
            await acker.settled()

    def flush(self) -> None:
        for acker in self._of.values():
            acker.flush()


def _nothing() -> None:
    pass
