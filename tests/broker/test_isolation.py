"""Field cases F14-F18, F20, F23, F26, F27 on the shared broker: one bad message or one
bad target never disturbs another, and callers get clear hopsched errors.

Each test names the kind of fault it keeps fixed. Exact outcomes are asserted (never
early, nothing lost, who was parked and why, no reconnect, order of arrival); where
the field case states a timing goal, the test prints the lateness it saw and asserts
an outcome that the fault would break, whatever the load on this shared machine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from support import Collector, Relays, Targets, message_count, schedule_all

import hopsched
from hopsched.core.clock import now_us
from hopsched.core.decide import RETRY_FIRST_MS
from hopsched.core.envelope import HEADER_EXPIRATION, HEADER_PARKED_REASON, Envelope

AMQP = aio_pika.abc.AbstractConnection
S = 1_000_000


def p50_ms(collector: Collector, ids: set[str] | None = None) -> float:
    values = [
        r.lateness_us / 1000 for r in collector.received if ids is None or r.schedule_id in ids
    ]
    return statistics.median(values)


# F14 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "names"),
    [
        ({"f": float("nan")}, "headers['f']"),
        ({"f": float("inf")}, "headers['f']"),
        ({"k" * 129: 1}, "k" * 20),
        ({"a": {"b": [1, {"c": float("-inf")}]}}, "headers['a']['b'][1]['c']"),
        ({"big": 1e300}, "headers['big']"),
        ({"old": datetime(1960, 1, 1, tzinfo=UTC)}, "headers['old']"),
        ({7: "int key"}, "7"),
    ],
    ids=["nan", "inf", "long-key", "nested", "1e300", "before-1970", "int-key"],
)
async def test_F14_a_header_amqp_cannot_carry_is_refused_naming_it(
    scheduler: hopsched.Scheduler,
    relay: hopsched.Relay,
    targets: Targets,
    headers: dict[Any, Any],
    names: str,
) -> None:
    """NaN closed the whole connection (541) and killed the Scheduler; long keys merged;
    others raised bare TypeErrors. Now: InvalidScheduleError naming the header, nothing
    sent, and the same Scheduler schedules the next message."""
    target = await targets.queue()

    with pytest.raises(hopsched.InvalidScheduleError) as caught:
        await scheduler.schedule(
            aio_pika.Message(b"bad", headers=headers), delay=0, routing_key=target.name
        )
    assert names in str(caught.value)

    ok = await scheduler.schedule(
        aio_pika.Message(b"good", headers={"b": b"\x00\xff", "n": [1, {"x": "y"}]}),
        delay=0,
        routing_key=target.name,
    )
    (received,) = await target.wait_for(1, within=30)
    await target.settle(0.3)
    assert [r.schedule_id for r in target.received] == [ok.schedule_id]
    assert received.headers["b"] == bytearray(b"\x00\xff")  # bytes travel as a byte array
    assert received.headers["n"] == [1, {"x": "y"}]


# F15 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset_s", [300, -300])
async def test_F15_a_producer_clock_off_by_minutes_is_estimated_and_warned_about(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: AMQP,
    caplog: pytest.LogCaptureFixture,
    offset_s: int,
) -> None:
    """A producer whose clock is 5 minutes off: the relay estimates the offset from the
    first hop (its arrival against the producer's stamp), warns, and keeps learning its
    hop margin from its own hops only. The due time is the producer's: behind, the
    message is overdue on arrival and delivered at once; ahead, it waits the offset."""
    caplog.set_level(logging.WARNING, "hopsched.relay")
    settings = make_settings()
    relay = await relays.start(settings)
    target = await targets.queue()
    skewed = hopsched.Scheduler(settings, clock=lambda: now_us() + offset_s * S)
    async with skewed:
        scheduled = await skewed.schedule(b"skewed", delay=7, routing_key=target.name)
    assert scheduled.first_queue.endswith(".step.4096")

    deadline = time.monotonic() + 30
    # The relay signals nothing per sample: polling its counters is the only way.
    while skewed.producer not in relay.stats.clock_offsets and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    estimate_s = relay.stats.clock_offsets[skewed.producer] / S
    print(f"\nF15: producer {offset_s:+d} s, estimated {estimate_s:+.3f} s")
    assert abs(estimate_s - offset_s) < 1
    warnings = [r.getMessage() for r in caplog.records if "clock seems" in r.getMessage()]
    assert len(warnings) == 1
    assert skewed.producer in warnings[0]
    assert relay.stats.overshoot.count == 0, "a producer's stamp fed the hop margin"
    if offset_s < 0:
        (received,) = await target.wait_for(1, within=30)
        assert received.schedule_id == scheduled.schedule_id
        assert relay.stats.overdue == 1
    else:  # due in 5 minutes by the relay's clock: still on the ladder, not lost
        counts = [
            await message_count(amqp, name)
            for name in hopsched.Topology.from_settings(settings).step_queues
        ]
        assert sum(counts) == 1
        assert len(target) == 0


async def test_F15_messages_that_waited_for_a_relay_do_not_look_like_a_clock_offset(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by a new-user trial: a relay started after its producer's first hops had
    expired saw them late and warned of the producer's clock (run NTP), though producer
    and relay share one clock. The x-death time tells the wait in the relay queue apart."""
    caplog.set_level(logging.WARNING, "hopsched.relay")
    settings = make_settings()
    target = await targets.queue()
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        scheduled = await scheduler.schedule(b"waited", delay=1, routing_key=target.name)
    await asyncio.sleep(5)  # expired about 4 s ago; no relay yet
    relay = await relays.start(settings)

    (received,) = await target.wait_for(1, within=30)
    assert received.schedule_id == scheduled.schedule_id
    assert not [r.getMessage() for r in caplog.records if "clock seems" in r.getMessage()]
    assert scheduler.producer not in relay.stats.clock_offsets


# F16 ------------------------------------------------------------------------------------


async def test_F16_the_relay_consumes_again_after_its_queue_is_deleted_and_declared(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
    amqp: AMQP,
) -> None:
    """Deleting ``{prefix}.relay`` cancels the relay's consumer (basic.cancel). The relay
    used to sit idle with no consumer; now it declares the queue and consumes again."""
    target = await targets.queue()
    topology = hopsched.Topology.from_settings(settings)
    async with amqp.channel() as channel:
        await channel.queue_delete(topology.relay_queue)
    started = time.monotonic()
    consumers = 0
    while time.monotonic() - started < 10:
        async with amqp.channel() as channel:
            try:
                declared = await channel.declare_queue(topology.relay_queue, passive=True)
                consumers = declared.declaration_result.consumer_count or 0
            except aio_pika.exceptions.ChannelNotFoundEntity:
                consumers = 0
        if consumers:
            break
        await asyncio.sleep(0.1)
    print(f"\nF16: consuming again after {time.monotonic() - started:.2f} s")
    assert consumers == 1

    scheduled = await scheduler.schedule(b"after", delay=2, routing_key=target.name)
    (received,) = await target.wait_for(1, within=30)
    assert received.schedule_id == scheduled.schedule_id
    target.assert_never_early()


# F17 ------------------------------------------------------------------------------------


async def test_F17_an_oversized_header_is_refused_alone_and_the_others_succeed(
    scheduler: hopsched.Scheduler, relay: hopsched.Relay, targets: Targets
) -> None:
    """A 140,000-byte header made the broker close the connection (501): 0 of 21 calls
    succeeded. Now the oversized call alone raises InvalidScheduleError before anything
    is sent; the 20 others are scheduled and delivered."""
    target = await targets.queue()

    async def one(index: int) -> hopsched.Scheduled:
        size = 140_000 if index == 7 else 10
        message = aio_pika.Message(b"m", headers={"pad": "p" * size})
        return await scheduler.schedule(message, delay=0.2, routing_key=target.name)

    results = await asyncio.gather(*(one(i) for i in range(21)), return_exceptions=True)

    error = results.pop(7)
    assert isinstance(error, hopsched.InvalidScheduleError)
    assert "frame" in str(error)
    assert "body" in str(error)
    assert all(isinstance(r, hopsched.Scheduled) for r in results)
    await target.wait_for_ids({r.schedule_id for r in results}, within=30)  # type: ignore[union-attr]
    await target.settle(0.3)
    assert len(target) == 20


# F18 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expiration",
    [-5, datetime(2000, 1, 1, tzinfo=UTC), timedelta(days=365 * 20), "soon", "1.5"],
    ids=["-5s", "past-datetime", "20-years", "words", "fraction"],
)
async def test_F18_an_expiration_the_broker_would_refuse_is_refused_by_schedule(
    scheduler: hopsched.Scheduler, expiration: Any
) -> None:
    """The 406 used to close the relay's shared channel at due time; now schedule()
    refuses it, naming the field, and sends nothing."""
    message = aio_pika.Message(b"x")
    message.expiration = expiration  # aio-pika turns it into RabbitMQ's ms string
    with pytest.raises(hopsched.InvalidScheduleError, match="expiration"):
        await scheduler.schedule(message, delay=1, routing_key="anything")


async def test_F18_a_bad_expiration_that_reaches_the_relay_is_parked_alone(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
    amqp: AMQP,
) -> None:
    """A message put on the ladder by another client with an expiration the broker
    refuses: parked alone; 200 valid messages due with it are delivered once each, on
    time, and the relay never reconnects."""
    target = await targets.queue()
    parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
    due = now_us() + 500_000
    bad = Envelope("bad", due, "", target.name, expiration="-5000").to_headers()
    async with amqp.channel() as channel:
        await channel.default_exchange.publish(
            aio_pika.Message(b"bad", headers=bad, delivery_mode=2),
            routing_key=hopsched.Topology.from_settings(settings).relay_queue,
        )
    valid = await schedule_all(
        scheduler,
        [{"message": b"ok", "delay": 0.5, "routing_key": target.name} for _ in range(200)],
    )

    await target.wait_for_ids({s.schedule_id for s in valid}, within=30)
    (parked_copy,) = await parked.wait_for(1, within=30)
    await target.settle(0.5)
    assert target.counts() == {s.schedule_id: 1 for s in valid}
    target.assert_never_early()
    assert parked_copy.schedule_id == "bad"
    assert HEADER_EXPIRATION in parked_copy.headers
    assert "expiration" in parked_copy.headers[HEADER_PARKED_REASON]
    assert relay.stats.reconnects == 0
    print(f"\nF18: {target.lateness_line()}")


# F20 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [20, 20_000])
async def test_F20_a_full_target_is_retried_then_parked_and_healthy_ones_stay_on_time(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    caplog: pytest.LogCaptureFixture,
    prefetch: int,
) -> None:
    """200 messages for a full target (x-max-length + reject-publish: the broker nacks)
    and 5 for a healthy one. Each nacked message waits a back-off hop and tries again
    (never a requeue loop, never a held prefetch slot) until ``target_retry_s``, then is
    parked with the broker's reason; the healthy ones are not held behind the refusals;
    the log says it once per target, not per message.

    "Not held behind" is an outcome with an honest bound, not a ratio of two lateness
    samples (a ratio is load: 48.6 against 6.7 ms on a loaded machine, no defect): a
    healthy message that waited for a refused one would wait its back-off hop
    (``RETRY_FIRST_MS``, 1,024 ms) or the full target's ``target_retry_s`` (4 s), so the
    healthy ones' median lateness stays under half the first back-off."""
    caplog.set_level(logging.INFO, "hopsched")
    settings = make_settings(prefetch=prefetch, target_retry_s=4.0)
    relay = await relays.start(settings)
    healthy = await targets.queue()
    full = await targets.queue(
        arguments={"x-max-length": 1, "x-overflow": "reject-publish"}, consume=False
    )
    parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
    async with hopsched.Scheduler(settings) as scheduler:
        await scheduler.schedule(b"filler", delay=0, routing_key=full.name)
        while relay.stats.delivered < 1:  # noqa: ASYNC110 - the relay's counter
            await asyncio.sleep(0.05)
        alone = await schedule_all(
            scheduler, [{"message": b"h", "delay": 2, "routing_key": healthy.name}] * 5
        )
        await healthy.wait_for(5, within=30)
        alone_ms = p50_ms(healthy)
        refused = await schedule_all(
            scheduler, [{"message": b"f", "delay": 0, "routing_key": full.name}] * 200
        )
        beside = await schedule_all(
            scheduler, [{"message": b"h", "delay": 2, "routing_key": healthy.name}] * 5
        )
        await healthy.wait_for(10, within=30)
        beside_ms = p50_ms(healthy, {s.schedule_id for s in beside})
        await parked.wait_for_ids({s.schedule_id for s in refused}, within=60)

    healthy.assert_never_early()
    reasons = {r.headers[HEADER_PARKED_REASON].split(";")[0] for r in parked.received}
    print(
        f"\nF20 prefetch {prefetch}: healthy p50 {alone_ms:.1f} ms alone, {beside_ms:.1f} ms "
        f"beside the full target; retries {relay.stats.retries}; parked {len(parked)}"
    )
    assert len(parked) == 200
    assert len(reasons) == 1
    (reason,) = reasons
    assert "basic.nack" in reason
    assert all("; refused" in r.headers[HEADER_PARKED_REASON] for r in parked.received)
    assert relay.stats.retries >= 200, "nacked messages were not retried"
    assert beside_ms < RETRY_FIRST_MS / 2, "healthy messages waited behind the refused ones"
    lines = [r.getMessage() for r in caplog.records if full.name in r.getMessage()]
    assert len(lines) <= 6, f"{len(lines)} log lines about one full target: {lines[:3]}"
    assert len({s.schedule_id for s in alone + beside} - set(healthy.counts())) == 0


# F23 ------------------------------------------------------------------------------------


async def test_F23_many_missing_targets_are_parked_without_starving_healthy_ones(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
) -> None:
    """2,500 messages each for its own missing exchange were parked one at a time
    (~14 ms each) and held healthy ones back 16 s; now each target has its lane and the
    healthy ones keep their usual lateness (within twice that of the same run without
    the parkings). A ratio of two lateness samples is load, not queueing (the 2,500
    channel opens and refusals slow every publish on the relay's connection on a loaded
    machine), so the test asks for the outcome: the healthy ones did not wait for the
    parkings, each median lateness under half the time from the first parked message to
    the last, or under a second (the defect held them 16 s)."""
    healthy = await targets.queue()
    parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
    alone = await schedule_all(
        scheduler, [{"message": b"h", "delay": 1, "routing_key": healthy.name}] * 10
    )
    await healthy.wait_for(10, within=30)
    alone_ms = p50_ms(healthy)

    missing = await schedule_all(
        scheduler,
        [
            {"message": b"m", "delay": 0, "exchange": f"missing-{i}", "routing_key": "k"}
            for i in range(2500)
        ],
    )
    beside = await schedule_all(
        scheduler, [{"message": b"h", "delay": 1, "routing_key": healthy.name}] * 10
    )
    await healthy.wait_for(20, within=60)
    await parked.wait_for_ids({s.schedule_id for s in missing}, within=120)
    beside_ms = p50_ms(healthy, {s.schedule_id for s in beside})
    parking_ms = (parked.received[-1].received_us - parked.received[0].received_us) / 1000
    print(
        f"\nF23: healthy p50 {alone_ms:.1f} ms alone, {beside_ms:.1f} ms beside 2,500 "
        f"parkings, which took {parking_ms:.0f} ms from the first to the last"
    )
    healthy.assert_never_early()
    assert all("does not exist" in r.headers[HEADER_PARKED_REASON] for r in parked.received)
    assert len(parked.counts()) == 2500
    assert beside_ms < max(parking_ms / 2, 1000), "healthy messages waited for the parkings"
    assert {s.schedule_id for s in alone + beside} == set(healthy.counts())


# F26 ------------------------------------------------------------------------------------


async def test_F26_messages_sharing_one_message_id_are_not_serialized(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
) -> None:
    """300 messages with unique ids, 300 healthy and 20 unroutable ones all with
    message_id "order-42", scheduled interleaved and due together: the shared ones are
    as on time as the unique ones (they were serialized: p50 744 vs 178 ms).

    Both kinds share one round, so a load spike on this shared machine slows both
    alike. The outcome asserted is the order of arrival: without serialization it
    follows the interleaved order of scheduling, so about half of the first 300
    arrivals carry the shared id; serialized, the shared ones trail the unique ones."""
    parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
    target = await targets.queue()
    due = datetime.now(UTC) + timedelta(seconds=3)
    kinds = [(None, target.name), ("order-42", target.name)] * 300 + [("order-42", "nobody")] * 20
    calls = [
        {"message": aio_pika.Message(b"x", message_id=message_id), "at": due, "routing_key": key}
        for message_id, key in kinds
    ]
    scheduled = await schedule_all(scheduler, calls)
    await target.wait_for(600, within=60)
    await parked.wait_for(20, within=30)
    target.assert_never_early()
    assert set(target.counts()) == {s.schedule_id for s in scheduled[:600]}
    assert set(target.counts().values()) == {1}
    shared = {s.schedule_id for s in scheduled[1:600:2]}
    first_half = [r.schedule_id for r in target.received[:300]]
    shared_first = sum(1 for schedule_id in first_half if schedule_id in shared)
    print(
        f"\nF26: p50 {p50_ms(target, shared):.1f} ms shared id, "
        f"{p50_ms(target, set(target.counts()) - shared):.1f} ms unique ids; "
        f"{shared_first} of the first 300 arrivals share the id"
    )
    assert shared_first >= 100, f"only {shared_first} of the first 300 arrivals share the id"


# F27 ------------------------------------------------------------------------------------


async def test_F27_a_step_queue_deleted_at_runtime_is_declared_again(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: AMQP,
) -> None:
    """Deleting ``{prefix}.step.1024`` used to park valid messages and make schedule()
    raise Unroutable naming an internal queue. Now the relay and the Scheduler declare
    the step again and the messages are delivered on time. (A 1 s hold window: 4 s go
    through the scheduler's 2.048 s step, then the relay's 1.024 s one; 2 s straight into
    the 1.024 s step.)"""
    settings = make_settings(hold_window_ms=1000)
    relay = await relays.start(settings)
    target = await targets.queue()
    step = hopsched.Topology.from_settings(settings).step_queue(1024)
    async with hopsched.Scheduler(settings) as scheduler:
        relayed = await scheduler.schedule(b"relayed", delay=4, routing_key=target.name)
        async with amqp.channel() as channel:
            await channel.queue_delete(step)

        direct = await scheduler.schedule(b"direct", delay=2.0, routing_key=target.name)
    assert direct.first_queue == step

    await target.wait_for_ids({relayed.schedule_id, direct.schedule_id}, within=30)
    target.assert_never_early()
    assert relay.stats.parked == 0
    assert await message_count(amqp, step) == 0
    assert math.isfinite(p50_ms(target))
    print(f"\nF27: {target.lateness_line()}")


async def test_F27_the_parking_queue_deleted_at_runtime_is_declared_again(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    amqp: AMQP,
) -> None:
    """The same kind of fault for ``{prefix}.parked``: the relay declares it again and
    parks the message there, rather than losing it or handing it back."""
    parked_queue = hopsched.Topology.from_settings(settings).parked_queue
    async with amqp.channel() as channel:
        await channel.queue_delete(parked_queue)

    await scheduler.schedule(b"lost?", delay=0, routing_key="nobody-listens-here")

    async with asyncio.timeout(30):
        while relay.stats.parked + relay.stats.rejected == 0:  # noqa: ASYNC110 - counters
            await asyncio.sleep(0.05)
    assert relay.stats.parked == 1
    assert relay.stats.rejected == 0
    assert await message_count(amqp, parked_queue) == 1
