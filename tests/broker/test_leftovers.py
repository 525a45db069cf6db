"""The end-of-run check for what the tests leave on the broker (F38), and for nothing
else (F40: the broker is shared), on the real broker."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import aio_pika
import pytest
from support import message_count, rabbitmqctl, require_rabbitmqctl, unique
from support.leftovers import Thing, advice, remove, snapshot
from support.private_nodes import PrivateBroker

TESTS = Path(__file__).parents[1]


def child_run(directory: Path, source: str) -> list[str]:
    """The command of a pytest run of its own over ``directory`` (``source`` written there
    as ``test_child.py``) with the tests' conftest. Give it a run marker of its own
    (``HOPSCHED_TEST_RUN``): its check would otherwise count, and remove, this run's
    objects made after its first snapshot."""
    (directory / "test_child.py").write_text(textwrap.dedent(source))
    return [
        sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
        "-o", "asyncio_mode=auto", "--rootdir", str(directory), str(directory),
    ]  # fmt: skip


async def run_a_broker_test(directory: Path, **env: str) -> tuple[int, str, bool]:
    """A child run (its own marker, ``env`` on top) of one test that uses the broker:
    (exit status, output, whether the test ran)."""
    ran = directory / "ran"
    command = child_run(
        directory,
        f"""
        from pathlib import Path


        def test_uses_the_broker(broker_url: str) -> None:
            Path({str(ran)!r}).touch()
        """,
    )
    status, text = await run_child(command, {"HOPSCHED_TEST_RUN": unique(), **env})
    return status, text, ran.exists()


async def run_child(
    command: list[str], env: dict[str, str], within: float = 120
) -> tuple[int, str]:
    child = await asyncio.create_subprocess_exec(
        *command,
        env={**os.environ, "PYTHONPATH": str(TESTS), **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(child.communicate(), within)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode is not None
    return child.returncode, out.decode()


@pytest.mark.slow  # about 30 rabbitmqctl calls, ~1 s of CPU each: 30 s on two cores
async def test_F38_the_leftover_check_finds_and_removes_what_a_test_left(
    broker_url: str,
) -> None:
    command = require_rabbitmqctl()
    tag = unique()
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
    marker = f"hx{unique()[-8:]}"  # the child's own run marker
    queue = f"{marker}{unique()[-8:]}.step.16"
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
        env={**os.environ, "PYTHONPATH": str(TESTS), "HOPSCHED_TEST_RUN": marker},
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


@pytest.mark.slow  # a pytest run of its own, and its two snapshots of the broker
async def test_F40_a_run_removes_its_own_leftovers_and_never_another_users_prefix(
    broker_url: str, tmp_path: Path
) -> None:
    """Found in the field: the check removed every object that appeared during the run,
    another user's prefix in the middle of its upgrade included (5,831 of 6,000 messages
    gone). A child run leaves a queue of its own and, while it runs, another process (this
    test) makes a prefix: the child removes its own, reports the other, and the other's
    queue keeps its message."""
    require_rabbitmqctl()
    marker = f"hx{unique()[-8:]}"  # the child's own run marker
    own = f"{marker}{unique()[-8:]}.step.16"
    foreign = f"other{unique()[-8:]}"  # another user's prefix: no marker of either run
    go_on = tmp_path / "go-on"
    command = child_run(
        tmp_path,
        f"""
        import asyncio
        from pathlib import Path

        import aio_pika


        async def test_declares_and_waits(broker_url: str) -> None:
            connection = await aio_pika.connect(broker_url)
            async with connection:
                channel = await connection.channel()
                await channel.declare_queue({own!r}, durable=True)
            while not Path({str(go_on)!r}).exists():
                await asyncio.sleep(0.1)
        """,
    )
    child = asyncio.create_task(run_child(command, {"HOPSCHED_TEST_RUN": marker}))
    connection = await aio_pika.connect(broker_url)
    try:
        async with asyncio.timeout(60):
            while True:  # the broker signals no event for a declare: polling it is the only way
                try:
                    await message_count(connection, own)
                    break
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    await asyncio.sleep(0.2)
        channel = await connection.channel()
        queue = await channel.declare_queue(f"{foreign}.relay", durable=True)
        exchange = await channel.declare_exchange(f"{foreign}.expired", durable=True)
        await channel.default_exchange.publish(aio_pika.Message(b"theirs"), queue.name)
        go_on.touch()
        status, text = await child

        assert status == pytest.ExitCode.TESTS_FAILED, text  # it left its own queue
        assert f"FAILED: this run ({marker}) left these on the broker:" in text
        assert f"queue {own!r} in vhost '/'" in text
        assert "reported only, never removed" in text
        assert f"'{foreign}.relay'" in text
        assert f"'{foreign}.expired'" in text
        assert await message_count(connection, queue.name) == 1
        await channel.declare_exchange(exchange.name, durable=True, passive=True)
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
            await message_count(connection, own)
    finally:
        go_on.touch()
        channel = await connection.channel()
        await channel.queue_delete(f"{foreign}.relay")
        await channel.exchange_delete(f"{foreign}.expired")
        await connection.close()
        await asyncio.to_thread(remove, require_rabbitmqctl(), {Thing("queue", own, "/")})


@pytest.mark.slow  # a private node (about 10 s) and a pytest run of its own
async def test_F40_the_tests_refuse_to_start_when_rabbitmqctl_reaches_another_broker(
    private_broker: PrivateBroker, tmp_path: Path
) -> None:
    """Found in the field: with the test URL on a private node and the rabbitmqctl
    variable unset, the check listed and cleaned the machine's broker. Any subset of
    tests that uses a broker refuses to start, saying why and what to set; no test runs."""
    require_rabbitmqctl()  # reaches the test broker, not the private node
    status, text, ran = await run_a_broker_test(tmp_path, HOPSCHED_TEST_URL=private_broker.url)

    assert status == pytest.ExitCode.USAGE_ERROR, text
    assert "refusing to run the tests: rabbitmqctl" in text
    assert "reaches another broker than the test URL" in text
    assert "HOPSCHED_TEST_RABBITMQCTL" in text
    assert not ran


async def test_F40_the_tests_refuse_to_start_when_rabbitmqctl_fails(tmp_path: Path) -> None:
    """A rabbitmqctl that cannot list the broker (here: one that always fails) stops the
    run before any test, naming the variable to set."""
    status, text, ran = await run_a_broker_test(tmp_path, HOPSCHED_TEST_RABBITMQCTL="false")

    assert status == pytest.ExitCode.USAGE_ERROR, text
    assert "refusing to run the tests: rabbitmqctl (false) failed" in text
    assert not ran
