"""``hopsched teardown`` under a running relay (F31, the teardown side): it counts what
it deletes, including what the relay held, or says it cannot; it never prints a count
it does not know.

The relay runs as its own process (``hopsched relay``) and is killed at the end: what a
relay does once its prefix is torn down is tested with the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import urllib.request
from base64 import b64encode
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
from support import Cleanup, Targets, hopsched_cli, settings_env
from support.private_nodes import require_rabbitmq

import hopsched
from hopsched.testing.localbroker import free_port, private_cluster


@contextlib.asynccontextmanager
async def relay_process(settings: hopsched.Settings, **variables: str) -> AsyncIterator[None]:
    """``hopsched relay`` as a subprocess, consuming once entered; SIGKILLed on exit."""
    env = dict(os.environ) | settings_env(settings) | variables
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hopsched", "relay"),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        connection = await aio_pika.connect(str(settings.url))
        async with connection, asyncio.timeout(30):
            relay_queue = hopsched.Topology.from_settings(settings).relay_queue
            while True:  # the broker signals no event for a consumer: poll
                channel = await connection.channel()
                with contextlib.suppress(aio_pika.exceptions.ChannelNotFoundEntity):
                    queue = await channel.declare_queue(relay_queue, passive=True)
                    if queue.declaration_result.consumer_count:
                        break
                await asyncio.sleep(0.1)
        yield
    finally:
        if process.returncode is None:  # it exits by itself (4) once torn down
            process.kill()
        await process.wait()


def unacknowledged(management_url: str, queue: str) -> Any:
    request = urllib.request.Request(f"{management_url}api/queues/%2F/{queue}")
    request.add_header("Authorization", "Basic " + b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response).get("messages_unacknowledged")


@pytest.mark.slow
async def test_F31_teardown_under_a_running_relay_counts_what_the_relay_held() -> None:
    """A relay holds 20 messages (due in 25 s, within its 30 s hold window) and 20 more
    wait in a step: ``teardown --force`` names both counts (main printed neither the 20
    held, which ``queue.delete-ok`` does not count)."""
    async with private_cluster(1, management=True, installation=require_rabbitmq()) as cluster:
        node = cluster.nodes[0]
        assert node.management_url is not None
        settings = hopsched.Settings(url=node.url, prefix="f31", hold_window_ms=30_000)
        amqp = await aio_pika.connect(node.url)
        cleanup = Cleanup(node.url)
        cleanup.topology(settings)
        targets = Targets(amqp, cleanup)
        target = await targets.queue(consume=False)
        async with relay_process(settings, HOPSCHED_HOLD_WINDOW_MS="30000"):
            async with hopsched.Scheduler(settings) as scheduler:
                for delay in [25] * 20 + [600] * 20:
                    await scheduler.schedule(b"x", delay=delay, routing_key=target.name)
            relay_queue = hopsched.Topology.from_settings(settings).relay_queue
            # the API's figures are up to 5 s old, and it signals no change: poll
            async with asyncio.timeout(30):
                while (  # noqa: ASYNC110
                    await asyncio.to_thread(unacknowledged, node.management_url, relay_queue) != 20
                ):
                    await asyncio.sleep(0.5)

            status, out, err = await hopsched_cli(
                "teardown", "--force", "--management-url", node.management_url, settings=settings
            )

        print(out)
        assert status == 0, (out, err)
        assert f"{relay_queue} had 1 consumer(s)" in out
        assert "holding 20 unacknowledged message(s)" in out
        assert "(20 ready message(s) deleted with it)" in out  # the step's
        assert out.splitlines()[-1].endswith("20 ready message(s) deleted, 20 held by consumers")
        assert not await cleanup.run()
        await amqp.close()


async def test_teardown_says_the_held_count_is_unknown_without_the_management_api(
    settings: hopsched.Settings,
) -> None:
    async with relay_process(settings):
        status, out, err = await hopsched_cli(
            "teardown",
            "--force",
            "--management-url",
            f"http://127.0.0.1:{free_port()}/",  # nothing answers there
            settings=settings,
        )

    assert status == 0, (out, err)
    relay_queue = hopsched.Topology.from_settings(settings).relay_queue
    assert f"{relay_queue} had 1 consumer(s) (a running relay?) holding an unknown number" in out
    assert "the management API answers nowhere" in out
    assert out.splitlines()[-1].endswith("an unknown number held by consumers")
