"""Admin tools killed part-way, then run again (F29): nothing lost, duplicates bounded.

Each tool is killed with SIGKILL at an exact step (``interrupt.py``: after the Nth
message it moved is confirmed and before it is acked, or right after a queue is
deleted or declared), or at a random instant from outside; then the real command runs
again. Expected: it finishes the job; every message is there, duplicated at most once
per kill; a holding queue left by a killed upgrade shows in ``status``, ``declare`` and
``teardown``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections import Counter
from pathlib import Path

import aio_pika
import aiormq
import pytest
from support import Cleanup, get_all, hopsched_cli, message_count, wait_until_count

import hopsched
from hopsched.broker.objects import declare_topology
from hopsched.topology import DEAD_LETTER_ROUTING_KEY

AMQP = aio_pika.abc.AbstractConnection
INTERRUPT = Path(__file__).parents[1] / "support" / "interrupt.py"
#: Messages in the relay and parked queues of an old prefix (the fast tier; F29's own
#: 6,000 run in the slow test).
RELAY_MESSAGES, PARKED_MESSAGES = 600, 60


def cli_env(settings: hopsched.Settings) -> dict[str, str]:
    return dict(os.environ) | {
        "HOPSCHED_URL": str(settings.url),
        "HOPSCHED_PREFIX": settings.prefix,
        "HOPSCHED_QUEUE_TYPE": settings.queue_type,
    }


async def interrupted(settings: hopsched.Settings, tool: str, step: str, count: int) -> None:
    """Run ``tool`` and assert it was killed at ``step`` (see ``interrupt.py``)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(INTERRUPT),
        tool,
        step,
        str(count),
        env=cli_env(settings),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == -signal.SIGKILL, (process.returncode, out, err)


async def old_prefix(
    settings: hopsched.Settings,
    amqp: AMQP,
    cleanup: Cleanup,
    relay_messages: int = RELAY_MESSAGES,
    parked_messages: int = PARKED_MESSAGES,
) -> None:
    """A prefix as hopsched < 0.2 declared it (relay and parked queues without delivery
    limit and dead-lettering), the relay bound, bodies ``r0``, ``r1``... and ``p0``..."""
    topology = hopsched.Topology.from_settings(settings)
    cleanup.queues.update(topology.holding_queues)
    async with amqp.channel() as channel:
        exchange = await channel.declare_exchange(
            topology.expired_exchange, aio_pika.ExchangeType.DIRECT, durable=True
        )
        for name, count, tag in (
            (topology.relay_queue, relay_messages, "r"),
            (topology.parked_queue, parked_messages, "p"),
        ):
            queue = await channel.declare_queue(
                name, durable=True, arguments={"x-queue-type": settings.queue_type}
            )
            await asyncio.gather(
                *(
                    channel.default_exchange.publish(
                        aio_pika.Message(f"{tag}{i}".encode(), delivery_mode=2), routing_key=name
                    )
                    for i in range(count)
                )
            )
            if name == topology.relay_queue:
                await queue.bind(exchange, DEAD_LETTER_ROUTING_KEY)


async def exists(amqp: AMQP, queue: str) -> bool:
    channel = await amqp.channel()
    try:
        await channel.declare_queue(queue, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    await channel.close()
    return True


async def assert_all_there(amqp: AMQP, queue: str, tag: str, count: int, kills: int) -> None:
    """``queue`` holds every body ``{tag}0``...; each at most ``1 + kills`` times, and at
    most ``kills`` duplicates in all."""
    bodies = Counter(message.body.decode() for message in await get_all(amqp, queue))
    missing = {f"{tag}{i}" for i in range(count)} - set(bodies)
    assert not missing, f"{queue}: {len(missing)} of {count} lost, e.g. {sorted(missing)[:5]}"
    duplicates = sum(bodies.values()) - count
    print(f"{queue}: {count} kept, {duplicates} duplicate(s) after {kills} kill(s)")
    assert set(bodies) == {f"{tag}{i}" for i in range(count)}
    assert duplicates <= kills


async def assert_upgraded(settings: hopsched.Settings, amqp: AMQP, kills: int) -> None:
    topology = hopsched.Topology.from_settings(settings)
    await declare_topology(settings)  # no mismatch left
    for name in topology.holding_queues:
        assert not await exists(amqp, name), f"{name} left behind"
    await assert_all_there(amqp, topology.relay_queue, "r", RELAY_MESSAGES, kills)
    await assert_all_there(amqp, topology.parked_queue, "p", PARKED_MESSAGES, kills)


def upgrade_steps(prefix: str) -> list[tuple[str, int]]:
    relay, parked = f"{prefix}.relay", f"{prefix}.parked"
    return [
        (f"moved {relay} -> {relay}.upgrade", 1),
        (f"moved {relay} -> {relay}.upgrade", RELAY_MESSAGES // 3),
        (f"removed {relay}", 0),
        (f"declared {relay}", 0),
        (f"moved {relay}.upgrade -> {relay}", RELAY_MESSAGES // 2),
        (f"removed {relay}.upgrade", 0),
        (f"moved {parked} -> {parked}.upgrade", PARKED_MESSAGES // 2),
        (f"declared {parked}", 0),
        (f"moved {parked}.upgrade -> {parked}", PARKED_MESSAGES),
    ]


#: The fast tier kills at three steps (moving out, the queue deleted, moving back); the
#: slow tier at every one.
FAST_STEPS = (1, 2, 4)


@pytest.mark.parametrize(
    "at",
    [
        pytest.param(at, marks=() if at in FAST_STEPS else pytest.mark.slow)
        for at in range(len(upgrade_steps("p")))
    ],
)
async def test_F29_an_upgrade_killed_at_any_step_is_finished_by_the_next_run(
    settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup, at: int
) -> None:
    await old_prefix(settings, amqp, cleanup)
    topology = hopsched.Topology.from_settings(settings)
    step, count = upgrade_steps(settings.prefix)[at]

    await interrupted(settings, "upgrade", step, count)

    held = [name for name in topology.holding_queues if await exists(amqp, name)]
    status, out, err = await hopsched_cli("status", settings=settings)
    assert status == 1, (out, err)
    assert "hopsched upgrade" in err
    for name in held:  # the holding queue is always shown, and its messages counted
        assert name in out
        assert "interrupted upgrade" in err
        status, out, err = await hopsched_cli("teardown", settings=settings)
        assert status == 1, (out, err)
        assert f"{name} (" in err
        assert "interrupted upgrade" in err

    status, out, err = await hopsched_cli("upgrade", settings=settings)

    assert status == 0, (out, err)
    print(out)
    await assert_upgraded(settings, amqp, kills=1)


@pytest.mark.slow
async def test_F29_an_upgrade_killed_twice_is_finished_by_the_third_run(
    settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup
) -> None:
    await old_prefix(settings, amqp, cleanup)
    relay = f"{settings.prefix}.relay"
    await interrupted(settings, "upgrade", f"moved {relay} -> {relay}.upgrade", 100)
    await interrupted(settings, "upgrade", f"moved {relay}.upgrade -> {relay}", 100)

    status, out, err = await hopsched_cli("upgrade", settings=settings)

    assert status == 0, (out, err)
    await assert_upgraded(settings, amqp, kills=2)


async def test_F29_the_upgrade_command_killed_at_a_random_instant_is_finished_by_the_next_run(
    settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup
) -> None:
    """The real ``hopsched upgrade``, SIGKILLed from outside at a random instant while it
    runs (moving 1,320 messages one by one takes it about 2.5 s here)."""
    await old_prefix(settings, amqp, cleanup)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hopsched", "upgrade"),
        env=cli_env(settings),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await asyncio.sleep(random.uniform(0.3, 2.0))
    process.kill()
    out, _ = await process.communicate()
    print(f"killed after: {out.decode().splitlines()[-1:] or 'nothing'}")

    status, out, err = await hopsched_cli("upgrade", settings=settings)

    assert status == 0, (out, err)
    await assert_upgraded(settings, amqp, kills=1)


@pytest.mark.slow
async def test_F29_the_field_case_6000_messages_killed_while_moving_back(
    settings: hopsched.Settings, amqp: AMQP, cleanup: Cleanup
) -> None:
    """F29 as reported: 6,000 messages in ``{prefix}.relay``, the upgrade killed with
    3,988 still in ``{prefix}.relay.upgrade`` (and one more, confirmed back but not yet
    acked: it returns there too); main's rerun said "up to date" and left them."""
    await old_prefix(settings, amqp, cleanup, relay_messages=6000, parked_messages=0)
    relay = f"{settings.prefix}.relay"
    await interrupted(settings, "upgrade", f"moved {relay}.upgrade -> {relay}", 2012)
    await wait_until_count(amqp, f"{relay}.upgrade", 3989, within=30)

    status, out, err = await hopsched_cli("status", settings=settings)
    assert status == 1, (out, err)
    assert f"{relay}.upgrade holds 3989 message(s) of an interrupted upgrade" in err
    status, out, err = await hopsched_cli("upgrade", settings=settings, within=180)

    assert status == 0, (out, err)
    assert "finished an interrupted upgrade: 3989 messages moved back" in out
    assert not await exists(amqp, f"{relay}.upgrade")
    await assert_all_there(amqp, relay, "r", 6000, kills=1)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_an_upgrade_of_a_prefix_that_does_not_exist_declares_nothing(
    settings: hopsched.Settings, amqp: AMQP, queue_type: str
) -> None:
    """Found by a new-user trial: it declared 31 queues and a stream and said "up to date"."""
    status, out, err = await hopsched_cli("upgrade", settings=settings)

    assert status == 4, (out, err)
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert f"nothing of prefix {settings.prefix!r} exists" in err
    assert "check --prefix" in err
    topology = hopsched.Topology.from_settings(settings)
    for name in [*topology.all_queues(), *topology.holding_queues]:
        assert not await exists(amqp, name)


async def parked_messages(settings: hopsched.Settings, amqp: AMQP, count: int) -> None:
    """``count`` messages in ``{prefix}.parked`` as the relay parks them (ids ``p0``...)."""
    await declare_topology(settings)
    topology = hopsched.Topology.from_settings(settings)
    async with amqp.channel() as channel:
        await asyncio.gather(
            *(
                channel.default_exchange.publish(
                    aio_pika.Message(
                        f"p{i}".encode(),
                        delivery_mode=2,
                        headers={
                            "x-hopsched-id": f"p{i}",
                            "x-hopsched-parked-reason": "test",
                        },
                    ),
                    routing_key=topology.parked_queue,
                )
                for i in range(count)
            )
        )


@pytest.mark.parametrize(
    "after",
    [pytest.param(1, marks=pytest.mark.slow), 50, pytest.param(100, marks=pytest.mark.slow)],
)
async def test_a_parked_replay_killed_is_finished_by_the_next_run(
    settings: hopsched.Settings, amqp: AMQP, after: int
) -> None:
    await parked_messages(settings, amqp, 100)
    topology = hopsched.Topology.from_settings(settings)

    await interrupted(settings, "replay", f"replayed to {topology.relay_queue}", after)

    # the one in flight returns to the queue once the broker sees the connection gone
    await wait_until_count(amqp, topology.parked_queue, 100 - after + 1, within=30)
    status, out, err = await hopsched_cli("parked", "replay", "--all", settings=settings)
    assert status == 0, (out, err)
    assert await message_count(amqp, topology.parked_queue) == 0
    await assert_all_there(amqp, topology.relay_queue, "p", 100, kills=1)


async def test_a_teardown_killed_is_finished_by_the_next_run(
    settings: hopsched.Settings, amqp: AMQP
) -> None:
    await declare_topology(settings)
    topology = hopsched.Topology.from_settings(settings)
    first = topology.step_queues[0]

    await interrupted(settings, "teardown", f"removed {topology.step_queues[9]}", 0)

    assert not await exists(amqp, first)
    assert await exists(amqp, topology.relay_queue)
    status, out, err = await hopsched_cli("teardown", settings=settings)
    assert status == 0, (out, err)
    assert f"did not exist: {first}" in out
    assert f"removed {topology.relay_queue}" in out
    for name in topology.all_queues():
        assert not await exists(amqp, name)

    status, out, err = await hopsched_cli("teardown", settings=settings)
    assert status == 4, (out, err)  # now nothing is left: one line, nothing removed
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert f"nothing of prefix {settings.prefix!r} exists" in err
