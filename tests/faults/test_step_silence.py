"""A step queue that neither confirms nor nacks (issue: a frozen quorum leader).

On a private node the Ra server of one quorum step queue is suspended (``sys:suspend``):
publishes into that queue get no answer, while the broker answers every other. This is
what a step's leader on a frozen node (SIGSTOP, a paused VM) does to the publishers on
healthy nodes; before, ``schedule()`` waited out its whole publish timeout (30 s) and a
relay's hop waited until the node woke.

Outcomes asserted: the call returns ``Scheduled`` (no ``PublishTimeoutError``), the relay
routes its hop around the silent step (``hop_silences``), every message is delivered
while the queue is still suspended, none early; once the queue resumes, the copies it
kept come out too: each message at most twice (the duplicate ``STEP_SILENCE_S`` costs,
docs/guarantees.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from support import Relays, Targets
from support.private_nodes import node_settings

import hopsched
from hopsched.core.ladder import STEP_SILENCE_S
from hopsched.testing.localbroker import PrivateBroker

pytestmark = pytest.mark.slow

#: The step suspended, ms.
SILENT_STEP_MS = 8192
#: Due times (s from scheduling): into that step by ``schedule()``; into the next one by
#: ``schedule()``, then into that one by the relay. Each leaves 4.5 s after the step, more
#: than the relay's hold window (4 s): it is hopped, not held.
BY_SCHEDULE_S = 8.192 + 4.5
BY_RELAY_S = 16.384 + 8.192 + 4.5


def _ra_server(queue: str, verb: str) -> str:
    """An ``eval`` that runs ``sys:{verb}`` on quorum queue ``queue``'s Ra server."""
    return (
        f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>)), '
        f"{{Name, _}} = amqqueue:get_pid(Q), sys:{verb}(whereis(Name)), ok."
    )


async def schedule_both(
    scheduler: hopsched.Scheduler, target: str, what: str
) -> tuple[dict[str, datetime], list[float]]:
    """One message due ``BY_SCHEDULE_S`` ahead and one ``BY_RELAY_S``; their due times by
    id, and how long each call took, s."""
    due: dict[str, datetime] = {}
    took = []
    for how, ahead_s in (("by-schedule", BY_SCHEDULE_S), ("by-relay", BY_RELAY_S)):
        schedule_id = f"{what}-{how}-{uuid.uuid4().hex[:6]}"
        started = time.monotonic()
        due[schedule_id] = datetime.now(UTC) + timedelta(seconds=ahead_s)
        scheduled = await scheduler.schedule(
            b"x", at=due[schedule_id], routing_key=target, schedule_id=schedule_id
        )
        took.append(time.monotonic() - started)
        assert scheduled.schedule_id == schedule_id
    return due, took


async def test_a_silent_step_is_routed_around_by_schedule_and_by_the_relay(
    private_broker: PrivateBroker, relays: Relays, node_targets: Targets
) -> None:
    """First a round with every step healthy, so that the Scheduler's and the relay's
    channels have published into the step (RabbitMQ 4.0.5 holds a channel's *first*
    publish to a quorum queue in a synchronous call to its leader: a channel that meets a
    frozen leader first is held whole, and nothing on it is answered, docs/cluster.md);
    then the same with that step's queue suspended."""
    settings = node_settings(private_broker, f"silent{uuid.uuid4().hex[:8]}")
    relay = await relays.start(settings)
    target = await node_targets.queue()
    silent_queue = hopsched.Topology.from_settings(settings).step_queue(SILENT_STEP_MS)
    async with hopsched.Scheduler(settings) as scheduler:
        warm, _ = await schedule_both(scheduler, target.name, "warm")
        await target.wait_for_ids(warm, within=BY_RELAY_S + 10)
        assert relay.stats.hop_silences == 0
        print(f"warm: hops {relay.stats.hops}, lateness {target.lateness_line()}")
        await private_broker.rabbitmqctl("eval", _ra_server(silent_queue, "suspend"))
        suspended = True
        try:
            due, took = await schedule_both(scheduler, target.name, "silent")
            print(f"schedule() took {[f'{t:.1f}' for t in took]} s")
            await target.wait_for_ids(due, within=BY_RELAY_S + 2 * STEP_SILENCE_S + 10)
            print(f"silent: hops {relay.stats.hops}, lateness {target.lateness_line()}")
            assert relay.stats.hop_silences >= 1, relay.stats.snapshot()
            await private_broker.rabbitmqctl("eval", _ra_server(silent_queue, "resume"))
            suspended = False
            # What the queue kept comes out once its TTL is seen: within a step and a hop.
            await asyncio.sleep(SILENT_STEP_MS / 1000 + 5)
        finally:
            if suspended:
                await private_broker.rabbitmqctl("eval", _ra_server(silent_queue, "resume"))
    counts = target.counts()
    print(f"deliveries per id: {dict(counts)}; lateness {target.lateness_line()}")
    assert set(counts) == set(warm) | set(due)
    assert all(count <= 2 for count in counts.values()), counts
    assert all(r.lateness_us >= 0 for r in target.received), target.lateness_line()
