"""Cancel and reschedule by schedule id, against the real broker: never delivered once
cancelled in time, moved when rescheduled, across relays, relay crashes and restarts.

Timing goals are printed, not asserted; "never delivered" and "delivered at or after the
new time" are exact.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import aio_pika
import pytest
from support import Relays, Targets, hopsched_cli, until

import hopsched
from hopsched.core.clock import now_us

S = 1_000_000
SECRET = hopsched.SigningKey("ops", b"the test's own secret, 32 bytes.")


@pytest.mark.parametrize(
    ("delay_s", "cancel_before_s", "label"),
    [
        (6.0, 5.5, "5.5 s ahead, on the ladder"),  # beyond the 4 s hold window: on a step
        (3.0, 1.0, "1 s ahead, held by the relay"),
        (1.5, 0.25, "250 ms ahead, held"),
    ],
)
async def test_a_cancel_in_time_is_never_delivered(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
    delay_s: float,
    cancel_before_s: float,
    label: str,
) -> None:
    target = await targets.queue()
    # The Scheduler's first cancel declares the cancel stream (up to ~100 ms on RabbitMQ
    # 4.0, more with four test processes on two cores: CI saw one 100 ms ahead confirmed
    # too late): that is not the cancel timed here.
    await scheduler.cancel(targets.name("warm-up"))
    control = await scheduler.schedule(b"control", delay=delay_s, routing_key=target.name)
    doomed = await scheduler.schedule(b"doomed", delay=delay_s, routing_key=target.name)
    await asyncio.sleep(max(0.0, (doomed.due_us - now_us()) / S - cancel_before_s))

    result = await scheduler.cancel(doomed)

    assert result.in_time is True
    await target.wait_for_ids({control.schedule_id}, within=30)
    await target.settle(1.0)
    assert set(target.counts()) == {control.schedule_id}, f"{label}: delivered anyway"
    await until(lambda: relay.stats.cancelled == 1, within=30)


async def test_a_cancel_an_hour_ahead_is_applied_at_the_messages_next_hop(
    make_settings: Callable[..., hopsched.Settings], relays: Relays, targets: Targets
) -> None:
    """Due in an hour: with a ladder topping at 1 s the message comes by the relay every
    second; the first visit after the cancel drops it, and nothing is left anywhere."""
    settings = make_settings(max_step_ms=1024, hold_window_ms=1000)
    relay = await relays.start(settings)
    target = await targets.queue()
    async with hopsched.Scheduler(settings) as scheduler:
        doomed = await scheduler.schedule(b"an hour", delay=3600, routing_key=target.name)
        result = await scheduler.cancel(doomed.schedule_id)  # the id alone
    assert result.in_time is None  # no due time given: it cannot say
    await until(lambda: relay.stats.cancelled == 1, within=10)
    assert len(target) == 0


async def test_a_cancel_at_the_last_moment_is_reported_as_a_race(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    target = await targets.queue()
    racing = await scheduler.schedule(b"racing", delay=1.0, routing_key=target.name)
    await asyncio.sleep(max(0.0, (racing.due_us - now_us()) / S - 0.01))

    result = await scheduler.cancel(racing)

    assert result.in_time is False
    await asyncio.sleep(1.0)
    print(f"\ncancelled 10 ms ahead: delivered {len(target)} time(s)")
    assert len(target) <= 1


async def test_cancelling_an_unknown_or_delivered_id_is_no_error(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    target = await targets.queue()
    done = await scheduler.schedule(b"done", delay=0, routing_key=target.name)
    await target.wait_for(1, within=30)

    unknown = await scheduler.cancel("never-scheduled")
    late = await scheduler.cancel(done)

    assert unknown.in_time is None
    assert late.in_time is False


async def test_the_cli_says_a_delivered_id_had_nothing_pending_to_cancel(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
) -> None:
    """The outcome first (a trial read "cancel recorded …" as "cancelled"), then that the
    record is written all the same; exit 0."""
    target = await targets.queue()
    done = await scheduler.schedule(b"done", delay=0, routing_key=target.name)
    await target.wait_for(1, within=30)

    async def state() -> str | None:
        info = await scheduler.get(done.schedule_id)
        return info.state if info is not None else None

    async with asyncio.timeout(30):  # its record is written just after the target has it
        while await state() != "delivered":  # noqa: ASYNC110 (the journal signals nothing)
            await asyncio.sleep(0.1)

    status, out, err = await hopsched_cli("cancel", done.schedule_id, settings=settings)

    assert status == 0, err
    assert out.startswith(
        f"{done.schedule_id}: nothing pending to cancel: schedule {done.schedule_id!r} was "
        "delivered at "
    )
    assert out.rstrip().endswith(
        "no longer pending (the cancel is recorded all the same; it reaches no message "
        "scheduled after it)"
    )


async def test_the_same_id_scheduled_twice_then_cancelled_then_scheduled_again(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    """Two schedules with one id are two messages: both delivered (a de-duplicating
    consumer keeps the first). A cancel takes both; the id scheduled after it is new."""
    target = await targets.queue()
    for _ in range(2):
        await scheduler.schedule(b"twice", delay=0, routing_key=target.name, schedule_id="dup")
    await target.wait_for(2, within=30)
    for _ in range(2):
        await scheduler.schedule(b"gone", delay=2, routing_key=target.name, schedule_id="dup")
    await scheduler.cancel("dup")
    again = await scheduler.schedule(b"again", delay=1, routing_key=target.name, schedule_id="dup")
    await target.wait_for(3, within=30)
    await asyncio.sleep(2.5)
    assert [r.body for r in target.received] == [b"twice", b"twice", b"again"]
    assert target.received[2].due_us == again.due_us


async def test_cancels_reach_every_relay(
    settings: hopsched.Settings, relays: Relays, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    """Two relays compete for the messages; each reads every cancel."""
    first, second = await relays.start(settings), await relays.start(settings)
    target = await targets.queue()
    doomed = [
        await scheduler.schedule(b"doomed", delay=2.5, routing_key=target.name) for _ in range(40)
    ]
    kept = await scheduler.schedule(b"kept", delay=2.5, routing_key=target.name)
    await scheduler.cancel_many(doomed)
    await target.wait_for_ids({kept.schedule_id}, within=30)
    await target.settle(1.0)
    assert set(target.counts()) == {kept.schedule_id}
    assert first.stats.cancelled + second.stats.cancelled == 40
    assert first.stats.records >= 40
    assert second.stats.records >= 40


async def test_a_reschedule_later_holds_the_message_until_the_new_time(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    target = await targets.queue()
    moved = await scheduler.schedule(b"moved", delay=1.0, routing_key=target.name)

    new = await scheduler.reschedule(moved, delay=3.0)

    assert new is not None
    (received,) = await target.wait_for(1, within=30)
    assert received.received_us >= new.due_us
    assert received.due_us == new.due_us  # the header says the new due time
    print(f"\nrescheduled 2 s later: {(received.received_us - new.due_us) / 1000:.1f} ms late")


@pytest.mark.parametrize(
    ("delay_s", "new_delay_s"),
    [
        (3.0, 1.0),  # held by the relay
        (8.0, 2.0),  # on a 4.096 s hop: a new copy, the old one cancelled (F37)
    ],
)
async def test_a_reschedule_earlier_is_delivered_at_the_new_time(
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
    delay_s: float,
    new_delay_s: float,
) -> None:
    target = await targets.queue()
    started = now_us()
    moved = await scheduler.schedule(b"sooner", delay=delay_s, routing_key=target.name)
    await asyncio.sleep(0.3)

    new = await scheduler.reschedule(
        moved.schedule_id, at=datetime.now(UTC) + timedelta(seconds=new_delay_s - 0.3)
    )

    assert new is not None
    (received,) = await target.wait_for(1, within=30)
    assert received.received_us >= new.due_us
    assert received.due_us == new.due_us
    await until(lambda: relay.stats.cancelled == 1, within=delay_s + 10)  # the old copy
    await target.settle(0.5)
    assert len(target) == 1
    print(
        f"\nrescheduled from {delay_s} to {new_delay_s} s: arrived at "
        f"{(received.received_us - started) / S:.2f} s, "
        f"{(received.received_us - new.due_us) / 1000:.1f} ms after the new due time"
    )


async def scheduler_get(settings: hopsched.Settings, schedule_id: str) -> object:
    async with hopsched.Scheduler(settings) as scheduler:
        info = await scheduler.get(schedule_id)
    assert info is not None
    return (info.state, info.cancelled_us)


async def test_the_cli_cancels_and_reschedules(
    settings: hopsched.Settings, relay: hopsched.Relay, targets: Targets
) -> None:
    target = await targets.queue()
    schedule_id = f"order-{uuid.uuid4().hex[:8]}-timeout"
    # Due in 12 s: each CLI call starts a Python process (seconds on a loaded machine);
    # due in 3 s, it was delivered before the reschedule came (a flaky run), and the
    # schedule reads the journal for a duplicate id.
    status, out, err = await hopsched_cli(
        "schedule", "--in", "12s", "--routing-key", target.name, "--body", "x",
        "--schedule-id", schedule_id, settings=settings,
    )  # fmt: skip
    assert status == 0, err
    assert out.split()[1] == schedule_id
    status, out, err = await hopsched_cli(
        "reschedule", schedule_id, "--in", "14s", settings=settings
    )
    assert status == 0, err
    assert out.startswith(f"rescheduled {schedule_id} due ")
    status, out, err = await hopsched_cli("cancel", schedule_id, "other-id", settings=settings)
    assert status == 0, err
    [mine, other] = out.splitlines()
    assert mine.startswith(f"cancelled {schedule_id} (was due ")
    assert mine.endswith(": in time, it will not be delivered")  # due in 14 s
    # A trial read "cancel recorded" as "cancelled": the outcome comes first.
    assert other.startswith("other-id: nothing pending to cancel: the journal knows no ")
    assert (
        "the cancel is recorded all the same, for a message of this id "
        "scheduled before now that the journal does not show yet (not one published "
        "with x-delay still waiting in "
    ) in other
    assert other.endswith("`hopsched status` shows such messages)")
    first = await scheduler_get(settings, schedule_id)
    status, out, err = await hopsched_cli("cancel", schedule_id, settings=settings)
    assert status == 0, err
    assert out.startswith(f"{schedule_id} was cancelled already, at ")  # a trial: "cancelled"
    assert out.rstrip().endswith("nothing changed")
    assert await scheduler_get(settings, schedule_id) == first  # its first cancel's instant
    started = time.monotonic()
    await until(lambda: relay.stats.cancelled == 2, within=30)  # the old copy and the new
    await asyncio.sleep(max(0.0, 5 - (time.monotonic() - started)))
    assert len(target) == 0


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
async def test_cancels_survive_the_deletion_of_their_stream(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
    signed: bool,
) -> None:
    """Issue: with only ``{prefix}.cancelled`` deleted, 9 of 10 messages cancelled before
    were delivered once a relay restarted, and ``status`` exited 0. Now a relay restores
    the stream's records from the journal's copies before it delivers anything (signed
    ones verify as they did), and ``status`` exits 1 until one has."""
    keys = {"signing_keys": (SECRET,), "require_signatures": True} if signed else {}
    settings = make_settings(**keys)
    secret = base64.urlsafe_b64encode(SECRET.secret).decode()
    env = {"HOPSCHED_SIGNING_KEYS": f"{SECRET.key_id}:{secret}"} if signed else None
    topology = hopsched.Topology.from_settings(settings)
    target = await targets.queue()
    relay = await relays.start(settings)
    async with hopsched.Scheduler(settings) as scheduler:
        due = datetime.now(UTC) + timedelta(seconds=8)
        scheduled = [
            await scheduler.schedule(b"x", at=due, routing_key=target.name) for _ in range(10)
        ]
        cancelled = await scheduler.cancel_many(scheduled[:8])
        assert all(c.in_time for c in cancelled)
        moved = await scheduler.reschedule(scheduled[8], at=due + timedelta(seconds=3))
        assert moved is not None
        kept = scheduled[9]

        async with amqp.channel() as channel:
            await channel.queue_delete(topology.cancel_stream)
        task = relays.tasks.pop(relay)
        with pytest.raises(hopsched.PrefixNotDeclaredError):
            async with asyncio.timeout(30):
                await task
        status, out, err = await hopsched_cli("status", settings=settings, env=env)
        assert status == 1, (out, err)
        assert f"{topology.cancel_stream} is missing (deleted?)" in err, err
        await scheduler.cancel(targets.name("unrelated"))  # declares the stream anew

    status, out, err = await hopsched_cli("status", settings=settings, env=env)
    assert status == 1, (out, err)
    assert f"{topology.cancel_stream} was declared anew" in err, err

    await relays.start(settings)
    await target.wait_for_ids({kept.schedule_id, moved.schedule_id}, within=60)
    await target.settle(1.0)
    target.assert_never_early()
    assert target.counts() == {kept.schedule_id: 1, moved.schedule_id: 1}
    moved_at = {r.schedule_id: r.received_us for r in target.received}[moved.schedule_id]
    assert moved_at >= moved.due_us, "the rescheduled message came at its old time"
    status, out, err = await hopsched_cli("status", settings=settings, env=env)
    assert status == 0, (out, err)
