"""The journal across a relay killed (SIGKILL) and a node killed (``kill -9``), on private
nodes: a reschedule still holds, nothing is lost or delivered twice, and ``get`` answers
from the broker afterwards (from another process: the CLI). And a Scheduler's journal
connection refused for a while: its records are written once it opens."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from support import Relays, Targets, hopsched_cli, until
from support.private_nodes import (  # noqa: F401 (node_targets: a fixture)
    PrivateBroker,
    consume_after_restart,
    node_settings,
    node_targets,
    resend_dead_letters_soon,
)
from support.relays import RelayProcess

import hopsched
from hopsched.journal.records import DELIVERED, HELD, PENDING

pytestmark = pytest.mark.slow


async def test_a_reschedule_holds_across_a_relay_killed_after_it(
    private_broker: PrivateBroker,
    prefix: str,
    node_targets: Targets,  # noqa: F811
) -> None:
    settings = node_settings(private_broker, prefix)
    relay = await RelayProcess(settings).start()
    target = await node_targets.queue()
    async with hopsched.Scheduler(settings) as scheduler:
        old = await scheduler.schedule(b"x", delay=60, routing_key=target.name)
        new = await scheduler.reschedule(old.schedule_id, delay=4)
        assert new is not None
        await relay.kill()
        await relay.start()
        (received,) = await target.wait_for(1, within=30)
        assert received.received_us >= new.due_us
        await asyncio.sleep(1.0)
        info = await scheduler.get(old.schedule_id)
    assert len(target) == 1
    assert info is not None
    assert (info.state, info.due_us) == (DELIVERED, new.due_us)
    await relay.terminate(within=30)


async def test_the_journal_and_a_reschedule_survive_a_node_killed(
    private_broker: PrivateBroker,
    prefix: str,
    relays: Relays,
    node_targets: Targets,  # noqa: F811
) -> None:
    settings = node_settings(private_broker, prefix)
    target = await node_targets.queue()
    await relays.start(settings)
    await private_broker.save_ra_directory()
    resend_dead_letters_soon(private_broker)  # a step's stuck dead-letters: 5 s, not 180 s
    async with hopsched.Scheduler(settings) as scheduler:
        old = await scheduler.schedule(b"x", delay=300, routing_key=target.name)
        new = await scheduler.reschedule(old.schedule_id, delay=25)
        assert new is not None
    await private_broker.kill()
    await private_broker.start()
    env = {"HOPSCHED_URL": private_broker.url, "HOPSCHED_PREFIX": prefix}
    status, out, err = await hopsched_cli("get", old.schedule_id, "--json", env=env)
    assert status == 0, err
    assert (json.loads(out)["state"], json.loads(out)["due_us"]) == (PENDING, new.due_us)
    collector = await consume_after_restart(private_broker, target.name)
    (received,) = await collector.wait_for(1, within=60)
    assert received.received_us >= new.due_us
    await asyncio.sleep(1.0)
    assert len(collector) == 1
    status, out, err = await hopsched_cli("get", old.schedule_id, "--json", env=env)
    assert status == 0, err
    assert json.loads(out)["state"] == DELIVERED


async def test_schedules_are_known_once_the_journal_s_connection_opens_again(
    private_broker: PrivateBroker,
    prefix: str,
    relays: Relays,
    node_targets: Targets,  # noqa: F811
) -> None:
    """A Scheduler writes the journal on a connection of its own, opened at its first
    write: while the broker refuses it (a connection limit on the producer's user here;
    in the field a node frozen or lost), each record is kept, not dropped, and written
    once it opens; get() then knows every schedule, and each is delivered, none early."""
    await private_broker.rabbitmqctl("add_user", "producer", "secret")
    await private_broker.rabbitmqctl("set_permissions", "producer", ".*", ".*", ".*")
    url = private_broker.url.replace("guest:guest@", "producer:secret@")
    settings = node_settings(private_broker, prefix)
    await relays.start(settings)
    target = await node_targets.queue()
    producer = hopsched.Settings(url=url, prefix=prefix, log_interval_s=5.0)
    async with hopsched.Scheduler(producer) as scheduler:
        await private_broker.rabbitmqctl("set_user_limits", "producer", '{"max-connections": 1}')
        scheduled, took = [], []
        for index in range(10):
            started = time.monotonic()
            scheduled.append(
                await scheduler.schedule(b"%d" % index, delay=8, routing_key=target.name)
            )
            took.append(time.monotonic() - started)
        print(f"\nschedule() with the journal's connection refused: max {max(took):.2f} s")
        assert (scheduler.journal_backlog, scheduler.journal_failures) == (10, 10)
        await private_broker.rabbitmqctl("clear_user_limits", "producer", "max-connections")
        started = time.monotonic()
        await until(lambda: scheduler.journal_backlog == 0, within=60)
        print(f"written again {time.monotonic() - started:.1f} s after the limit went")
        for one in scheduled:
            info = await scheduler.get(one.schedule_id)
            assert info is not None
            assert (info.state in {PENDING, HELD, DELIVERED}, info.due_us) == (True, one.due_us)
        assert (scheduler.journal_rewritten, scheduler.journal_dropped) == (10, 0)
    await target.wait_for_ids({one.schedule_id for one in scheduled}, within=60)
    target.assert_never_early()
    assert len(target) == 10
