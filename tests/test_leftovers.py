"""The end-of-run check for what the tests leave on the broker (F38), on the real broker."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import uuid
from pathlib import Path

import aio_pika
import pytest
from leftovers import Thing, advice, remove, snapshot
from support import message_count, rabbitmqctl, require_rabbitmqctl

TESTS = Path(__file__).parent


@pytest.mark.slow  # about 30 rabbitmqctl calls, ~1 s of CPU each: 30 s on two cores
async def test_F38_the_leftover_check_finds_and_removes_what_a_test_left(
    broker_url: str,
) -> None:
    command = require_rabbitmqctl()
    tag = f"t{uuid.uuid4().hex[:10]}"
    before = await asyncio.to_thread(snapshot, command)
    connection = await aio_pika.connect(broker_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(f"{tag}.step.16", durable=True)
        await channel.declare_exchange(f"{tag}.expired", durable=True)
    finally:
        await connection.close()
    left_behind = {
        Thing("queue", f"{tag}.step.16", "/"),
        Thing("exchange", f"{tag}.expired", "/"),
        Thing("user", f"{tag}-user"),
        Thing("vhost", f"{tag} vhost é"),
        Thing("policy", f"{tag}-policy", "/"),
    }
    try:
        await asyncio.gather(  # independent: at once (each rabbitmqctl boots an Erlang VM)
            *(
                rabbitmqctl(*args)
                for args in (
                    ("add_user", f"{tag}-user", "pw"),
                    ("add_vhost", f"{tag} vhost é"),
                    ("set_policy", "-p", "/", f"{tag}-policy", f"^{tag}", '{"max-length": 5}'),
                )
            )
        )

        found = await asyncio.to_thread(snapshot, command) - before
        assert left_behind <= found, found
        assert f"  (hopsched teardown --force --prefix {tag})" in advice(found)
    finally:
        problems = await asyncio.to_thread(remove, command, left_behind)

    assert not problems
    assert not left_behind & await asyncio.to_thread(snapshot, command)


def test_advice_names_a_vhost_once_and_not_what_is_in_it() -> None:
    lines = advice(
        [Thing("vhost", "v"), Thing("exchange", "amq.direct", "v"), Thing("queue", "p.relay", "/")]
    )
    assert lines == [
        "  queue 'p.relay' in vhost '/'",
        "  vhost 'v'",
        "  (hopsched teardown --force --prefix p)",
    ]


@pytest.mark.parametrize(
    ("thing", "text"),
    [
        (Thing("user", "u"), "user 'u'"),
        (Thing("policy", "p", "/"), "policy 'p' in vhost '/'"),
    ],
)
def test_a_thing_says_what_and_where(thing: Thing, text: str) -> None:
    assert str(thing) == text


@pytest.mark.slow  # a pytest run of its own, and two snapshots of the broker
async def test_F38_a_run_stopped_by_sigterm_removes_what_it_left(
    broker_url: str, tmp_path: Path
) -> None:
    """Found by a new-user trial: a test run killed with SIGTERM (as a CI time-out does)
    left its prefix on the broker. conftest makes SIGTERM end a run as Ctrl-C does: the
    leftover check still runs and removes what the run made."""
    require_rabbitmqctl()
    queue = f"t{uuid.uuid4().hex[:10]}.step.16"
    (tmp_path / "test_stopped.py").write_text(
        textwrap.dedent(f"""
            import asyncio

            import aio_pika


            async def test_declares_then_waits(broker_url: str) -> None:
                connection = await aio_pika.connect(broker_url)
                channel = await connection.channel()
                await channel.declare_queue({queue!r}, durable=True)
                await asyncio.sleep(300)
            """)
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
        "-o", "asyncio_mode=auto", "--rootdir", str(tmp_path), str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    connection = await aio_pika.connect(broker_url)
    try:
        async with asyncio.timeout(60):
            while True:  # the broker signals no event for a declare: polling it is the only way
                try:
                    await message_count(connection, queue)
                    break
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    await asyncio.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(child.communicate(), 120)
        text = out.decode()

        assert child.returncode == pytest.ExitCode.INTERRUPTED, text
        assert "stopped by signal SIGTERM" in text
        assert f"queue {queue!r} in vhost '/'" in text  # named, then removed
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
            await message_count(connection, queue)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await connection.close()
        await asyncio.to_thread(remove, require_rabbitmqctl(), {Thing("queue", queue, "/")})
