"""A mistyped prefix never swallows a message (F36): scheduling, cancelling and
rescheduling on a prefix with no relay queue are refused, declaring nothing, unless the
caller asks to declare; ``status`` exits 1 while messages wait and no relay consumes."""

from __future__ import annotations

import logging

import aio_pika
import aiormq
import pytest
from support import Relays, hopsched_cli, message_count

import hopsched
from hopsched.broker.objects import declare_topology

AMQP = aio_pika.abc.AbstractConnection


async def assert_nothing_declared(amqp: AMQP, settings: hopsched.Settings) -> None:
    topology = hopsched.Topology.from_settings(settings)
    for name in topology.all_queues():
        channel = await amqp.channel()
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
            await channel.declare_queue(name, passive=True)
    channel = await amqp.channel()
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
        await channel.declare_exchange(topology.expired_exchange, passive=True)


async def test_F36_schedule_on_a_mistyped_prefix_is_refused_and_declares_nothing(
    settings: hopsched.Settings, amqp: AMQP
) -> None:
    """Main exited 0, declared a whole ladder, and the message waited for ever."""
    status, out, err = await hopsched_cli(
        *("schedule", "--in", "1s", "--routing-key", "q", "--body", "hi"), settings=settings
    )

    assert status == 4, (out, err)
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert f"prefix {settings.prefix!r} has no relay queue ({settings.prefix}.relay)" in err
    assert "check --prefix" in err
    assert "hopsched declare" in err
    await assert_nothing_declared(amqp, settings)


async def test_F36_a_scheduler_refuses_a_prefix_that_does_not_exist_until_asked_to_declare(
    settings: hopsched.Settings, amqp: AMQP
) -> None:
    topology = hopsched.Topology.from_settings(settings)

    with pytest.raises(hopsched.PrefixNotDeclaredError) as refused:
        async with hopsched.Scheduler(settings):
            pass
    assert (refused.value.prefix, refused.value.queue) == (settings.prefix, topology.relay_queue)
    scheduler = hopsched.Scheduler(settings)
    with pytest.raises(hopsched.PrefixNotDeclaredError):
        await scheduler.schedule(b"x", delay=3600, routing_key="q")
    with pytest.raises(hopsched.PrefixNotDeclaredError):
        await scheduler.cancel("order-42")  # no cancellation stream declared either
    await assert_nothing_declared(amqp, settings)

    scheduled = await scheduler.schedule(b"x", delay=3600, routing_key="q", declare=True)

    assert await message_count(amqp, scheduled.first_queue) == 1
    await scheduler.close()
    async with hopsched.Scheduler(settings) as again:  # the prefix exists now
        await again.schedule(b"y", delay=3600, routing_key="q")
    assert await message_count(amqp, scheduled.first_queue) == 2


async def test_a_scheduler_declares_a_missing_step_behind_an_existing_relay_queue(
    settings: hopsched.Settings, amqp: AMQP
) -> None:
    """F27 still holds without declare=True: the prefix exists, a step went missing."""
    await declare_topology(settings)
    topology = hopsched.Topology.from_settings(settings)
    step = topology.step_queue(1024)
    await (await amqp.channel()).queue_delete(step)

    async with hopsched.Scheduler(settings):
        pass

    assert await message_count(amqp, step) == 0  # declared again


async def test_F36_status_exits_1_while_messages_wait_and_no_relay_consumes(
    settings: hopsched.Settings, relays: Relays
) -> None:
    status, out, err = await hopsched_cli("declare", settings=settings)
    assert status == 0, err
    status, out, err = await hopsched_cli(
        "schedule", "--in", "1h", "--routing-key", "q", settings=settings
    )
    assert status == 0, err

    status, out, err = await hopsched_cli("status", settings=settings)

    assert status == 1, (out, err)
    assert "relay consumers: 0" in out
    assert f"1 message(s) wait on the ladder and no relay consumes {settings.prefix}.relay" in err
    await relays.start(settings)
    status, out, err = await hopsched_cli("status", settings=settings)
    assert status == 0, (out, err)


async def test_a_relay_on_a_prefix_that_does_not_exist_says_so_loudly(
    settings: hopsched.Settings, relays: Relays, caplog: pytest.LogCaptureFixture
) -> None:
    """It declares it (a relay is how a prefix comes to be) but warns: a mistyped prefix
    leaves the schedulers' messages on another one, unrelayed. A relay on an existing
    prefix says nothing of it."""
    caplog.set_level(logging.WARNING, "hopsched.relay")
    topology = hopsched.Topology.from_settings(settings)

    await relays.start(settings)
    await relays.start(settings)  # the prefix exists now

    warned = [r for r in caplog.records if "did not exist" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING]
    prefix = settings.prefix
    assert warned[0].getMessage() == (
        f"prefix {prefix!r} did not exist at {settings.masked_url}; this relay declared it: "
        f"exchange {prefix}.expired, queues {prefix}.relay, {prefix}.ingress and "
        f"{prefix}.parked, {len(topology.step_queues)} step queues {prefix}.step.16 to "
        f"{prefix}.step.4294967296, streams {prefix}.cancelled, {prefix}.journal and "
        f"{prefix}.ingresses. If "
        "the schedulers use an existing prefix, a mistyped --prefix (HOPSCHED_PREFIX) is a "
        "common cause: their messages wait there, unrelayed. Then stop this relay, run "
        f"`hopsched teardown --prefix {prefix}` to remove what it declared, and start it "
        "with the schedulers' prefix"
    )
    assert "guest:guest" not in warned[0].getMessage()


async def test_a_relay_that_finds_only_its_queue_gone_does_not_call_the_prefix_new(
    settings: hopsched.Settings,
    relays: Relays,
    amqp: aio_pika.abc.AbstractConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by a new-user trial: with ``{prefix}.relay`` alone deleted (an operator's
    repair), the next relay said the prefix did not exist and advised a teardown, which
    would have removed the step queues and what they held. It says what was missing."""
    caplog.set_level(logging.WARNING, "hopsched.relay")
    topology = hopsched.Topology.from_settings(settings)
    await relays.stop(await relays.start(settings))
    channel = await amqp.channel()
    await channel.queue_delete(topology.relay_queue)
    caplog.clear()

    await relays.start(settings)

    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "did not exist" in m], said
    assert any(m.startswith(f"{topology.relay_queue} was missing (deleted?)") for m in said), said
