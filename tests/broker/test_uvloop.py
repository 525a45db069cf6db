"""hopsched on uvloop (``hopsched[fast]``): its AMQP client, a Scheduler and a Relay.

uvloop's transports do what ``asyncio.Transport`` does without subclassing it; the
client once asserted the class and so never sent its protocol header under uvloop (a
connect then timed out against a broker that answers the default loop at once), and
uvloop may deliver the broker's first method before the connecting coroutine waits for
it. Here the whole path runs on uvloop's loop: connect, schedule, hop, hold and
deliver, and the ``hopsched relay`` command.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
from datetime import UTC, datetime, timedelta

import aio_pika
from support import Cleanup, Relays, Targets, missing

import hopsched
from hopsched import amqp


def _uvloop():  # type: ignore[no-untyped-def]
    try:
        return importlib.import_module("uvloop")
    except ImportError:
        missing("uvloop is not installed (pip install -e '.[dev]' brings it)")


def test_the_client_connects_on_uvloop(broker_url: str) -> None:
    """50 connections in a row, each with a channel. uvloop may read the broker's
    ``connection.start`` before the coroutine that connected waits for it; the client
    once took it for an unexpected method and dropped the connection ("the peer closed
    the connection before the AMQP handshake"), 8 times in 200 here."""
    uvloop = _uvloop()

    async def connect() -> tuple[str, list[int]]:
        numbers = []
        for _ in range(50):
            connection = await amqp.connect(
                amqp.ConnectionParams.from_url(broker_url), name="test-uvloop", timeout_s=10
            )
            try:
                numbers.append((await connection.channel()).number)
            finally:
                await connection.close()
        return type(asyncio.get_running_loop()).__module__, numbers

    loop_module, numbers = uvloop.run(connect())
    assert loop_module.startswith("uvloop")
    assert len(numbers) == 50
    assert min(numbers) >= 1


def test_a_relay_and_a_scheduler_deliver_on_uvloop(
    settings: hopsched.Settings, cleanup: Cleanup
) -> None:
    """40 messages due 0.2 to 3 s ahead (hops and holds), scheduled and relayed on uvloop:
    each delivered once, none early, body intact."""
    uvloop = _uvloop()

    async def scenario() -> tuple[dict[str, bytes], dict[str, int], list[int]]:
        connection = await aio_pika.connect(settings.url)
        relays = Relays()
        try:
            target = await Targets(connection, cleanup).queue()
            await relays.start(settings)
            now = datetime.now(UTC)
            bodies: dict[str, bytes] = {}
            async with hopsched.Scheduler(settings) as scheduler:
                for index in range(40):
                    body = b"uvloop %d" % index
                    scheduled = await scheduler.schedule(
                        body,
                        at=now + timedelta(seconds=0.2 + index * 0.07),
                        routing_key=target.name,
                    )
                    bodies[scheduled.schedule_id] = body
            await target.wait_for_ids(bodies, within=60)
            await asyncio.sleep(0.5)  # a second copy would come meanwhile
            got = {r.schedule_id: r.body for r in target.received}
            return got, dict(target.counts()), [r.lateness_us for r in target.received]
        finally:
            await relays.stop_all()
            await connection.close()

    got, counts, lateness = uvloop.run(scenario())
    assert set(counts) == set(got)
    assert all(count == 1 for count in counts.values()), counts
    assert len(got) == 40
    assert min(lateness) >= 0, f"early by {-min(lateness)} µs"


async def test_the_relay_command_runs_on_uvloop_and_says_so(settings: hopsched.Settings) -> None:
    """With uvloop installed, ``hopsched relay`` runs on it and its start line names it;
    a SIGTERM stops it cleanly (exit 0)."""
    uvloop = _uvloop()
    env = dict(os.environ) | {"HOPSCHED_URL": settings.url, "HOPSCHED_PREFIX": settings.prefix}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hopsched", "relay", env=env, stderr=asyncio.subprocess.PIPE
    )
    assert process.stderr is not None
    try:
        line = b""
        while b"relay consuming" not in line:
            line = await asyncio.wait_for(process.stderr.readline(), 30)
            assert line, "the relay exited before consuming"
    finally:
        process.send_signal(signal.SIGTERM)
        status = await asyncio.wait_for(process.wait(), 30)
    assert f"uvloop {uvloop.__version__}".encode() in line, line
    assert status == 0
