"""The examples in ``examples/`` run as a user runs them, against the real broker."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aio_pika
import aiormq
import pytest
from support import Cleanup, unique

import hopsched

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def test_the_order_timeout_example_delivers_its_message_and_leaves_nothing(
    broker_url: str, cleanup: Cleanup, amqp: aio_pika.abc.AbstractConnection
) -> None:
    prefix = unique()  # the run's marker: another run's or a user's example is never touched
    cleanup.topology(hopsched.Settings(url=broker_url, prefix=prefix))
    cleanup.queues.add(f"{prefix}-order-timeouts")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / "order_timeout.py"),
        env={**os.environ, "HOPSCHED_URL": broker_url, "HOPSCHED_PREFIX": prefix},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)

    assert process.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0].startswith("scheduled ")
    assert lines[1].startswith("received b'{\"order\": 42}'")
    assert lines[0].split()[1] in lines[1]  # the same schedule id
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):  # its ladder is gone
        await (await amqp.channel()).declare_queue(f"{prefix}.relay", passive=True)
