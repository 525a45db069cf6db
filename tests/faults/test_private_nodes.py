"""The private-node fixture itself: its own port and config, a crash, a restart on the data."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aio_pika
import pytest
from support import message_count
from support.private_nodes import (
    PROBE_PLUGIN,
    PROBE_PLUGIN_VERSION,
    PrivateBroker,
    require_rabbitmq,
    write_probe_plugin,
)

from hopsched.testing.localbroker import LocalBrokerError, private_cluster, private_node

#: The fault tests' machinery: in the slow tier with them (the demo's tests start a node too).
pytestmark = pytest.mark.slow


async def test_a_private_node_survives_kill_9_with_its_durable_messages(
    private_broker: PrivateBroker,
) -> None:
    assert private_broker.port != 5672
    connection = await aio_pika.connect(private_broker.url)
    channel = await connection.channel()  # publisher confirms: the message is on disk
    await channel.declare_queue("kept", durable=True)
    await channel.default_exchange.publish(
        aio_pika.Message(b"x", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "kept"
    )
    # The confirm puts the message on disk, but Mnesia (RabbitMQ 3.x, and 4.x without
    # Khepri) writes queue definitions lazily: a kill -9 right after the declaration
    # lost the queue itself once in CI. Write it now, as time would.
    await private_broker.sync_metadata()
    pid = private_broker.pid
    assert pid is not None

    await private_broker.kill()
    with contextlib.suppress(Exception):
        await connection.close()  # its broker is gone; left open, it outlives the test
    with pytest.raises(aio_pika.exceptions.AMQPConnectionError):  # down, no reply
        await aio_pika.connect(private_broker.url)
    await private_broker.start()

    assert private_broker.pid != pid
    assert (private_broker.starts, private_broker.kills) == (2, 1)
    connection = await aio_pika.connect(private_broker.url)
    assert await message_count(connection, "kept") == 1
    await connection.close()
    assert "kept" in await private_broker.rabbitmqctl("list_queues", "-q", "name")


async def test_extra_config_reaches_the_node(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]],
) -> None:
    node = await start_private_broker(config="consumer_timeout = 61000")

    setting = await node.rabbitmqctl("eval", "application:get_env(rabbit, consumer_timeout).")
    assert setting.strip() == "{ok,61000}"
    listeners = await node.rabbitmqctl("eval", "rabbit_networking:active_listeners().")
    assert f"port = {node.port}" in listeners or str(node.port) in listeners
    assert "5672," not in listeners


async def test_the_node_runs_the_chosen_installation_in_its_own_directory(
    private_broker: PrivateBroker,
) -> None:
    """``HOPSCHED_RABBITMQ_ROOT`` picks the installation (a chroot's RabbitMQ 4.0.5, say);
    the node's data lives in its directory, as the node's processes see it."""
    status = json.loads(await private_broker.rabbitmqctl("status", "--formatter", "json"))

    installation = private_broker.installation
    assert status["rabbitmq_version"] == installation.version
    data = installation.host_path(Path(status["data_directory"]))
    assert data.is_relative_to(private_broker.root)
    print(f"\nnode {private_broker.node}: RabbitMQ {installation.version} ({installation})")


async def test_a_plugin_in_an_extra_plugins_directory_is_enabled(tmp_path: Path) -> None:
    """``plugins_dirs`` (``RABBITMQ_PLUGINS_DIR``) comes after the installation's own
    directory: the plugin found there runs, and the dependency it names is found in the
    installation's (its ``x-random`` exchange type works). With a chroot, ``tmp_path``
    (outside it) is copied into the node's directory. A directory may be a str."""
    write_probe_plugin(tmp_path)

    async with private_node(
        plugins=[PROBE_PLUGIN], plugins_dirs=[str(tmp_path)], installation=require_rabbitmq()
    ) as node:
        plugins = await node.active_plugins()
        connection = await aio_pika.connect(node.url)
        async with connection:
            channel = await connection.channel()
            await channel.declare_exchange("probe-random", "x-random", auto_delete=True)

    assert plugins[PROBE_PLUGIN] == PROBE_PLUGIN_VERSION
    assert plugins["rabbitmq_random_exchange"] == node.installation.version


async def test_a_missing_plugins_directory_is_refused_before_a_node_starts(
    tmp_path: Path,
) -> None:
    missing_dir = tmp_path / "no-such-directory"

    with pytest.raises(LocalBrokerError, match="no-such-directory does not exist"):
        async with private_node(plugins_dirs=[missing_dir], installation=require_rabbitmq()):
            pass


@pytest.mark.parametrize("argument", ["plugins", "plugins_dirs"])
async def test_a_lone_string_for_a_sequence_is_refused_before_a_node_starts(
    argument: str, tmp_path: Path
) -> None:
    """``plugins="rabbitmq_x"`` would be read letter by letter: it is refused, naming
    the fix."""
    with pytest.raises(LocalBrokerError, match=rf"{argument}='{tmp_path}': give a sequence"):
        async with private_node(installation=require_rabbitmq(), **{argument: str(tmp_path)}):
            pass


def is_gone(node: PrivateBroker) -> bool:
    """Whether the node has no process left and its directory is removed."""
    return not node.is_running and not node.root.exists()


async def test_a_node_and_its_directory_are_gone_after_a_failing_body() -> None:
    installation = require_rabbitmq()
    seen: list[PrivateBroker] = []

    async def failing_test() -> None:
        async with private_node(installation=installation) as node:
            seen.append(node)
            raise RuntimeError("the test failed")

    with pytest.raises(RuntimeError, match="the test failed"):
        await failing_test()

    [node] = seen
    assert node.pid is not None
    assert is_gone(node)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
async def test_a_node_is_killed_and_removed_when_its_python_process_is_killed(
    signum: signal.Signals,
) -> None:
    """No ``finally`` runs in a process killed by SIGTERM (unhandled) or SIGKILL, as a CI
    job's timeout kills it: the node's watch kills the node and removes its directory
    within seconds (once, a killed script left a node of 1 GB running)."""
    require_rabbitmq()
    code = (
        "import asyncio\n"
        "from hopsched.testing.localbroker import private_node\n"
        "async def main():\n"
        "    async with private_node() as node:\n"
        "        print(node.pid, node.root, flush=True)\n"
        "        await asyncio.sleep(3600)\n"
        "asyncio.run(main())\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 180)
        pid, root = line.decode().split()
        assert exists(int(pid), root)
    finally:
        process.send_signal(signum)
        await process.wait()

    async with asyncio.timeout(15):  # the watch looks once a second
        while exists(int(pid), root):  # noqa: ASYNC110 (nothing signals it)
            await asyncio.sleep(0.2)


def exists(pid: int, root: str) -> bool:
    """Whether process ``pid`` or directory ``root`` is still there."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return os.path.exists(root)
    return True


async def test_a_frozen_node_answers_again_after_sigcont(private_broker: PrivateBroker) -> None:
    assert private_broker.pid is not None
    os.kill(private_broker.pid, signal.SIGSTOP)
    try:
        with pytest.raises((TimeoutError, aio_pika.exceptions.AMQPConnectionError)):
            await asyncio.wait_for(aio_pika.connect(private_broker.url), 3)
    finally:
        os.kill(private_broker.pid, signal.SIGCONT)
    connection = await asyncio.wait_for(aio_pika.connect(private_broker.url), 30)
    await connection.close()


async def test_a_cluster_forms_and_from_4_0_moves_to_khepri() -> None:
    """Two nodes with one cookie join (``join_cluster``); on RabbitMQ >= 4.0 the cluster
    then enables ``khepri_db``, and both nodes keep their metadata there."""
    installation = require_rabbitmq()
    on_4 = int(installation.version.split(".")[0]) >= 4
    async with private_cluster(2, khepri=on_4, installation=installation) as cluster:
        first, second = cluster.nodes
        status = json.loads(await second.rabbitmqctl("cluster_status", "--formatter", "json"))
        assert sorted(status["running_nodes"]) == sorted([first.node, second.node])
        stores = {await node.metadata_store() for node in cluster.nodes}
        assert stores == ({"khepri"} if on_4 else {"mnesia"})
        connection = await aio_pika.connect(second.url)
        channel = await connection.channel()
        await channel.declare_queue(
            "replicated", durable=True, arguments={"x-queue-type": "quorum"}
        )
        await connection.close()
        assert "replicated" in await first.rabbitmqctl("list_queues", "-q", "name")
    assert all(is_gone(node) for node in cluster.nodes)
