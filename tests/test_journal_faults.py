"""The journal across a relay killed (SIGKILL) and a node killed (``kill -9``), on private
nodes: a reschedule still holds, nothing is lost or delivered twice, and ``get`` answers
from the broker afterwards (from another process: the CLI)."""

from __future__ import annotations

import asyncio
import json

import pytest
from broker import PrivateBroker
from support import Relays, Targets, hopsched_cli
from test_faults import RelayProcess
from test_faults_broker import _consume_after_restart, node_settings, node_targets  # noqa: F401

import hopsched
from hopsched.journal import DELIVERED, PENDING

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
    collector = await _consume_after_restart(private_broker, target.name)
    (received,) = await collector.wait_for(1, within=60)
    assert received.received_us >= new.due_us
    await asyncio.sleep(1.0)
    assert len(collector) == 1
    status, out, err = await hopsched_cli("get", old.schedule_id, "--json", env=env)
    assert status == 0, err
    assert json.loads(out)["state"] == DELIVERED
