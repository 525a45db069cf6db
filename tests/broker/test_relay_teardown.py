"""A relay and the teardown of its prefix (F31, the relay side), and refusals that do
not go away (F34), on the real broker.

* A relay whose prefix is torn down (``hopsched teardown --force``) says so in one ERROR
  line and exits with status 4 within its shutdown timeout, declaring nothing again;
  what it held and was due within that timeout is delivered.
* A cancel stream deleted and declared anew while a relay was away is read from its
  start, whether it is shorter or longer than the one the relay had read.
* ``stop()`` returns within the shutdown timeout in every state: consuming, holding,
  starting under a memory alarm, reconnecting to a node that is down.
* A relay whose user may not read its own cancel stream or relay queue exits at once
  (exit status 1) naming the permission and the ``rabbitmqctl set_permissions`` fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from urllib.parse import quote

import aio_pika
import pytest
from support import Relays, Targets, hopsched_cli, settings_env
from support.private_nodes import PrivateBroker

import hopsched
from hopsched import amqp
from hopsched.amqp.publisher import Publisher
from hopsched.broker.objects import declare
from hopsched.broker.parked import list_parked
from hopsched.connect import Connector
from hopsched.core.cancel import CANCEL, Cancellations, Record, RecordTally, encode_records
from hopsched.core.clock import now_us
from hopsched.journal.cancels import CancelReader
from hopsched.testing.localbroker import free_port

AMQP = aio_pika.abc.AbstractConnection
#: What ``stop()`` may take beyond the shutdown timeout: closing the connection, the
#: event loop's turns. A bound, not a goal: main took 44-52 s with a 10 s timeout.
STOP_SLACK_S = 2.0


async def exists(connection: AMQP, queue: str) -> bool:
    channel = await connection.channel()
    try:
        await channel.declare_queue(queue, passive=True)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return False
    await channel.close()
    return True


async def exchange_exists(connection: AMQP, exchange: str) -> bool:
    channel = await connection.channel()
    try:
        await channel.declare_exchange(exchange, passive=True)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return False
    await channel.close()
    return True


async def wait_for_consumer(connection: AMQP, queue: str, within: float = 30) -> None:
    async with asyncio.timeout(within):
        while True:  # the broker signals no event for a consumer: poll
            channel = await connection.channel()
            with contextlib.suppress(aio_pika.exceptions.ChannelNotFoundEntity):
                declared = await channel.declare_queue(queue, passive=True)
                if declared.declaration_result.consumer_count:
                    await channel.close()
                    return
            await asyncio.sleep(0.1)


# F31: the relay under a teardown -------------------------------------------------------


async def test_F31_a_relay_whose_prefix_is_torn_down_says_so_and_exits_4(
    settings: hopsched.Settings, amqp: AMQP, targets: Targets
) -> None:
    """F31's input: 20 messages held, due at +2.5 s; 20 more due at +30 s; ``teardown
    --force`` at +0.5 s. On main the relay declared all 32 queues again, consumed nothing
    for 60 s (it resumed the new stream at the old one's offset), SIGTERM took 52 s.
    Now it says so in one line, exits 4 within its shutdown timeout (10 s), delivers
    the 20 due within it, and declares nothing again."""
    target = await targets.queue()
    env = dict(os.environ) | settings_env(settings)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hopsched", "relay"),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        topology = hopsched.Topology.from_settings(settings)
        await wait_for_consumer(amqp, topology.relay_queue)
        async with hopsched.Scheduler(settings) as scheduler:
            soon = {
                (await scheduler.schedule(b"soon", delay=2.5, routing_key=target.name)).schedule_id
                for _ in range(20)
            }
            for _ in range(20):
                await scheduler.schedule(b"later", delay=30, routing_key=target.name)
        await asyncio.sleep(0.5)
        status, out, err = await hopsched_cli(
            "teardown",
            "--force",
            "--management-url",
            f"http://127.0.0.1:{free_port()}/",  # not needed here: answer at once
            settings=settings,
        )
        assert status == 0, (out, err)
        torn_down = time.monotonic()
        async with asyncio.timeout(10 + STOP_SLACK_S + 5):
            assert process.stderr is not None
            log = (await process.stderr.read()).decode()
            exit_status = await process.wait()
        exited_after = time.monotonic() - torn_down
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

    lines = [line for line in log.splitlines() if "was deleted under this relay" in line]
    print(f"\nF31: exit {exit_status} {exited_after:.2f} s after the teardown: {lines}")
    assert exit_status == 4, log
    assert len([line for line in lines if " ERROR " in line]) == 1, log  # when it noticed
    assert lines[-1].startswith("Error: "), log  # and the exit's one line
    assert exited_after < 10 + STOP_SLACK_S
    delivered = await target.wait_for(20, within=10)
    assert {r.schedule_id for r in delivered} == soon
    target.assert_never_early()
    # it declared nothing again: every object of the prefix is gone
    for queue in topology.all_queues():
        assert not await exists(amqp, queue), queue
    assert not await exchange_exists(amqp, topology.expired_exchange)


async def follow_once(
    reader: CancelReader, settings: hopsched.Settings
) -> tuple[asyncio.Future[None], amqp.Connection]:
    connection = await Connector(settings, name="hopsched-test").connect()
    publisher = Publisher(connection)
    lost = await reader.follow(connection, publisher, lambda _: None)
    return lost, connection


async def append(connection: AMQP, stream: str, records: list[Record]) -> None:
    async with connection.channel(publisher_confirms=True) as channel:
        message = aio_pika.Message(encode_records(records), delivery_mode=2)
        await channel.default_exchange.publish(message, routing_key=stream)


async def declare_stream(connection: AMQP, settings: hopsched.Settings) -> str:
    topology = hopsched.Topology.from_settings(settings)
    await declare(topology, connection, [topology.cancel_stream])
    return topology.cancel_stream


@pytest.mark.parametrize("old_records", [30, 1], ids=["shorter", "longer"])
async def test_F31_a_cancel_stream_declared_anew_is_read_from_its_start(
    settings: hopsched.Settings, amqp: AMQP, old_records: int
) -> None:
    """A relay away while its stream is deleted and declared again resumed the new stream
    at the old one's offset: with a shorter new stream it read nothing for 60 s, with a
    longer one it skipped its first records (a cancel among them: a message delivered
    although cancelled). Now the new stream is read from its start in both cases."""
    stream = await declare_stream(amqp, settings)
    cancellations = Cancellations(10**12)
    tally = RecordTally(checked=False)
    reader = CancelReader(stream, cancellations, now_us, settings.signatures, tally)
    await append(amqp, stream, [Record(CANCEL, f"old-{i}", now_us()) for i in range(old_records)])
    _, connection = await follow_once(reader, settings)
    await connection.close()
    assert len(cancellations) == old_records

    async with amqp.channel() as channel:
        await channel.queue_delete(stream)
    await declare_stream(amqp, settings)
    fresh = [Record(CANCEL, f"new-{i}", now_us()) for i in range(5)]
    for record in fresh:  # one stream message each: a longer stream than the old one
        await append(amqp, stream, [record])

    started = time.monotonic()
    _, connection = await follow_once(reader, settings)
    caught_up_after = time.monotonic() - started
    await connection.close()
    print(f"\nF31: the new stream read in {caught_up_after:.2f} s")
    for record in fresh:
        verdict = cancellations.verdict(record.schedule_id, record.at_us - 1, now_us(), None)
        assert verdict == CANCEL, record.schedule_id


async def test_a_cancel_stream_resumed_is_not_read_again(
    settings: hopsched.Settings, amqp: AMQP
) -> None:
    """The same stream on a new connection resumes where the last one stopped: the
    records read before are not read (counted) again."""
    stream = await declare_stream(amqp, settings)
    tally = RecordTally(checked=False)
    reader = CancelReader(stream, None, now_us, settings.signatures, tally)
    await append(amqp, stream, [Record(CANCEL, f"a-{i}", now_us()) for i in range(3)])
    _, connection = await follow_once(reader, settings)
    await connection.close()
    await append(amqp, stream, [Record(CANCEL, "b", now_us())])
    _, connection = await follow_once(reader, settings)
    await connection.close()
    assert tally.unsigned == 4


# F31: stop() within the shutdown timeout in every state --------------------------------


async def timed_stop(relay: hopsched.Relay, task: asyncio.Task[None]) -> float:
    started = time.monotonic()
    await relay.stop()
    async with asyncio.timeout(60):
        with contextlib.suppress(hopsched.HopschedError):
            await asyncio.shield(task)
    return time.monotonic() - started


@pytest.mark.slow
async def test_F31_stop_returns_within_the_shutdown_timeout_in_every_state(
    private_broker: PrivateBroker, prefix: str
) -> None:
    """``stop()`` with a 3 s shutdown timeout, in each state a relay can be in. On main
    a relay reading its cancel stream (here: blocked by a memory alarm) took up to 60 s."""
    timeout_s = 3.0
    settings = hopsched.Settings(url=private_broker.url, prefix=prefix, hold_window_ms=30_000)
    connection = await aio_pika.connect(private_broker.url)
    target = (await (await connection.channel()).declare_queue(f"{prefix}-target")).name
    times: dict[str, float] = {}

    async def start(wait: bool = True) -> tuple[hopsched.Relay, asyncio.Task[None]]:
        relay = hopsched.Relay(settings, shutdown_timeout_s=timeout_s)
        task = asyncio.create_task(relay.run())
        if wait:
            await relay.wait_consuming()
        return relay, task

    relay, task = await start()
    times["consuming, idle"] = await timed_stop(relay, task)

    relay, task = await start()
    async with hopsched.Scheduler(settings) as scheduler:
        for _ in range(10):
            await scheduler.schedule(b"held", delay=20, routing_key=target)
    async with asyncio.timeout(30):
        while relay.stats.held_now() < 10:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    times["holding 10 due after the timeout"] = await timed_stop(relay, task)

    await private_broker.rabbitmqctl("set_vm_memory_high_watermark", "absolute", "1")
    try:
        relay, task = await start(wait=False)
        await asyncio.sleep(3)  # connected, declared; its marker record blocked
        assert relay.node is None  # not consuming
        times["starting, blocked by a memory alarm"] = await timed_stop(relay, task)
    finally:
        await private_broker.rabbitmqctl("set_vm_memory_high_watermark", "0.4")

    relay, task = await start()
    await connection.close()
    await private_broker.kill()
    await asyncio.sleep(2)  # trying to connect again
    times["reconnecting to a node that is down"] = await timed_stop(relay, task)

    print("\nF31: stop() with a 3 s shutdown timeout: " + "; ".join(
        f"{state} {took:.2f} s" for state, took in times.items()
    ))  # fmt: skip
    for state, took in times.items():
        assert took < timeout_s + STOP_SLACK_S, state


# F34: refusals that do not go away -------------------------------------------------------


async def relay_user(node: PrivateBroker, prefix: str, without: str) -> hopsched.Settings:
    """A user with the relay's grant but read on ``without`` (a queue of the prefix)."""
    status, command, err = await hopsched_cli(
        "permissions", "--prefix", prefix, "--role", "relay", "--user", "app-relay"
    )
    assert status == 0, err
    granted = shlex.split(command)
    read = granted[-1]
    assert "|cancelled|" in read, read
    granted[-1] = read.replace(f"|{without}", "")
    assert granted[-1] != read
    await node.rabbitmqctl("add_user", "app-relay", "pw")
    await node.rabbitmqctl(*granted[1:])
    url = f"amqp://app-relay:{quote('pw')}@127.0.0.1:{node.port}/"
    return hopsched.Settings(url=url, prefix=prefix)


@pytest.mark.slow
@pytest.mark.parametrize("without", ["cancelled"])
async def test_F34_a_relay_that_may_not_read_its_own_queue_exits_naming_the_grant(
    private_broker: PrivateBroker, prefix: str, without: str
) -> None:
    """A relay whose user may not read ``{prefix}.cancelled`` retried the 403 for ever.
    Now ``run()`` raises AccessRefusedError at once, naming the permission and the
    ``rabbitmqctl set_permissions`` command; ``hopsched relay`` exits 1 with that line."""
    settings = await relay_user(private_broker, prefix, without)
    relay = hopsched.Relay(settings)
    async with asyncio.timeout(30):  # on main: never
        with pytest.raises(hopsched.AccessRefusedError) as caught:
            await relay.run()
    text = str(caught.value)
    print(f"\nF34b: {text}")
    assert f"read permission on {prefix}.{without}" in text
    assert "rabbitmqctl set_permissions -p / app-relay" in text
    assert "pw" not in text.replace("permission", "")

    status, out, err = await hopsched_cli("relay", settings=settings, within=30)
    assert status == 1, (out, err)
    assert f"read permission on {prefix}.{without}" in err
    assert "Traceback" not in err


@pytest.mark.slow
async def test_F34_a_message_the_broker_refuses_for_its_size_is_parked_with_that_reason(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]], prefix: str, relays: Relays
) -> None:
    """A 20 MiB message waits on the ladder when the broker's ``max_message_size`` drops
    to 16 MiB (RabbitMQ 4.0's default; here a restart with the lower setting): the broker
    refuses the relay's delivery and its parked copy, so the relay hands it back and the
    relay queue dead-letters it into parking as it is. ``parked list`` gave the
    dead-lettering's reason; now it gives the broker's refusal, which the relay wrote to
    the cancel stream."""
    node = await start_private_broker("max_message_size = 33554432")
    settings = hopsched.Settings(url=node.url, prefix=prefix, max_message_size=2**25)
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        scheduled = await scheduler.schedule(b"x" * 20 * 2**20, delay=2, routing_key="anywhere")
    await node.stop()
    config = node.root / "rabbitmq.conf"
    config.write_text(config.read_text().replace("33554432", "16777216"))
    await node.start()
    relay = await relays.start(settings)
    async with asyncio.timeout(30):
        while relay.stats.rejected < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    await asyncio.sleep(1)  # the parked copy dead-lettered, the notice written

    (parked,) = (await list_parked(settings)).messages
    print(f"\nF34a: {parked.reason}")
    assert parked.schedule_id == scheduled.schedule_id
    assert parked.body_bytes == 20 * 2**20
    assert "message size 20971520 is larger than configured max size 16777216" in parked.reason
    assert "expired" not in parked.reason
