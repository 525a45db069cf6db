"""What RabbitMQ 4.x changes, checked on whichever broker the tests run against (CI runs
them on 3.10 and 4.0): the default delivery limit on quorum queues, the 16 MiB
``max_message_size``, and the consumer timeout the relay asks for (RabbitMQ 4.3)."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Callable

import aio_pika
import pytest
from support import (
    Relays,
    broker_version,
    rabbitmqctl,
    require_rabbitmqctl,
    wait_until_count,
)

import hopsched
from hopsched.broker import policy_watch
from hopsched.broker.objects import declare_topology
from hopsched.core.decide import WAIT_MAX_US
from hopsched.topology import PARKED_DELIVERY_LIMIT, RELAY_CONSUMER_ARGUMENTS, RELAY_DELIVERY_LIMIT

AMQP = aio_pika.abc.AbstractConnection
#: RabbitMQ 4.0's delivery limit for a quorum queue that sets none
#: (https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling).
DEFAULT_DELIVERY_LIMIT_4 = 20


async def effective_limits(vhost: str, names: list[str]) -> dict[str, tuple[str, str]]:
    """Each quorum queue's delivery limit and whether it dead-letters, as its Raft state
    machine applies them (``rabbit_fifo:overview/1``: the same on RabbitMQ 3.10 and 4.x;
    ``undefined`` for no limit)."""
    binaries = ", ".join(f"<<{json.dumps(name)}/utf8>>" for name in names)
    out = await rabbitmqctl(
        "eval",
        f"[begin {{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<{json.dumps(vhost)}/utf8>>,"
        " queue, N)), {ok, {_, O}, _} = ra:local_query(amqqueue:get_pid(Q),"
        " fun rabbit_fifo:overview/1), C = maps:get(config, O),"
        " {N, maps:get(delivery_limit, C, undefined), maps:get(dead_lettering_enabled, C)}"
        f" end || N <- [{binaries}]].",
    )
    found = re.findall(r'\{<<"([^"]+)">>,\s*(\w+),\s*(\w+)\}', out)
    return {name: (limit, dead_letters) for name, limit, dead_letters in found}


async def test_every_quorum_queue_has_a_delivery_limit_that_cannot_drop_a_message(
    settings: hopsched.Settings, amqp: AMQP
) -> None:
    """RabbitMQ 4.0 gives every quorum queue without ``x-delivery-limit`` a limit of 20:
    a message returned more often is dropped, unless the queue dead-letters it. On each
    queue of a prefix: the relay queue keeps its own 100 and dead-letters into the
    parking queue; the parking queue's 1,000,000 is never reached (each listing returns
    a message once); step queues, with 20 on 4.x and none on 3.10, dead-letter what
    passes it into the relay queue: a message over any limit goes on, never away."""
    require_rabbitmqctl()
    await declare_topology(settings)
    topology = hopsched.Topology.from_settings(settings)
    names = topology.queues_but_stream()

    limits = await effective_limits(settings.vhost, names)

    on_4 = broker_version(amqp) >= (4,)
    print(f"\nRabbitMQ {broker_version(amqp)}: (limit, dead-letters): {Counter(limits.values())}")
    assert set(limits) == set(names)
    assert limits.pop(topology.relay_queue) == (str(RELAY_DELIVERY_LIMIT), "true")
    assert limits.pop(topology.parked_queue) == (str(PARKED_DELIVERY_LIMIT), "false")
    step_limit = str(DEFAULT_DELIVERY_LIMIT_4) if on_4 else "undefined"
    assert set(limits.values()) == {(step_limit, "true")}


@pytest.mark.slow  # on 4.x the relay waits WAIT_MAX_US (30 s) before it hops it again
async def test_a_step_message_returned_past_the_delivery_limit_is_relayed_not_dropped(
    settings: hopsched.Settings, relays: Relays, amqp: AMQP, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone consumes a step queue (a shovel, a debugging session) and returns its
    message 25 times. RabbitMQ 4.x dead-letters it after 20 into the relay queue; the
    relay, seeing it came back 60 days early, waits ``WAIT_MAX_US`` (no hop storm) and
    sends it back to the top step (it is due in 60 days). Nothing is dropped, nothing
    parked; on 3.10 it simply stays in the step."""
    # Without the management API the relay returns a step's head every 2 s too, to keep
    # the queue in use (policy_watch): here it would take some of the 20.
    monkeypatch.setattr(policy_watch, "UNCHECKED_TOUCH_INTERVAL_S", 3600.0)
    relay = await relays.start(settings)
    topology = hopsched.Topology.from_settings(settings)
    top = topology.step_queue(settings.max_step_ms)
    async with hopsched.Scheduler(settings) as scheduler:
        scheduled = await scheduler.schedule(b"far", delay=60 * 86400, routing_key="nowhere")
    assert scheduled.first_queue == top
    async with amqp.channel() as channel:
        queue = await channel.get_queue(top, ensure=False)
        returns = 0
        while returns < 25 and (got := await queue.get(no_ack=False, fail=False)) is not None:
            assert got.headers["x-hopsched-id"] == scheduled.schedule_id
            await got.nack(requeue=True)
            returns += 1

    # the relay's wait for an early return, then a hop it has publish_timeout_s to confirm
    await wait_until_count(amqp, top, 1, within=WAIT_MAX_US / 1e6 + settings.publish_timeout_s)
    print(f"\n{returns} returns; relay stats: hops {relay.stats.hops}")
    await asyncio.sleep(1)  # a hop would show here, a drop as 0
    assert await wait_until_count(amqp, top, 1, within=5) == 1
    assert await wait_until_count(amqp, topology.parked_queue, 0, within=5) == 0
    if broker_version(amqp) >= (4,):
        assert returns == DEFAULT_DELIVERY_LIMIT_4 + 1  # the 21st get found it gone
        assert relay.stats.hops >= 1  # the dead-lettered copy went round the relay
        assert relay.stats.returned_early == 1


async def test_a_body_over_max_message_size_is_refused_before_anything_is_sent(
    make_settings: Callable[..., hopsched.Settings], relays: Relays, amqp: AMQP
) -> None:
    """RabbitMQ 4.x closes the channel on a body over its ``max_message_size`` (16 MiB by
    default). ``schedule()`` refuses it first, with the size, the limit and the fix; the
    Scheduler goes on with the next call."""
    settings = make_settings(max_message_size=1000)
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        with pytest.raises(hopsched.InvalidScheduleError, match="1001 bytes, over max_mes"):
            await scheduler.schedule(b"x" * 1001, delay=600, routing_key="nowhere")
        kept = await scheduler.schedule(b"x" * 1000, delay=600, routing_key="nowhere")
        with pytest.raises(hopsched.InvalidScheduleError, match="16777217 bytes"):
            async with hopsched.Scheduler(make_settings(), declare=True) as default:
                await default.schedule(b"x" * (16 * 2**20 + 1), delay=600, routing_key="n")
    await wait_until_count(amqp, kept.first_queue, 1, within=10)


async def test_the_default_max_message_size_is_never_above_the_brokers(amqp: AMQP) -> None:
    """``Settings.max_message_size`` is RabbitMQ 4.x's default: what the broker under test
    allows (4.x), or less (3.10: 128 MiB)."""
    require_rabbitmqctl()
    out = await rabbitmqctl("eval", "application:get_env(rabbit, max_message_size).")
    [broker_limit] = [int(n) for n in re.findall(r"\d+", out)]
    default = hopsched.Settings().max_message_size
    print(f"\nRabbitMQ {broker_version(amqp)}: max_message_size {broker_limit}")
    assert default <= broker_limit
    if broker_version(amqp) >= (4,):
        assert default == broker_limit


async def test_the_relay_asks_for_its_own_consumer_timeout(
    settings: hopsched.Settings, relays: Relays
) -> None:
    """From RabbitMQ 4.3 a ``consumer-timeout`` policy on quorum queues would take back
    what a relay holds for its due time; the relay's own consumer argument (30 min, the
    broker's default) takes precedence. Older brokers accept and ignore it."""
    require_rabbitmqctl()
    await relays.start(settings)
    relay_queue = hopsched.Topology.from_settings(settings).relay_queue

    out = await _list_consumers(settings.vhost)
    [consumer] = [row for row in json.loads(out) if row["queue_name"] == relay_queue]
    arguments = {name: value for name, _, value in consumer["arguments"]}
    assert arguments == RELAY_CONSUMER_ARGUMENTS


async def _list_consumers(vhost: str) -> str:
    """``rabbitmqctl list_consumers`` as JSON. It asks every queue of the vhost, and one
    that another test or user deletes meanwhile makes it exit 70 (``{shutdown, delete}``
    from the queue's process, seen in CI on the shared broker): asked again, up to five
    times."""
    args = ("list_consumers", "-q", "-p", vhost, "queue_name", "arguments", "--formatter", "json")
    for attempt in range(5):
        try:
            return await rabbitmqctl(*args)
        except pytest.fail.Exception as error:
            if attempt == 4 or "exited 70" not in str(error):
                raise
        await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("value", [0, -1, 512 * 2**20 + 1, True, 1.5, "16MiB"])
def test_a_max_message_size_the_broker_cannot_have_is_refused(value: object) -> None:
    with pytest.raises(hopsched.InvalidSettingsError, match="max_message_size"):
        hopsched.Settings(max_message_size=value)  # type: ignore[arg-type]


def test_max_message_size_comes_from_the_environment_for_the_cli() -> None:
    settings = hopsched.Settings.from_env({"HOPSCHED_MAX_MESSAGE_SIZE": "134217728"})
    assert settings.max_message_size == 134_217_728  # RabbitMQ 3.x's default
    assert hopsched.Settings().max_message_size == 16 * 2**20
