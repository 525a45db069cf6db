"""Recurring schedules against the real broker: each occurrence delivered once, on the
rule, never early; the chain ends at count, by cancel; signed chains stay signed; a
relay that was down catches up as the rule's policy says.

Timing goals are printed, not asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Callable
from datetime import timedelta

import aio_pika
import pytest
from support import Relays, Targets, hopsched_cli, until

import hopsched
from hopsched.core.cancel import Cancellations
from hopsched.core.clock import now_us, us_to_datetime
from hopsched.core.decide import Decider, Linked
from hopsched.core.envelope import HEADER_KEY, HEADER_OCCURRENCE, HEADER_RULE, Envelope
from hopsched.topology import Topology

S = 1_000_000


async def test_every_second_with_a_count_delivers_each_occurrence_once_on_the_rule(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    target = await targets.queue()
    first = await scheduler.schedule(
        b"tick", every=timedelta(seconds=1), count=4, routing_key=target.name, schedule_id="tick"
    )
    await target.wait_for(4, within=30)
    await target.settle(2.0)  # the chain ended: nothing more comes

    received = target.received
    assert [r.headers[HEADER_OCCURRENCE] for r in received] == [1, 2, 3, 4]
    assert [r.due_us for r in received] == [first.due_us + k * S for k in range(4)]
    assert {r.schedule_id for r in received} == {"tick"}
    assert [r.headers[HEADER_KEY] for r in received] == [f"tick@{r.due_us}" for r in received]
    assert [r.properties.message_id for r in received] == [r.headers[HEADER_KEY] for r in received]
    assert all(HEADER_RULE not in r.headers for r in received)
    assert [r.body for r in received] == [b"tick"] * 4
    target.assert_never_early()
    target.assert_no_broker_death_headers()
    await until(lambda: relay.stats.links == 3, within=5)
    print(f"\nevery 1 s x4: {target.lateness_line()}")


async def test_a_recurrence_value_schedules_as_its_keywords_do(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    """``recurrence=Recurrence(...)``: the same chain as the keyword form, defined once
    and reused for two schedules."""
    target = await targets.queue()
    twice = hopsched.Recurrence(every=timedelta(seconds=1), count=2)
    firsts = [
        await scheduler.schedule(
            b"r", recurrence=twice, routing_key=target.name, schedule_id=schedule_id
        )
        for schedule_id in ("r1", "r2")
    ]
    await target.wait_for(4, within=30)
    await target.settle(2.0)  # each chain ended after its count

    for first in firsts:
        mine = [r for r in target.received if r.schedule_id == first.schedule_id]
        assert [r.headers[HEADER_OCCURRENCE] for r in mine] == [1, 2]
        assert [r.due_us for r in mine] == [first.due_us, first.due_us + S]
    target.assert_never_early()


async def test_get_shows_a_recurring_schedules_next_occurrence_then_its_last(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    """The journal follows the chain: once occurrence 1 is delivered, ``get()`` shows
    occurrence 2, pending, at its due time; once the last is delivered, ``delivered``.
    ``reschedule()`` refuses a recurring schedule, naming what to do instead."""
    target = await targets.queue()
    first = await scheduler.schedule(
        b"tick", every=timedelta(seconds=3), count=2, routing_key=target.name, schedule_id="c"
    )
    info = await scheduler.get("c")
    assert info is not None
    assert (info.occurrence, info.due_us) == (1, first.due_us)
    assert info.state in ("pending", "held"), info  # held: due within the hold window

    await target.wait_for(1, within=30)
    for _ in range(50):  # the relay's record follows its confirm within a moment
        info = await scheduler.get("c")
        if info is not None and info.occurrence == 2:
            break
        await asyncio.sleep(0.1)
    assert info is not None
    assert info.occurrence == 2, info
    assert info.state in ("pending", "held"), info
    assert info.due_us == first.due_us + 3 * S
    with pytest.raises(hopsched.InvalidScheduleError, match="recurring"):
        await scheduler.reschedule("c", delay=60)

    await target.wait_for(2, within=30)
    for _ in range(50):
        info = await scheduler.get("c")
        if info is not None and info.state == "delivered":
            break
        await asyncio.sleep(0.1)
    assert info is not None
    assert (info.state, info.occurrence, info.due_us) == ("delivered", 2, first.due_us + 3 * S)
    await target.settle(1.0)
    assert len(target.received) == 2


async def test_a_cron_schedule_in_a_time_zone_runs_at_whole_seconds(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    target = await targets.queue()
    await scheduler.schedule(
        b"cron", cron="*/2 * * * * *", tz="Europe/Paris", count=3, routing_key=target.name
    )
    await target.wait_for(3, within=30)
    await target.settle(2.5)
    dues = [r.due_us for r in target.received]
    assert len(dues) == 3
    assert all(due % (2 * S) == 0 for due in dues)  # on the rule: every even second
    assert [b - a for a, b in itertools.pairwise(dues)] == [2 * S, 2 * S]
    target.assert_never_early()


async def test_cancel_ends_the_chain_also_for_occurrences_created_after_it(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    """The next occurrences are published by the relay after the cancel record was
    written; they keep the schedule's created time, so the cancel reaches them."""
    target = await targets.queue()
    scheduled = await scheduler.schedule(b"stop me", every=1, routing_key=target.name)
    await target.wait_for(2, within=30)

    await scheduler.cancel(scheduled.schedule_id)
    cancelled_at = now_us()

    await target.settle(3.0)
    after = [r for r in target.received if r.due_us > cancelled_at + S]
    assert not after, f"{len(after)} occurrence(s) due over 1 s after the cancel delivered"
    await until(lambda: relay.stats.cancelled == 1, within=5)
    again = await scheduler.schedule(  # the same id scheduled after the cancel is new
        b"again", every=1, count=1, routing_key=target.name, schedule_id=scheduled.schedule_id
    )
    await until(lambda: any(r.body == b"again" for r in target.received), within=10)
    assert again.schedule_id == scheduled.schedule_id


async def test_a_signed_chain_stays_signed_and_owned(
    make_settings: Callable[..., hopsched.Settings], relays: Relays, targets: Targets
) -> None:
    key = f"k1:{secrets.token_urlsafe(32)}"
    settings = make_settings(signing_keys=[key], require_signatures=True)
    relay = await relays.start(settings)
    target = await targets.queue()
    async with hopsched.Scheduler(settings) as scheduler:
        scheduled = await scheduler.schedule(b"signed", every=1, count=3, routing_key=target.name)
        await target.wait_for(3, within=30)
        await target.settle(1.5)
        assert len(target) == 3
        assert relay.stats.parked == 0
        # a cancel signed with the key reaches the relay-made occurrences too
        long_lived = await scheduler.schedule(b"long", every=1, routing_key=target.name)
        await until(lambda: target.counts()[long_lived.schedule_id] >= 2, within=30)
        await scheduler.cancel(long_lived)
        await until(lambda: relay.stats.cancelled == 1, within=10)
    assert scheduled.schedule_id != long_lived.schedule_id


@pytest.mark.parametrize("catch_up", ["latest", "all", "none"])
async def test_occurrences_missed_while_no_relay_ran_follow_the_catch_up_policy(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    catch_up: str,
) -> None:
    """Every 1 s, count 8, the relay away for the first 5 s: ``latest`` delivers the
    latest missed one once, ``all`` every one of them at once, ``none`` (missed means
    over 10 s late) the same as ``latest`` here; then the rule goes on to 8 deliveries."""
    settings = make_settings()
    target = await targets.queue()
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        start = now_us() + S
        await scheduler.schedule(
            b"missed",
            every=1,
            start=us_to_datetime(start),
            count=8,
            catch_up=catch_up,
            routing_key=target.name,
        )
        await asyncio.sleep(5.5)  # no relay: occurrences at start, +1 s ... +4 s are due
        await relays.start(settings)
        await target.wait_for(8, within=30)
        await target.settle(1.5)
    dues = [r.due_us for r in target.received]
    target.assert_never_early()
    if catch_up == "all":
        assert dues == [start + k * S for k in range(8)]
    else:
        assert dues[0] >= start + 4 * S, (dues[0] - start) / S  # the latest missed one
        assert dues == [dues[0] + k * S for k in range(8)]
    print(f"\ncatch_up={catch_up}: first delivered due start+{(dues[0] - start) / S:.0f} s")


async def test_the_cli_schedules_every_and_cron_and_refuses_bad_rules_before_connecting(
    settings: hopsched.Settings, relay: hopsched.Relay, targets: Targets
) -> None:
    target = await targets.queue()
    status, out, err = await hopsched_cli(
        *("schedule", "--every", "1s", "--count", "2", "--routing-key", target.name),
        *("--schedule-id", "cli-every", "--body", "e"),
        settings=settings,
    )
    assert status == 0, err
    assert out.startswith("scheduled cli-every due ")
    assert "recurring" in out
    status, _, err = await hopsched_cli(
        *("schedule", "--cron", "* * * * * *", "--tz", "Europe/Paris", "--count", "2"),
        *("--routing-key", target.name, "--schedule-id", "cli-cron", "--catch-up", "all"),
        settings=settings,
    )
    assert status == 0, err
    await target.wait_for(4, within=30)
    await target.settle(1.5)
    assert target.counts() == {"cli-every": 2, "cli-cron": 2}

    for args, names in [
        (("--cron", "0 25 * * *"), "'0 25 * * *'"),
        (("--cron", "0 9 * * *", "--tz", "Europe/Pariss"), "'Europe/Pariss'"),
        (("--every", "1s", "--in", "5s"), "exactly one"),
        (("--in", "5s", "--count", "3"), "recurring"),
        (
            (
                "--every",
                "200ms",
            ),
            "every=",
        ),
    ]:
        status, _, err = await hopsched_cli(
            "schedule", *args, "--routing-key", target.name, settings=settings
        )
        assert status == 2, (args, err)
        assert names in err, (args, err)


async def test_a_relay_dying_after_it_scheduled_the_next_occurrence_does_not_fork_the_chain(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """The crash that could fork a chain, made by hand: a consumer takes occurrence 1
    from the relay queue, publishes its successor as a relay does, and dies before its
    ack. The relay gets occurrence 1 again (redelivered), claims a new lineage, delivers
    it and schedules its own successor; the dead one's successor meets the claim and is
    dropped. Each occurrence is delivered once (occurrence 1 could be twice: here the
    dead consumer delivered nothing)."""
    settings = make_settings()
    topology = Topology.from_settings(settings)
    target = await targets.queue()
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        first = await scheduler.schedule(
            b"chain",
            every=1,
            count=6,
            start=us_to_datetime(now_us() + 3 * S),
            catch_up="all",
            routing_key=target.name,
            schedule_id="chain",
        )
    channel = await amqp.channel()
    queue = await channel.get_queue(topology.relay_queue, ensure=False)
    taken = None
    async with asyncio.timeout(20):
        while taken is None:
            taken = await queue.get(no_ack=False, fail=False)
            if taken is None:
                await asyncio.sleep(0.05)
    headers = dict(taken.headers)
    decider = Decider(
        settings.ladder, settings.login, settings.target_policy, 0, settings.signatures
    )
    envelope = Envelope.from_headers(headers)
    linked = decider.link(envelope, taken.body, envelope.due_us, Cancellations(S))
    assert isinstance(linked, Linked)
    assert linked.next is not None
    own = {key: value for key, value in headers.items() if key.startswith("x-hopsched-")}
    successor = aio_pika.Message(
        taken.body, headers=own | linked.next.to_headers(), delivery_mode=2
    )
    await channel.default_exchange.publish(successor, routing_key=topology.relay_queue)
    await channel.close()  # dies before the ack: occurrence 1 goes back to the queue

    relay = await relays.start(settings)
    await target.wait_for(6, within=40)
    await target.settle(2.0)
    assert [r.due_us for r in target.received] == [first.due_us + k * S for k in range(6)]
    assert relay.stats.lineages == 1
    assert relay.stats.superseded == 1
    target.assert_never_early()
