"""Acks of deliveries finished out of order: every finished delivery is acked exactly once,
none before it finished, and a ``multiple`` ack only ever names a tag still outstanding
(RabbitMQ closes the channel with 406 "unknown delivery tag" otherwise).

The channel here records what the Acker sends; the relay tests run it against the broker.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from hopsched.amqp.acks import Acker, Ackers


class RecordingChannel:
    def __init__(self, lazy: bool = True) -> None:
        self.sent: list[tuple[str, int, bool]] = []
        self.lazy = lazy  # what every ack must ask for

    def ack(self, tag: int, *, multiple: bool = False, lazy: bool = False) -> None:
        assert lazy is self.lazy  # by default, acks ride with the connection's next write
        self.sent.append(("ack", tag, multiple))

    def nack(self, tag: int, *, requeue: bool) -> None:
        assert requeue is False
        self.sent.append(("nack", tag, False))


def broker_view(sent: list[tuple[str, int, bool]], delivered: list[int]) -> dict[int, str]:
    """What the broker makes of the frames: tag -> how it was settled, checking each
    frame the way RabbitMQ does."""
    outstanding = list(delivered)
    settled: dict[int, str] = {}
    for method, tag, multiple in sent:
        assert tag in outstanding, f"{method} of tag {tag}, which is not outstanding"
        covered = [t for t in outstanding if t <= tag] if multiple else [tag]
        for t in covered:
            outstanding.remove(t)
            settled[t] = method
    return settled


@given(
    count=st.integers(1, 60),
    data=st.data(),
)
async def test_every_finished_delivery_is_settled_once_and_only_after_it_finished(
    count: int, data: Any
) -> None:
    channel = RecordingChannel()
    acker = Acker(channel)  # type: ignore[arg-type]
    tags = list(range(1, count + 1))
    for tag in tags:
        acker.received(tag)
    order = data.draw(st.permutations(tags))
    rejected = set(data.draw(st.lists(st.sampled_from(tags), max_size=5)))
    finished: set[int] = set()
    for tag in order:
        if tag in rejected:
            acker.rejected(tag)
        else:
            acker.done(tag)
        finished.add(tag)
        if data.draw(st.booleans()):  # the end of an event-loop iteration
            acker.flush()
            assert set(broker_view(channel.sent, tags)) <= finished
    acker.flush()

    settled = broker_view(channel.sent, tags)
    assert settled == {tag: "nack" if tag in rejected else "ack" for tag in tags}
    assert len(acker) == 0


async def test_a_finished_run_at_the_front_takes_one_ack() -> None:
    channel = RecordingChannel()
    acker = Acker(channel)  # type: ignore[arg-type]
    for tag in range(1, 101):
        acker.received(tag)
    for tag in range(1, 101):
        acker.done(tag)
    acker.flush()

    assert channel.sent == [("ack", 100, True)]


async def test_a_tag_behind_a_held_one_is_acked_alone_at_once() -> None:
    channel = RecordingChannel()
    acker = Acker(channel)  # type: ignore[arg-type]
    for tag in (1, 2, 3):
        acker.received(tag)
    acker.done(2)
    acker.done(3)
    acker.flush()
    acker.done(1)
    acker.flush()

    assert channel.sent == [("ack", 2, False), ("ack", 3, False), ("ack", 1, True)]


async def test_an_acker_made_not_lazy_sends_every_ack_at_once() -> None:
    """The journal's reader (prefetch 64, publishing nothing) would wait for lazy acks."""
    channel = RecordingChannel(lazy=False)
    acker = Acker(channel, lazy=False)  # type: ignore[arg-type]
    for tag in (1, 2, 3):
        acker.received(tag)
    acker.done(1)
    acker.done(3)
    acker.flush()

    assert channel.sent == [("ack", 1, True), ("ack", 3, False)]


@given(count=st.integers(1, 40), data=st.data())
async def test_a_deferred_ack_waits_for_done_and_every_function_ack_after_gave(
    count: int, data: Any
) -> None:
    """``ack_after``: a delivery is acked only once it is done and each function given
    for it was called, in whatever order those come; the others as before."""
    channel = RecordingChannel()
    acker = Acker(channel)  # type: ignore[arg-type]
    tags = list(range(1, count + 1))
    for tag in tags:
        acker.received(tag)
    events: list[tuple[str, int, Any]] = [("done", tag, None) for tag in tags]
    for tag in data.draw(st.lists(st.sampled_from(tags), max_size=2 * count)):
        events.append(("happened", tag, acker.ack_after(tag)))
    order = data.draw(st.permutations(events))
    outstanding = {tag: sum(1 for _, t, _ in events if t == tag) for tag in tags}
    ready: set[int] = set()
    for kind, tag, happened in order:
        if kind == "done":
            acker.done(tag)
        else:
            happened()
        outstanding[tag] -= 1
        if not outstanding[tag]:
            ready.add(tag)
        if data.draw(st.booleans()):  # the end of an event-loop iteration
            acker.flush()
            assert set(broker_view(channel.sent, tags)) <= ready
    acker.flush()
    assert broker_view(channel.sent, tags) == {tag: "ack" for tag in tags}
    assert len(acker) == 0


class FakeDelivery:
    """What ``Ackers`` reads of a delivery: its channel and its tag on that channel."""

    def __init__(self, channel: RecordingChannel, delivery_tag: int) -> None:
        self.channel = channel
        self.delivery_tag = delivery_tag


@given(data=st.data())
async def test_the_deliveries_of_two_channels_are_each_settled_on_their_own_channel(
    data: Any,
) -> None:
    """The relay queue's consumer and the ingress's have their own channels, whose tags
    both count from 1: each delivery is acked once, on the channel that brought it; one
    whose channel was dropped (its connection gone) is left to the broker, and waiting
    for the rest to settle does not wait for it."""
    channels = [RecordingChannel(), RecordingChannel()]
    ackers = Ackers()
    for channel in channels:
        ackers.add(channel)  # type: ignore[arg-type]
    counts = [data.draw(st.integers(1, 30)) for _ in channels]
    deliveries = [
        FakeDelivery(c, tag)
        for c, n in zip(channels, counts, strict=True)
        for tag in range(1, n + 1)
    ]
    for delivery in deliveries:  # received in order per channel
        ackers.received(delivery)  # type: ignore[arg-type]
    assert len(ackers) == len(deliveries)
    dropped = data.draw(st.sampled_from([None, *channels]))
    for index, delivery in enumerate(data.draw(st.permutations(deliveries))):
        if dropped is not None and index == len(deliveries) // 2:
            ackers.discard(dropped)  # type: ignore[arg-type]
        ackers.done(delivery)  # type: ignore[arg-type]
        if data.draw(st.booleans()):
            ackers.flush()
    ackers.flush()
    await ackers.settled()
    assert len(ackers) == 0
    for channel, count in zip(channels, counts, strict=True):
        if channel is not dropped:
            settled = broker_view(channel.sent, list(range(1, count + 1)))
            assert settled == {tag: "ack" for tag in range(1, count + 1)}
        else:
            broker_view(channel.sent, list(range(1, count + 1)))  # nothing unknown, none twice
